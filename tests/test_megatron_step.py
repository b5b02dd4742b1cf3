"""Real megatron-core training steps, driven by THUDM/slime's own train_one_step, on CPU.

test_slime_real gives slime's loss path logits; here a real GPTModel produces them. The
opd job's samples go through slime's RolloutManager and DP split (as test_slime_real), then
on gloo ranks at TP x CP x DP:

    MegatronTrainRayActor._get_rollout_data -> compute_log_prob (slime's forward_only with
    the model) -> compute_advantages_and_returns -> get_data_iterator -> train_one_step
    (Megatron's schedule, our custom loss, DDP, get_megatron_optimizer's Adam, the
    OptimizerParamScheduler)

three times. The parameters, gathered to full tensors, must equal a single-process
reference: the same GPTModel at TP1 on each sample alone (Megatron's local attention, an
explicit causal mask), test_slime_real's plain-torch objective (per-trajectory means of
DESIGN.md invariant 7 over the step's rollouts) backpropagated, then Adam without momentum
by hand: p -= lr * grad / (|grad| + eps). A loss scaled by 2 is the negative control.
The CPU redirects are in tests/megatron_cpu.py.

With the teacher's top-k (opd_loss topk_tail), the rows ride slime_ext.slime.topk's
extension of slime's data path into the same steps; besides the parameters, the loss of
the first step, as slime reports it, equals the local trainer's (LocalTrainer.loss, the
embedded mode's) on the same trajectories and weights: the TP1 GPTModel behind the
interface the local trainer reads (hidden states, output embedding).
"""

from __future__ import annotations

import copy
import importlib
import warnings
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import slime_cpu
from tests.slime_driver import require_slime, run_ranks, spawn_ranks

require_slime()

from tests.test_slime_real import (  # noqa: E402
    KL_COEF,
    ROLLOUTS,
    TEMPERATURE,
    recipe_args,
    reference,
    rollout_groups,
    rollout_side,
    scripted_with_topk,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

LAYOUTS = {
    "tp2-dp2": (2, 1, 2, False),
    "tp2-dp2-sp": (2, 1, 2, True),
    "tp2-cp2": (2, 2, 1, False),
    "tp1-cp2-dp2": (1, 2, 2, False),
}
"""(TP, CP, DP, sequence parallel) of the gloo runs."""
STEPS = 3
LR, ADAM_EPS = 50.0, 1e3
"""Adam without momentum (betas 0) and an eps far above every gradient: the update
lr * g / (|g| + eps) is about g / 20, so it shows the gradient's scale (the distributed
optimizer takes only Adam; Adam's usual first steps, g / |g|, would hide a scale error)."""
HIDDEN, HEADS, FFN, LAYERS = 32, 4, 64, 2
ATOL = 1e-6
HYBRID_SEED = 11
RECIPE = "opd"
TOPK_SETTINGS = {"opd_loss": "topk_tail"}
TOPK_ATOL = 1e-5
MAX_TOKENS_PER_GPU = 640
"""Two or three samples per micro-batch: at test_slime_real's 320 each sample fills one,
and slime's DP schedule cannot split 15 one-sample micro-batches evenly over DP 2."""


def model_config(tp: int, cp: int, sequence_parallel: bool) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        sequence_parallel=sequence_parallel, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
    )  # fmt: skip


def gpt_model(
    config: Any, vocab: int, packed: bool, tree: bool = False, hybrid_args: Any = None
) -> Any:
    """The test GPTModel; `tree`: with our tree attention in its layer spec (and RoPE
    moved into it: position_embedding_type none), as slime builds it from
    `--spec slime_ext.slime.tree_attention layer_spec`; `hybrid_args` (slime's args, whose
    hf_checkpoint's config has linear-attention layers): slime's Gated DeltaNet layers
    taking the tree there (slime_ext.slime.hybrid_attention), as that spec builds them."""
    from megatron.core.models.gpt import GPTModel

    from slime_ext.slime.hybrid_attention import hybrid_spec
    from slime_ext.slime.tree_attention import Rope, with_tree_attention
    from tests.megatron_cpu import gpt_block_spec

    spec = gpt_block_spec(LAYERS, packed=packed)
    if tree:
        spec = with_tree_attention(spec, Rope())
    if hybrid_args is not None:
        spec = hybrid_spec(spec, hybrid_args, config, None)
    return GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=vocab, max_sequence_length=1024,
        position_embedding_type="none" if tree else "rope",
        share_embeddings_and_output_weights=False,
    )  # fmt: skip


def init_process(rank: int, world: int, init_method: str, tp: int, cp: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    slime_cpu.install()
    from megatron.core import parallel_state as mpu

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world,
        timeout=timedelta(seconds=90),
    )  # fmt: skip
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)


def close_process() -> None:
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    dist.destroy_process_group()


# --- the single-process reference ------------------------------------------------------------


def _reference_rank(rank: int, world: int, init_method: str, path: str) -> None:
    from tests.megatron_cpu import cpu_redirects

    init_process(rank, world, init_method, 1, 1)
    case = torch.load(f"{path}/reference_case.pt", weights_only=False)
    args, samples, loss = case["args"], case["samples"], case["loss"]
    local_loss = None
    with cpu_redirects():
        torch.manual_seed(0)
        model = gpt_model(model_config(1, 1, False), args.padded_vocab_size, packed=False)
        initial = {k: v.detach().clone() for k, v in model.named_parameters()}
        if loss != "sampled":
            local_loss = _local_trainer_loss(model, case["trajectories"], loss)
        for _ in range(STEPS):
            model.zero_grad()
            logits = [sample_logits(model, s.tokens) for s in samples]
            detached = [x.detach() for x in logits]
            _, _, grads = reference(RECIPE, samples, detached, args, loss)
            torch.autograd.backward(logits, grads)
            with torch.no_grad():
                for param in model.parameters():
                    if param.grad is not None:
                        param -= LR * param.grad / (param.grad.abs() + ADAM_EPS)
    final = {k: v.detach().clone() for k, v in model.named_parameters()}
    torch.save(
        {"initial": initial, "final": final, "local_loss": local_loss}, f"{path}/reference.pt"
    )
    close_process()


class AsLocalStudent(torch.nn.Module):
    """A TP1 GPTModel behind what LocalTrainer reads of an HF causal LM: base_model(...)
    .last_hidden_state (the decoder's output, final norm applied) for right-padded rows,
    get_output_embeddings().weight, config.pad_token_id."""

    def __init__(self, gpt: Any) -> None:
        super().__init__()
        self.gpt = gpt
        self.config = SimpleNamespace(pad_token_id=0)

    @property
    def base_model(self) -> Any:
        return self._hidden

    def get_output_embeddings(self) -> Any:
        return self.gpt.output_layer

    def _hidden(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: Any = None
    ) -> Any:
        captured: list[torch.Tensor] = []
        hook = self.gpt.decoder.register_forward_hook(
            lambda module, inputs, output: captured.append(
                output[0] if isinstance(output, tuple) else output
            )
        )
        rows = []
        try:
            for ids, mask in zip(input_ids, attention_mask, strict=True):
                length = int(mask.sum())
                logits = sample_logits(self.gpt, ids[:length].tolist())
                hidden = captured.pop()[:, 0]  # [s, b, h] -> [s, h]
                weight = self.gpt.output_layer.weight
                assert torch.allclose(hidden @ weight.t(), logits, atol=1e-5)
                rows.append(
                    torch.cat([hidden, hidden.new_zeros(len(ids) - length, len(hidden[0]))])
                )
        finally:
            hook.remove()
        return SimpleNamespace(last_hidden_state=torch.stack(rows))


def _local_trainer_loss(gpt: Any, trajectories: list[Any], loss: str) -> float:
    """LocalTrainer's loss of recipe opd with `loss` on the trajectories, at gpt's weights."""
    from slime_ext.local.trainer import LocalTrainer, TrainerConfig

    config = TrainerConfig(
        opd_loss=loss, kl_coef=KL_COEF, temperature=TEMPERATURE, sequence_layout="per_turn"
    )
    value, _ = LocalTrainer(AsLocalStudent(gpt), config).loss(trajectories, "opd")
    return float(value)


def sample_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    """One whole sequence through the TP1 model, with an explicit causal mask (Megatron's
    default one is made on device="cuda", transformer/utils.py:35)."""
    length = len(tokens)
    causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    return model(
        input_ids=torch.tensor([tokens]),
        position_ids=torch.arange(length)[None],
        attention_mask=causal[None, None],
    )[0]


# --- one gloo rank ---------------------------------------------------------------------------


def doubled_loss(args: Any, batch: Any, logits: Any, sum_of_sample_mean: Any) -> Any:
    """The negative control: our loss times 2."""
    from slime_ext.slime.loss import loss

    value, metrics = loss(args, batch, logits, sum_of_sample_mean)
    return 2 * value, metrics


def _rank(
    rank: int, world: int, init_method: str, layout: tuple[int, int, int, bool], path: str
) -> None:
    """Each of the case's runs (`patches`: dotted names of functions given a MonkeyPatch
    for that run) trained on this rank; the results saved for the test."""
    import ray

    from tests.megatron_cpu import cpu_redirects

    tp, cp, _, _ = layout
    init_process(rank, world, init_method, tp, cp)
    # slime's Box holds the payload itself here, not an object ref
    ray.get = lambda value, **kwargs: value  # type: ignore[assignment]
    case = torch.load(f"{path}/case.pt", weights_only=False)
    results = {}
    with slime_cpu.cpu_accelerator(), cpu_redirects():
        for name, run in case["runs"].items():
            with pytest.MonkeyPatch.context() as patch:
                for patcher in run.pop("patches", ()):  # a run's negative control
                    module, _, function = patcher.rpartition(".")
                    getattr(importlib.import_module(module), function)(patch)
                results[name] = _train(case, layout, **run)
    torch.save(results, f"{path}/rank{rank}.pt")
    close_process()


def _train(
    case: dict[str, Any],
    layout: tuple[int, int, int, bool],
    distributed: bool,
    loss_path: str,
    tree: bool = False,
    lose_trees: bool = False,
    boxes_key: str = "boxes",
    hybrid: bool = False,
) -> dict[str, Any]:
    """STEPS rollouts of slime's actor on this rank's payload; the full final parameters.
    `tree`: the model takes tree-packed samples (slime_ext.slime.tree_attention);
    `lose_trees`: their trees do not reach it (a negative control); `boxes_key`: the
    case's payload to train on; `hybrid`: slime's Gated DeltaNet layers where the case's
    hf_checkpoint says (its initial weights: each rank's build from one seed)."""
    from slime_ext.slime import tree as tree_path

    tree_path.init(args=None)  # --custom-megatron-init-path, as `opd launch` passes it
    tree_path.TREE_ATTRIBUTE = "lost" if lose_trees else "opd_tree"
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from slime.backends.megatron_utils import model as slime_model
    from slime.backends.megatron_utils.actor import MegatronTrainRayActor
    from slime.backends.megatron_utils.data import get_data_iterator
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    tp, cp, _, sp = layout
    args = case["args"]
    args.custom_loss_function_path = loss_path
    # Megatron-LM's parser owns these; Megatron's no-pipelining schedule does not read them
    args.seq_length, args.decoder_seq_length = None, None
    config = model_config(tp, cp, sp)
    if hybrid:  # megatron's CPU initialization draws full tensors: one seed, one model
        torch.manual_seed(HYBRID_SEED)
    hybrid_args = args if hybrid else None
    model = gpt_model(
        config, args.padded_vocab_size, packed=True, tree=tree, hybrid_args=hybrid_args
    )
    if case.get("initial") is not None:
        load_full(model, case["initial"])
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=LR, min_lr=LR, weight_decay=0.0, adam_beta1=0.0,
            adam_beta2=0.0, adam_eps=ADAM_EPS, clip_grad=0.0,
            use_distributed_optimizer=distributed, params_dtype=torch.float32,
        ),
        [ddp],
    )  # fmt: skip
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=LR, max_lr=LR, min_lr=LR, lr_warmup_steps=0, lr_decay_steps=1,
        lr_decay_style="constant", start_wd=0.0, end_wd=0.0, wd_incr_steps=1,
        wd_incr_style="constant",
    )  # fmt: skip
    config.grad_scale_func = optimizer.scale_loss  # as slime's train() sets them
    config.finalize_model_grads_func = slime_model.finalize_model_grads
    actor = SimpleNamespace(args=args, model=[ddp])
    reported = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(slime_model, "get_args", lambda: args)
        for rollout_id in range(STEPS):
            # slime consumes the payload in place; Ray would hand each rollout its own copy
            boxes = case[boxes_key]
            data = MegatronTrainRayActor._get_rollout_data(actor, copy.deepcopy(boxes))
            iterator = get_data_iterator(data)
            data.update(
                MegatronTrainRayActor.compute_log_prob(actor, iterator, data["num_microbatches"])
            )
            compute_advantages_and_returns(args, data)
            for chunk_iterator in iterator:  # slime's train() rewinds them before the steps
                chunk_iterator.reset()
            for step_id, (microbatches, step_size) in enumerate(
                zip(data["num_microbatches"], data["global_batch_sizes"], strict=True)
            ):
                metrics, _ = slime_model.train_one_step(
                    args, rollout_id, step_id, iterator, [ddp], optimizer, scheduler,
                    microbatches, step_size,
                )  # fmt: skip
                reported.append(metrics)
    return {
        "partition": data["partition"],
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
        "final": full_state(model),
        "reported": reported,
    }


def load_full(model: Any, full: dict[str, torch.Tensor]) -> None:
    """Each parameter's TP shard of the full (TP1) tensor."""
    from megatron.core import parallel_state as mpu

    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            value = full[name]
            if getattr(param, "tensor_model_parallel", False):
                value = value.chunk(tp, dim=param.partition_dim)[tp_rank]
            param.copy_(value)


def full_state(model: Any) -> dict[str, torch.Tensor]:
    """The parameters gathered over TP to full tensors."""
    from megatron.core import parallel_state as mpu

    group = mpu.get_tensor_model_parallel_group()
    tp = mpu.get_tensor_model_parallel_world_size()
    out = {}
    for name, param in model.named_parameters():
        value = param.detach().clone()
        if getattr(param, "tensor_model_parallel", False) and tp > 1:
            pieces = [torch.empty_like(value) for _ in range(tp)]
            dist.all_gather(pieces, value.contiguous(), group=group)
            value = torch.cat(pieces, dim=param.partition_dim)
        out[name] = value
    return out


# --- the tests -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trajectories(factory_tokenizer: Any) -> list[Any]:
    return scripted_with_topk(factory_tokenizer)


def _reference_run(path: Path, trajectories: list[Any], vocab: int, loss: str) -> dict[str, Any]:
    """The samples of one rollout step and the reference's initial and final weights (and,
    for a top-k loss, the local trainer's loss at the initial weights)."""
    settings = {} if loss == "sampled" else TOPK_SETTINGS
    args = recipe_args(RECIPE, path, 1, 1, vocab, algorithm_settings=settings)
    samples, _, _ = rollout_side(args, [rollout_groups(RECIPE, args, path, trajectories)], 1)
    # the local trainer's batch of the step: an aborted rollout trains nothing and counts
    local = [
        trajectories[0].model_copy(update={"turns": []})
        if which == "aborted"
        else trajectories[int(which)]
        for which, _ in ROLLOUTS
    ]
    torch.save(
        {"args": args, "samples": samples, "loss": loss, "trajectories": local},
        path / "reference_case.pt",
    )
    spawn_ranks(_reference_rank, 1, str(path))
    result = torch.load(path / "reference.pt", weights_only=False)
    return {"samples": samples, **result}


@pytest.fixture(scope="module")
def reference_run(
    tmp_path_factory: pytest.TempPathFactory, trajectories: list[Any], factory_tokenizer: Any
) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("reference")
    return _reference_run(path, trajectories, len(factory_tokenizer), "sampled")


@pytest.fixture(scope="module")
def topk_reference_run(
    tmp_path_factory: pytest.TempPathFactory, trajectories: list[Any], factory_tokenizer: Any
) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("topk_reference")
    return _reference_run(path, trajectories, len(factory_tokenizer), TOPK_SETTINGS["opd_loss"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_megatron_training_steps_equal_the_single_process_reference(
    tmp_path: Path,
    trajectories: list[Any],
    factory_tokenizer: Any,
    reference_run: dict[str, Any],
    layout: tuple[int, int, int, bool],
) -> None:
    tp, cp, dp, _ = layout
    args = recipe_args(RECIPE, tmp_path, tp, cp, len(factory_tokenizer))
    args.max_tokens_per_gpu = MAX_TOKENS_PER_GPU
    samples, boxes, _ = rollout_side(
        args, [rollout_groups(RECIPE, args, tmp_path, trajectories)], dp
    )
    assert [s.tokens for s in samples] == [s.tokens for s in reference_run["samples"]]
    runs = {
        "plain": {"distributed": False, "loss_path": "slime_ext.slime.loss.loss"},
        "distributed": {"distributed": True, "loss_path": "slime_ext.slime.loss.loss"},
    }
    if layout == LAYOUTS["tp2-dp2"]:
        runs["doubled"] = {"distributed": False, "loss_path": f"{__name__}.doubled_loss"}
    torch.save(
        {"args": args, "boxes": boxes, "initial": reference_run["initial"], "runs": runs},
        tmp_path / "case.pt",
    )
    ranks = run_ranks(_rank, tp * cp * dp, layout, tmp_path)
    if dp > 1:  # one trajectory's turns train on two DP ranks, and weigh as in the reference
        rollouts_by_rank = [
            {samples[i].rollout_id for i in r["plain"]["partition"]}
            for r in ranks
            if r["plain"]["tp_rank"] == 0
        ]
        assert set.intersection(*rollouts_by_rank), rollouts_by_rank
    initial, final = reference_run["initial"], reference_run["final"]
    moved = max(float((final[k] - initial[k]).abs().max()) for k in final)
    assert moved > 1e-3  # the steps change the weights
    for name in runs:
        errors = [
            max(float((r[name]["final"][k] - final[k]).abs().max()) for k in r[name]["final"])
            for r in ranks
        ]
        if name == "doubled":
            assert min(errors) > 100 * ATOL, errors
        else:
            assert max(errors) < ATOL, (name, errors)


@pytest.mark.timeout(240)
# TP1-CP2-DP2 with top-k: test_tree_packed_samples_train_as_the_per_turn_reference's
# drop-topk case trains these per-turn samples there too (and the packed ones)
@pytest.mark.parametrize("layout", [LAYOUTS["tp2-cp2"]], ids=["tp2-cp2"])
def test_megatron_topk_steps_equal_the_reference_and_the_local_trainers_loss(
    tmp_path: Path,
    trajectories: list[Any],
    factory_tokenizer: Any,
    topk_reference_run: dict[str, Any],
    layout: tuple[int, int, int, bool],
) -> None:
    """opd_loss topk_tail on slime: the teacher's rows through slime's data path (cut by CP,
    gathered per TP vocabulary shard) into Megatron's steps; the parameters equal the
    reference after 3 steps, and the first step's loss, as slime reports it, equals the
    local trainer's on the same trajectories to 1e-5."""
    tp, cp, dp, _ = layout
    args = recipe_args(
        RECIPE, tmp_path, tp, cp, len(factory_tokenizer), algorithm_settings=TOPK_SETTINGS
    )
    args.max_tokens_per_gpu = MAX_TOKENS_PER_GPU
    _, boxes, _ = rollout_side(args, [rollout_groups(RECIPE, args, tmp_path, trajectories)], dp)
    runs = {"plain": {"distributed": False, "loss_path": "slime_ext.slime.loss.loss"}}
    torch.save(
        {"args": args, "boxes": boxes, "initial": topk_reference_run["initial"], "runs": runs},
        tmp_path / "case.pt",
    )
    ranks = run_ranks(_rank, tp * cp * dp, layout, tmp_path)
    final = topk_reference_run["final"]
    for r in ranks:
        error = max(float((r["plain"]["final"][k] - final[k]).abs().max()) for k in final)
        assert error < ATOL, error
    local_loss = topk_reference_run["local_loss"]
    assert local_loss is not None and local_loss > 0.1
    for r in ranks:
        first = r["plain"]["reported"][0]
        assert KL_COEF * first["teacher_topk_kl"] == pytest.approx(local_loss, abs=TOPK_ATOL)


@pytest.fixture(scope="module")
def kept_and_drifted(factory_tokenizer: Any) -> list[Any]:
    """The scripted trajectories with think kept (a trajectory is one sequence), the half
    trajectory's second turn drifted: its context ends in 4 ids the trunk does not hold
    there, so per turn it is a sample of its own and packed a branch with that suffix."""
    from rollout.trajectory import Turn

    kept = scripted_with_topk(factory_tokenizer, think_policy="keep")
    half = kept[1]
    turn = half.turns[1]
    start = turn.context_len - 4
    suffix = [int(x) + 1 for x in half.trunk_ids[start : turn.context_len]]
    drifted = Turn.model_validate(
        turn.model_dump()
        | {"context_len": start, "context_suffix_ids": suffix, "drift": True}
        | {"drift_reason": "a re-rendered context (test)"}
    )
    kept[1] = half.model_copy(update={"turns": [half.turns[0], drifted, *half.turns[2:]]})
    return kept


@pytest.fixture(scope="module")
def kept_reference_run(
    tmp_path_factory: pytest.TempPathFactory, kept_and_drifted: list[Any], factory_tokenizer: Any
) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("kept_reference")
    return _reference_run(path, kept_and_drifted, len(factory_tokenizer), "sampled")


PACKED_CASES = {
    "drop-tp2-cp2": ("drop", LAYOUTS["tp2-cp2"], "sampled"),
    "keep-drift-tp2-dp2": ("keep", LAYOUTS["tp2-dp2"], "sampled"),
    "drop-topk-tp1-cp2-dp2": ("drop", LAYOUTS["tp1-cp2-dp2"], TOPK_SETTINGS["opd_loss"]),
}
"""(think policy, layout, loss) of the packed runs."""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("think, layout, loss", PACKED_CASES.values(), ids=PACKED_CASES.keys())
def test_tree_packed_samples_train_as_the_per_turn_reference(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    factory_tokenizer: Any,
    think: str,
    layout: tuple[int, int, int, bool],
    loss: str,
) -> None:
    """One tree-packed sample per trajectory (every token once: think dropped, the spans
    are branches; think kept with a drifted turn, that turn's branch) through slime's data
    path into Megatron's steps with the tree attention, the sampled KL or the teacher's
    top-k (its rows at the packed places): the parameters after 3 steps equal the
    reference's, which trains on the per-turn samples, and every step's loss and metrics,
    as slime reports them, equal a per-turn run's. Negative control: the same samples with
    their trees lost on the way (plain causal attention) do not train to the reference."""
    from slime_ext.slime.samples import TREE_KEY

    topk = loss != "sampled"
    fixtures = {
        "drop": ("trajectories", "topk_reference_run" if topk else "reference_run"),
        "keep": ("kept_and_drifted", "kept_reference_run"),
    }[think]
    trajectories = request.getfixturevalue(fixtures[0])
    reference_run = request.getfixturevalue(fixtures[1])
    tp, cp, dp, _ = layout
    settings = TOPK_SETTINGS if topk else None
    args = recipe_args(
        RECIPE, tmp_path, tp, cp, len(factory_tokenizer), algorithm_settings=settings
    )
    args.max_tokens_per_gpu = MAX_TOKENS_PER_GPU
    groups = rollout_groups(RECIPE, args, tmp_path, trajectories, layout="packed")
    samples, boxes, _ = rollout_side(args, [groups], dp)
    per_turn_groups = rollout_groups(RECIPE, args, tmp_path, trajectories)
    _, per_turn_boxes, _ = rollout_side(args, [per_turn_groups], dp)
    assert len(samples) == len(ROLLOUTS)  # one sample per trajectory
    assert all(TREE_KEY in s.train_metadata for s in samples)
    branches = [sorted({int(b) for b in s.train_metadata[TREE_KEY][1] if b >= 0}) for s in samples]
    # think dropped: the turns with think (not the half trajectory's first); kept: the last
    # turn (its span is not in the trunk), and the drifted turn of the half trajectory
    expected = {"drop": {0: [0, 1, 2], 2: [0, 1], 1: [1, 2]}, "keep": {0: [2], 2: [1], 1: [1, 2]}}
    for (which, _), tree in zip(ROLLOUTS, branches, strict=True):
        assert tree == ([] if which == "aborted" else expected[think][int(which)]), (which, tree)
    per_turn = sum(len(s.tokens) for s in reference_run["samples"] if not s.remove_sample)
    packed = sum(len(s.tokens) for s in samples if not s.remove_sample)
    assert packed < per_turn
    path = "slime_ext.slime.loss.loss"
    runs = {
        "packed": {"distributed": False, "loss_path": path, "tree": True},
        # the same model on the per-turn samples (no trees: causal), for the reported loss
        "per_turn": {"distributed": False, "loss_path": path, "tree": True,
                     "boxes_key": "per_turn_boxes"},
    }  # fmt: skip
    if not topk:
        runs["trees_lost"] = {"distributed": False, "loss_path": path, "tree": True,
                              "lose_trees": True}  # fmt: skip
    case = {"args": args, "boxes": boxes, "per_turn_boxes": per_turn_boxes, "runs": runs}
    torch.save(case | {"initial": reference_run["initial"]}, tmp_path / "case.pt")
    ranks = run_ranks(_rank, tp * cp * dp, layout, tmp_path)
    final = reference_run["final"]

    def error(run: dict[str, Any]) -> float:
        return max(float((run["final"][k] - final[k]).abs().max()) for k in final)

    metric = "teacher_topk_kl" if topk else "opd_reverse_kl"
    for r in ranks:
        assert error(r["packed"]) < ATOL and error(r["per_turn"]) < ATOL
        if not topk:
            assert error(r["trees_lost"]) > 100 * ATOL
        for packed_step, turn_step in zip(
            r["packed"]["reported"], r["per_turn"]["reported"], strict=True
        ):
            assert packed_step.keys() == turn_step.keys() and metric in turn_step
            for key, value in turn_step.items():
                assert packed_step[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
        if topk:  # and the local trainer's loss on the same trajectories
            first = r["packed"]["reported"][0]
            local = reference_run["local_loss"]
            assert KL_COEF * first[metric] == pytest.approx(local, abs=TOPK_ATOL)
