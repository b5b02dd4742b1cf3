"""Our hooks driven by THUDM/slime's OWN code (the pinned commit, `make slime`), on CPU.

For every recipe `opd launch` runs on slime, the arguments `opd launch` writes are parsed by
slime's own argument parser, and slime's real functions carry our samples from the
generate hook's return to the loss scalar:

    RolloutManager._get_rollout_data (the rollout-id contract, flattening)
    -> log_rollout_data (our rollout-log hook) -> _convert_samples_to_train_data (our
    reward post-process) -> _split_train_data_by_dp (dp_schedule) -> [gloo ranks]
    MegatronTrainRayActor._get_rollout_data (CP slicing) -> get_log_probs_and_entropy (the
    recomputed log_probs) -> compute_advantages_and_returns (our advantage hook for OPRD)
    -> get_data_iterator / get_batch -> loss_function (our custom loss) ->
    reduce_train_step_metrics (what slime logs)

with megatron-core's parallel_state over gloo at TP x CP x DP = 1x1x1, 2x1x1, 1x2x2 and
2x2x1. The model is replaced by given logits (issue 21 runs Megatron's model): the loss,
its gradient with respect to every rank's logits (scaled as Megatron's schedule and DDP
scale them) and the logged metrics equal a plain-torch single-process reference.

Only what cannot exist on CPU is a stand-in (tests/slime_cpu.py: import-only sglang,
torch_memory_saver, megatron.training; Ray's object store is bypassed by handing slime's
Box its payload). Without slime the module skips, saying how to install it; under CI it
fails instead (CI must run it).
"""

from __future__ import annotations

import asyncio
import warnings
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import slime_cpu
from tests.slime_driver import require_slime, rollout_manager, run_ranks, slime_args, split_by_dp

require_slime()

from rollout.trajectory import TrajectoryStatus  # noqa: E402
from slime_ext.job.config import config_from_dict  # noqa: E402
from slime_ext.sft_data import turn_records, write_records  # noqa: E402
from slime_ext.slime.samples import to_samples  # noqa: E402
from slime_ext.slime.settings import HookConfigError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

RECIPES = ("opd", "opsd", "oprd", "rl", "sft", "ssd")
CASES: dict[str, tuple[str, list[str], dict[str, Any]]] = {
    **{recipe: (recipe, [], {}) for recipe in RECIPES},
    # extra_train_args that `opd launch` lets through and that change what reaches the hooks
    "opd --use-rollout-logprobs": ("opd", ["--use-rollout-logprobs"], {}),
    "rl --disable-rewards-normalization": ("rl", ["--disable-rewards-normalization"], {}),
    # the teacher's top-k, carried by slime_ext.slime.topk
    "opd topk_tail": ("opd", [], {"opd_loss": "topk_tail"}),
    "opsd topk_renorm": ("opsd", [], {"opd_loss": "topk_renorm"}),
    "oprd teacher_topk": ("oprd", [], {"oprd_failure_loss": "teacher_topk"}),
}
"""Each case: the recipe, the cluster.extra_train_args and the algorithm settings of its job."""
TOP_K = 4
"""teacher.top_k of the top-k cases."""
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 1)]
"""(TP, CP, DP) of the gloo runs."""
TEMPERATURE = 0.8
KL_COEF = 0.5
LAMBDA_POS, LAMBDA_NEG = 0.5, 2.0
ATOL = 1e-5
MAX_TOKENS_PER_GPU = 320
# rollouts: (trajectory of _scripted: 0 mul (reward 1), 1 half, 2 wrong (0)), group;
# an aborted trajectory becomes a removable placeholder
ROLLOUTS = [(0, 0), (2, 0), (1, 1), ("aborted", 1), (0, 2), (1, 2)]


def job_dict(
    recipe: str,
    tmp_path: Path,
    extra_args: list[str] | None = None,
    algorithm_settings: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A cluster job of `recipe` whose plan `opd launch` accepts."""
    teacher: dict[str, Any] = {"kind": "remote", "url": "http://127.0.0.1:9"}
    algorithm: dict[str, Any] = {"recipe": recipe, "kl_coef": KL_COEF, "steps": 2}
    if recipe in ("opsd", "oprd"):
        teacher = {"kind": "self", "url": "http://127.0.0.1:9", "snapshot": "fixed"}
    if recipe == "oprd":
        algorithm |= {
            "oprd_failure_loss": "sampled",
            "oprd_success_weight": LAMBDA_POS,
            "oprd_failure_weight": LAMBDA_NEG,
        }
    algorithm |= algorithm_settings or {}
    if algorithm.get("opd_loss", "sampled") != "sampled" or (
        algorithm.get("oprd_failure_loss") == "teacher_topk"
    ):
        teacher["top_k"] = TOP_K
    return {
        "model": {"student": str(tmp_path / "student")},
        "parallel": {
            "num_nodes": 1,
            "gpus_per_node": 4,
            "max_tokens_per_gpu": MAX_TOKENS_PER_GPU,
        },
        "rollout": {
            "temperature": TEMPERATURE,
            "max_context_tokens": 256,
            "max_new_tokens": 48,
            "tasks_per_step": 3,
            "samples_per_task": 2,  # sft / ssd: trajectories per step = tasks x samples
        },
        "teacher": teacher,
        "algorithm": algorithm,
        "logging": {"wandb_mode": "disabled", "run_dir": str(tmp_path / "run")},
        "cluster": {
            "head": "127.0.0.1",
            "model_args_script": "scripts/models/qwen3-4B.sh",
            "megatron_checkpoint": str(tmp_path / "torch_dist"),
            "save_dir": str(tmp_path / "save"),
            "tasks_file": str(tmp_path / "tasks.jsonl"),
            "extra_train_args": extra_args or [],
        },
    }


# --- samples, as the generate hook and the SFT rollout give them --------------------------


def rollout_groups(
    recipe: str,
    args: Any,
    tmp_path: Path,
    trajectories: list[Any],
    layout: str = "per_turn",
) -> list[Any]:
    """What slime's generate_rollout returns for one rollout step: groups of per-rollout
    lists of real slime Samples, made by our hooks' code (`layout` packed: one tree-packed
    sample per trajectory)."""
    from slime.utils.types import Sample

    from slime_ext.slime.generate import loss_kind
    from slime_ext.slime.settings import job_config
    from slime_ext.slime.sft_rollout import generate_rollout

    if recipe in ("sft", "ssd"):
        records = [r for t in trajectories for r in turn_records(t)]
        data = tmp_path / "records.jsonl"
        write_records(data, records)
        args.opd_sft_data = str(data)
        return [generate_rollout(args, step, None) for step in range(2)]
    job = job_config(args)
    groups: dict[int, list[list[Any]]] = defaultdict(list)
    for rollout_id, (which, group) in enumerate(ROLLOUTS):
        base = Sample(index=rollout_id, group_index=group, prompt="p", metadata={"source": "x"})
        if which == "aborted":
            trajectory = trajectories[2].model_copy(
                update={
                    "status": TrajectoryStatus.SANDBOX_ERROR,
                    "status_reason": "SandboxDiedError: gone",
                }
            )
        else:
            trajectory = trajectories[int(which)]
        samples = to_samples(
            trajectory,
            base,
            loss_kind=loss_kind(recipe, trajectory),
            with_teacher=recipe in ("opd", "opsd", "oprd"),
            teacher_top_k=job.teacher.top_k if job.needs_teacher_topk else 0,
            layout=layout,  # type: ignore[arg-type]
        )
        groups[group].append(samples)
    return [list(groups.values())]


def rollout_side(args: Any, steps: list[Any], dp_size: int) -> tuple[list[Any], list[Any], Any]:
    """slime's RolloutManager on the samples of `steps` (one rollout step, or the SFT
    rollout's two concatenated): the flattened samples, the per-DP-rank payloads, and
    what our rollout-log hook reported."""
    from slime.observability.rollout_metrics import log_rollout_data

    manager = rollout_manager(args, [group for step in steps for group in step], dp_size)
    samples, _ = manager._get_rollout_data(rollout_id=0)
    logged: dict[str, Any] = {}
    log_rollout_data(0, args, samples, logged, 1.0)
    data = manager._convert_samples_to_train_data(samples)
    return samples, split_by_dp(manager, data), logged


def recipe_args(
    recipe: str,
    directory: Path,
    tp: int,
    cp: int,
    vocab: int,
    extra_args: tuple[str, ...] | list[str] = (),
    algorithm_settings: dict[str, Any] | None = None,
) -> Any:
    job = config_from_dict(job_dict(recipe, directory, list(extra_args), algorithm_settings))
    return slime_args(job, directory, tp=tp, cp=cp, vocab=vocab)


# --- the plain-torch reference -------------------------------------------------------------


def topk_kl(logp: torch.Tensor, rows: Any, tail: bool) -> torch.Tensor:
    """KL(p_S || p_T) on the teacher's top-k per row, restated in plain torch: the student's
    log-probs [R, V] at the rows' ids, both sides renormalized on them, or both kept with one
    bucket each for the rest of the mass (floored at 1e-8)."""
    student = logp.gather(-1, rows.ids.long())
    teacher = rows.logprobs.double()
    if not tail:
        student = student - student.logsumexp(-1, keepdim=True)
        teacher = teacher - teacher.logsumexp(-1, keepdim=True)
    kl = (student.exp() * (student - teacher)).sum(-1)
    if tail:
        rest_s = torch.log((1 - student.exp().sum(-1)).clamp(min=1e-8))
        rest_t = torch.log((1 - teacher.exp().sum(-1)).clamp(min=1e-8))
        kl = kl + rest_s.exp() * (rest_s - rest_t)
    return kl


def reference(
    recipe: str, samples: list[Any], logits: list[torch.Tensor], args: Any, loss: str = "sampled"
) -> tuple[float, dict[str, float], list[torch.Tensor]]:
    """The objective summed over the optimizer steps (each step: its rollouts' per-trajectory
    token means, divided by the rollouts per step), its per-step metric means summed, and
    d(objective)/d(each sample's logits), by plain torch on whole sequences. `loss`: the KL
    to the teacher, sampled or on its top-k (topk_tail / topk_renorm)."""
    from slime_ext.slime.topk import of_sample

    step_rollouts = args.global_batch_size
    leaves = [x.clone().requires_grad_(True) for x in logits]
    order: list[int] = []
    parts: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any]]] = {}
    top: dict[int, list[torch.Tensor]] = defaultdict(list)  # per rollout, each piece's KL
    for sample, x in zip(samples, leaves, strict=True):
        rid = sample.rollout_id
        if rid not in parts:
            order.append(rid)
            parts[rid] = []
        if sample.remove_sample:
            continue
        response = sample.response_length
        targets = torch.tensor(sample.tokens[-response:])
        rows = x[len(sample.tokens) - response - 1 : len(sample.tokens) - 1] / TEMPERATURE
        logp = torch.log_softmax(rows.double(), -1)
        student = logp.gather(-1, targets[:, None])[:, 0]
        teacher = torch.tensor(sample.teacher_log_probs or [0.0] * response, dtype=torch.float64)
        mask = torch.tensor(sample.loss_mask, dtype=torch.float64)
        parts[rid].append((student, teacher, mask, sample))
        if loss != "sampled":
            top[rid].append(topk_kl(logp, of_sample(sample), tail=loss == "topk_tail"))
    advantages = group_advantages(samples, normalized=args.rewards_normalization)
    objective = torch.zeros((), dtype=torch.float64)
    value = 0.0
    metrics: dict[str, float] = defaultdict(float)
    for start in range(0, len(order), step_rollouts):
        step = [rid for rid in order[start : start + step_rollouts] if parts[rid]]
        successes = [rid for rid in step if float(parts[rid][0][3].reward) > 0]
        failures = [rid for rid in step if rid not in successes]
        for rid in step:
            pieces = parts[rid]
            denom = max(sum(float(m.sum()) for _, _, m, _ in pieces), 1.0)
            k = sum(((s - t) * m).sum() for s, t, m, _ in pieces).detach() / denom
            if loss != "sampled":
                kl = (
                    sum((x * m).sum() for x, (_, _, m, _) in zip(top[rid], pieces, strict=True))
                    / denom
                )
                at_rollout = sum(
                    ((torch.tensor(p.rollout_log_probs, dtype=torch.float64) - t) * m).sum()
                    for _, t, m, p in pieces
                )
            if recipe in ("opd", "opsd") and loss != "sampled":
                objective = objective + KL_COEF * kl / step_rollouts
                value += KL_COEF * float(kl) / step_rollouts
                metrics["teacher_topk_kl"] += float(kl) / step_rollouts
                # the sampled estimator at the rollout's own log-probs, as the local trainer
                metrics["opd_reverse_kl"] += float(at_rollout) / denom / step_rollouts
                continue
            if recipe == "oprd" and loss != "sampled" and rid not in successes:
                objective = objective + LAMBDA_NEG * kl / len(failures)
                value += LAMBDA_NEG * float(kl) / len(failures)
                metrics["failure_branch_loss"] += float(kl) / len(failures)
                metrics["teacher_topk_kl"] += float(kl) / len(failures)
                continue
            nll = sum((-s * m).sum() for s, _, m, _ in pieces) / denom
            surrogate = sum(((s - t).detach() * s * m).sum() for s, t, m, _ in pieces) / denom
            if recipe == "opd" and args.use_rollout_logprobs:  # PPO-clipped, vs the rollout's
                clipped, k = torch.zeros((), dtype=torch.float64), torch.zeros(())
                for s, t, m, sample in pieces:
                    old = torch.tensor(sample.rollout_log_probs, dtype=torch.float64)
                    ratio = torch.exp(s - old)
                    low, high = 1 - args.eps_clip, 1 + (args.eps_clip_high or args.eps_clip)
                    per_token = torch.maximum(
                        -(t - old) * ratio, -(t - old) * ratio.clamp(low, high)
                    )
                    clipped = clipped + (per_token * m).sum() / denom
                    k = k + float(((old - t) * m).sum()) / denom
                objective = objective + KL_COEF * clipped / step_rollouts
                value += KL_COEF * float(clipped) / step_rollouts
                metrics["opd_reverse_kl"] += float(k) / step_rollouts
            elif recipe in ("opd", "opsd"):
                objective = objective + KL_COEF * surrogate / step_rollouts
                value += KL_COEF * float(k) / step_rollouts
                metrics["opd_reverse_kl"] += float(k) / step_rollouts
            elif recipe in ("sft", "ssd"):
                objective = objective + nll / step_rollouts
                value += float(nll) / step_rollouts
            elif recipe == "rl":
                pg = sum((-advantages[rid] * s * m).sum() for s, _, m, _ in pieces) / denom
                objective = objective + pg / step_rollouts
                value += float(pg) / step_rollouts
            elif rid in successes:  # oprd
                objective = objective + LAMBDA_POS * nll / len(successes)
                value += LAMBDA_POS * float(nll) / len(successes)
                metrics["success_branch_loss"] += float(nll) / len(successes)
            else:
                objective = objective + LAMBDA_NEG * surrogate / len(failures)
                value += LAMBDA_NEG * float(k) / len(failures)
                metrics["failure_branch_loss"] += float(k) / len(failures)
    objective.backward()
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]
    return value, dict(metrics), grads


def group_advantages(samples: list[Any], normalized: bool = True) -> dict[int, float]:
    """GRPO: each live trajectory's reward normalized within its prompt group (unbiased std);
    its raw reward when normalization is off."""
    rewards: dict[int, tuple[int, float]] = {}
    for sample in samples:
        if not sample.remove_sample:
            rewards.setdefault(sample.rollout_id, (sample.group_index, float(sample.reward)))
    by_group: dict[int, list[float]] = defaultdict(list)
    for group, reward in rewards.values():
        by_group[group].append(reward)
    out = {}
    for rid, (group, reward) in rewards.items():
        if not normalized:
            out[rid] = reward
            continue
        values = torch.tensor(by_group[group], dtype=torch.float64)
        std = float(values.std()) if len(values) > 1 else 0.0
        out[rid] = (reward - float(values.mean())) / (std + 1e-6)
    return out


# --- one gloo rank -------------------------------------------------------------------------


def _rank(rank: int, world: int, init_method: str, layout: tuple[int, int, int], path: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    slime_cpu.install()
    import ray
    from megatron.core import parallel_state as mpu

    tp, cp, _ = layout
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world,
        timeout=timedelta(seconds=90),
    )  # fmt: skip
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    ray.get = lambda value, **kwargs: value  # the payload slime's Box holds, not a ref
    cases = torch.load(f"{path}/cases.pt", weights_only=False)
    results = {}
    with slime_cpu.cpu_accelerator():
        for recipe, case in cases.items():
            results[recipe] = _train_side(case)
    torch.save(results, f"{path}/rank{rank}.pt")
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


def _train_side(case: dict[str, Any]) -> dict[str, Any]:
    """slime's actor on this rank's payload; the given logits in place of the model."""
    from megatron.core import parallel_state as mpu
    from slime.backends.megatron_utils import model
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.cp_utils import slice_with_cp
    from slime.backends.megatron_utils.data import DataIterator, get_data_iterator
    from slime.backends.megatron_utils.loss import (
        compute_advantages_and_returns,
        get_log_probs_and_entropy,
        loss_function,
    )
    from slime.observability.train_metric_utils import reduce_train_step_metrics

    from slime_ext.slime import topk

    topk.init(None)  # what --custom-megatron-init-path does on every Megatron rank
    get_batch = model.get_batch  # the training step's, as forward_step looks it up
    args, logits, expected = case["args"], case["logits"], case["grads"]
    tp_rank, tp = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=False)
    dp_cp = mpu.get_data_parallel_world_size(with_context_parallel=True)
    shard = args.padded_vocab_size // tp
    columns = slice(tp_rank * shard, (tp_rank + 1) * shard)
    actor = SimpleNamespace(args=args)
    rollout_data = MegatronTrainRayActor._get_rollout_data(actor, case["boxes"])
    partition = rollout_data["partition"]

    def local_logits(indices: list[int], rows: int, full: list[torch.Tensor]) -> torch.Tensor:
        """The model's output for a packed micro-batch: each sample CP-sliced as get_batch
        slices its tokens, padded to the batch's rows, this TP rank's vocabulary columns."""
        packed = torch.cat([slice_with_cp(full[partition[i]], 0.0) for i in indices])
        packed = torch.cat([packed, packed.new_zeros(rows - len(packed), packed.size(1))])
        return packed[:, columns][None].contiguous()

    # with custom_loss slime recomputes log_probs before training (actor.train_actor)
    rollout_data["log_probs"] = [
        get_log_probs_and_entropy(
            local_logits([i], len(slice_with_cp(logits[partition[i]], 0.0)), logits).detach(),
            args=args,
            unconcat_tokens=[rollout_data["tokens"][i]],
            total_lengths=[rollout_data["total_lengths"][i]],
            response_lengths=[rollout_data["response_lengths"][i]],
        )[1]["log_probs"][0]
        for i in range(len(partition))
    ]
    if args.compute_advantages_and_returns:
        compute_advantages_and_returns(args, rollout_data)
    [iterator] = get_data_iterator(rollout_data)
    keys = [  # train_one_step's forward_step (slime/backends/megatron_utils/model.py)
        "tokens", "multimodal_train_inputs", "packed_seq_params", "total_lengths",
        "response_lengths", "loss_masks", "log_probs", "ref_log_probs", "values",
        "advantages", "returns", "rollout_log_probs", "teacher_log_probs", "rollout_mask_sums",
    ]  # fmt: skip
    loss_total, worst, logged = 0.0, 0.0, []
    for num_microbatches, step_size in zip(
        rollout_data["num_microbatches"], rollout_data["global_batch_sizes"], strict=True
    ):
        reports = []
        for _ in range(num_microbatches):
            indices = iterator.micro_batch_indices[iterator.offset]
            batch = get_batch(iterator, keys, args.data_pad_size_multiplier, args.allgather_cp)
            rows = batch["tokens"].size(1)
            given = local_logits(indices, rows, logits).requires_grad_(True)
            loss, _, report = loss_function(args, batch, num_microbatches, step_size, given)
            # Megatron's schedule divides by the micro-batches, DDP averages over DP x CP
            effective = loss / (num_microbatches * dp_cp)
            effective.backward()
            assert given.grad is not None
            want = local_logits(indices, rows, expected)
            worst = max(worst, float((given.grad - want).abs().max()))
            loss_total += float(effective)
            reports.append(report)
        logged.append(
            reduce_train_step_metrics(
                reports,
                calculate_per_token_loss=args.calculate_per_token_loss,
                step_global_batch_size=step_size,
                cp_size=mpu.get_context_parallel_world_size(),
                dp_with_cp_group=mpu.get_data_parallel_group(with_context_parallel=True),
            )
        )
    # a sample none of whose response this CP rank holds, alone in a micro-batch: the
    # loss is a zero still connected to the logits (every rank must run backward)
    empty_alone = 0
    for i, local in enumerate(rollout_data["log_probs"]):
        if len(local) > 0:
            continue
        alone = DataIterator(rollout_data, [[i]])
        batch = get_batch(alone, keys, args.data_pad_size_multiplier, args.allgather_cp)
        given = local_logits([i], batch["tokens"].size(1), logits).requires_grad_(True)
        loss, _, _ = loss_function(args, batch, 1, 1, given)
        assert loss.requires_grad and float(loss) == 0.0
        loss.backward()
        assert given.grad is not None and torch.count_nonzero(given.grad) == 0
        empty_alone += 1
    return {
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "loss": loss_total,
        "grad_max_error": worst,
        "logged": logged,
        "samples": len(partition),
        "empty_alone": empty_alone,
    }


# --- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trajectories(factory_tokenizer: Any) -> list[Any]:
    return scripted_with_topk(factory_tokenizer)


def scripted_with_topk(factory_tokenizer: Any, think_policy: str = "drop") -> list[Any]:
    """test_slime_hooks' scripted trajectories (0 mul, 1 half, 2 wrong), every turn also
    carrying a teacher top-k of TOP_K ids (the top of a random distribution)."""
    from tests.test_slime_hooks import _scripted

    scripted = _scripted(factory_tokenizer, think_policy)
    assert [t.reward for t in scripted][::2] == [1.0, 0.0]  # mul succeeds, wrong fails
    generator = torch.Generator().manual_seed(7)
    for trajectory in scripted:  # as if the teacher had also given its top-k
        for turn in trajectory.turns:
            logp = torch.log_softmax(
                torch.randn(len(turn.span_ids), len(factory_tokenizer), generator=generator) * 3,
                -1,
            )
            values, ids = logp.topk(TOP_K, dim=-1)
            turn.teacher_topk_ids, turn.teacher_topk_logprobs = ids.tolist(), values.tolist()
    return scripted


def _cases(
    tmp_path: Path, trajectories: list[Any], layout: tuple[int, int, int], vocab: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    tp, cp, dp = layout
    cases, expected = {}, {}
    for index, (case, (recipe, extra_args, settings)) in enumerate(CASES.items()):
        directory = tmp_path / f"case{index}"
        directory.mkdir()
        args = recipe_args(recipe, directory, tp, cp, vocab, extra_args, settings)
        steps = rollout_groups(recipe, args, directory, trajectories)
        samples, boxes, logged = rollout_side(args, steps, dp)
        generator = torch.Generator().manual_seed(index)
        logits = [torch.randn(len(s.tokens), vocab, generator=generator) * 2 for s in samples]
        loss = settings.get("opd_loss", "sampled")
        if settings.get("oprd_failure_loss") == "teacher_topk":
            loss = "topk_tail"
        value, metrics, grads = reference(recipe, samples, logits, args, loss)
        cases[case] = {"args": args, "boxes": boxes, "logits": logits, "grads": grads}
        expected[case] = {"loss": value, "metrics": metrics, "rollout_log": logged}
    return cases, expected


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda t: "tp{}-cp{}-dp{}".format(*t))
def test_every_recipe_through_slimes_own_data_path_equals_the_reference(
    tmp_path: Path, trajectories: list[Any], factory_tokenizer: Any, layout: tuple[int, int, int]
) -> None:
    vocab = len(factory_tokenizer)
    tp, cp, dp = layout
    cases, expected = _cases(tmp_path, trajectories, layout, vocab)
    torch.save(cases, tmp_path / "cases.pt")
    ranks = run_ranks(_rank, tp * cp * dp, layout, tmp_path)
    for case, (recipe, _, _) in CASES.items():
        want = expected[case]
        results = [r[case] for r in ranks]
        assert sum(r["samples"] for r in results) == len(cases[case]["logits"]) * tp * cp
        for tp_rank in range(tp):
            mine = [r for r in results if r["tp_rank"] == tp_rank]
            loss = sum(r["loss"] for r in mine)
            assert loss == pytest.approx(want["loss"], abs=ATOL), (case, layout)
        for r in results:
            assert r["grad_max_error"] < ATOL, (case, layout, r["grad_max_error"])
            for key, value in want["metrics"].items():  # what slime logs (train/...)
                assert sum(step[key] for step in r["logged"]) == pytest.approx(value, abs=ATOL)
        if cp > 1 and recipe != "sft" and recipe != "ssd":  # the placeholder's one token
            assert sum(r["empty_alone"] for r in results) >= tp, (case, layout)
        log = want["rollout_log"]
        if recipe in ("sft", "ssd"):
            assert log["rollout/num_turns"] == pytest.approx((3 + 3 + 2) / 3)
        else:
            assert log["rollout/abort_count/SandboxDiedError: gone"] == 1.0
            assert log["rollout/num_turns"] == pytest.approx((3 + 2 + 3 + 2 + 3 + 3) / 6)


def test_hooks_refuse_slime_flags_that_break_the_objective(tmp_path: Path) -> None:
    """--group-rm, --allgather-cp, --calculate-per-token-loss and --rollout-top-p < 1 make
    slime crash on our samples or train another objective: the hooks refuse them, naming
    the flag, before any sample is made."""
    from slime_ext.slime.reward import reward
    from slime_ext.slime.settings import job_config

    for flag, value in [
        ("group_rm", True), ("allgather_cp", True), ("calculate_per_token_loss", True),
        ("rollout_top_p", 0.9),
    ]:  # fmt: skip
        args = recipe_args("opd", tmp_path, 1, 1, 16)
        setattr(args, flag, value)
        with pytest.raises(HookConfigError, match=flag.replace("_", "-")):
            job_config(args)
    args = recipe_args("opd", tmp_path, 1, 1, 16)
    args.group_rm = True
    with pytest.raises(HookConfigError, match="group-rm"):
        asyncio.run(reward(args, [[SimpleNamespace(metadata={})]]))


MEGATRON_LM_FLAGS = frozenset(
    {
        "--tensor-model-parallel-size", "--context-parallel-size",
        "--pipeline-model-parallel-size", "--expert-model-parallel-size",
        "--expert-tensor-parallel-size", "--sequence-parallel", "--optimizer",
        "--lr-decay-style", "--lr-warmup-iters", "--min-lr", "--lr-decay-iters",
        "--weight-decay", "--attention-dropout", "--hidden-dropout",
        "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
    }
)  # fmt: skip
"""The flags the plan writes for Megatron-LM's parser (megatron/training/arguments.py)."""


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_flag_the_plan_writes_is_one_slime_or_megatron_reads(
    tmp_path: Path, recipe: str
) -> None:
    """slime hands Megatron-LM's parser what its own parser does not know, and Megatron
    drops unknown flags silently (ignore_unknown_args): a misspelled slime flag in the plan
    would vanish. Every flag left over by slime's parser must be one of Megatron's."""
    import argparse

    from slime.backends.sglang_utils.arguments import add_sglang_router_arguments
    from slime.utils.arguments import get_slime_extra_args_provider

    from launch.plan import train_args

    parser = argparse.ArgumentParser(allow_abbrev=False)
    get_slime_extra_args_provider()(parser)
    try:
        add_sglang_router_arguments(parser)
    except slime_cpu.StandInCalled:
        pytest.skip("sglang_router is not installed: the --router-* flags are its own")
    job = config_from_dict(job_dict(recipe, tmp_path))
    _, left = parser.parse_known_args(train_args(job, str(tmp_path / "hooks.yaml")))
    assert {arg for arg in left if arg.startswith("--")} <= MEGATRON_LM_FLAGS
