"""The custom loss slime calls (slime_ext.slime.loss) under slime's calling conventions.

slime's call site, CP slicing and per-rollout reduction come from tests/slime_standin.py
(pinned to a slime commit). The reference values are computed here by plain torch on
whole sequences: per trajectory, the mean over its loss tokens of k_t = s(x_t) - t(x_t)
at the rollout temperature, averaged over trajectories (DESIGN.md invariant 7).
"""

from __future__ import annotations

import itertools
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from slime_ext.slime import oprd
from slime_ext.slime.cp import response_slices
from slime_ext.slime.loss import SlimeBatchError
from slime_ext.slime.loss import loss as opd_loss
from slime_ext.slime.settings import HookConfigError
from tests import slime_standin as slime
from tests.live_server import free_port

VOCAB = 16
TEMPERATURE = 0.7
ATOL = 1e-5
# (rollout_id, prompt tokens, response tokens) per sample; rollout 2's last sample has a
# 2-token span that lies wholly in the last of 4 CP chunks (rank 0's), so CP rank 1
# holds none of it.
LAYOUT = [(0, 5, 4), (0, 11, 3), (1, 7, 6), (1, 2, 1), (1, 15, 5), (2, 38, 2)]
# OPRD: rollout 0 succeeds (its second turn invalid: imitation masks it whole), 1 and 2 fail
OPRD_REWARDS = {0: 1.0, 1: 0.0, 2: 0.0}
LAMBDA_POS, LAMBDA_NEG = 0.5, 2.0
OPRD_ALGORITHM = (
    "recipe: oprd\n  oprd_failure_loss: sampled\n"
    f"  oprd_success_weight: {LAMBDA_POS}\n  oprd_failure_weight: {LAMBDA_NEG}"
)


def _job_yaml(directory: Path, recipe: str = "opd") -> Path:
    path = directory / "job.yaml"
    if recipe == "oprd":
        teacher, algorithm = "kind: self", OPRD_ALGORITHM
    else:
        teacher, algorithm = "kind: remote", f"recipe: {recipe}"
    path.write_text(
        f"rollout:\n  temperature: {TEMPERATURE}\nalgorithm:\n  {algorithm}\n"
        f"teacher:\n  {teacher}\n  url: http://127.0.0.1:1\n"
    )
    return path


def _samples() -> tuple[list[slime.Sample], list[Tensor]]:
    generator = torch.Generator().manual_seed(0)
    samples, logits = [], []
    for index, (rollout_id, prompt, response) in enumerate(LAYOUT):
        tokens = torch.randint(0, VOCAB, (prompt + response,), generator=generator).tolist()
        mask = [1] * response
        if index == 2:
            mask[1] = 0  # a masked token inside a span
        samples.append(
            slime.Sample(
                index=index,
                rollout_id=rollout_id,
                tokens=tokens,
                response_length=response,
                loss_mask=mask,
                reward=0.0,
                rollout_log_probs=(-torch.rand(response, generator=generator)).tolist(),
                teacher_log_probs=(-3 * torch.rand(response, generator=generator)).tolist(),
            )
        )
        logits.append(torch.randn(prompt + response, VOCAB, generator=generator) * 2)
    return samples, logits


def _per_rollout(
    samples: list[slime.Sample], leaves: list[Tensor]
) -> dict[int, list[tuple[Tensor, Tensor, Tensor]]]:
    """Per rollout, each sample's student log-probs of its response tokens (from its logits
    at TEMPERATURE), teacher log-probs and loss mask; removable placeholders are in none."""
    per_rollout: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {}
    for sample, x in zip(samples, leaves, strict=True):
        if sample.remove_sample:
            continue
        response = sample.response_length
        targets = torch.tensor(sample.tokens[-response:])
        rows = x[len(sample.tokens) - response - 1 : len(sample.tokens) - 1] / TEMPERATURE
        student = torch.log_softmax(rows, -1).gather(-1, targets[:, None])[:, 0]
        teacher = torch.tensor(sample.teacher_log_probs)
        mask = torch.tensor(sample.loss_mask, dtype=torch.float)
        assert sample.rollout_id is not None
        per_rollout.setdefault(sample.rollout_id, []).append((student, teacher, mask))
    return per_rollout


def _reference(
    samples: list[slime.Sample], logits: list[Tensor]
) -> tuple[float, float, list[Tensor]]:
    """Loss value, opd_reverse_kl and d(loss)/d(logits), by plain torch."""
    leaves = [x.clone().requires_grad_(True) for x in logits]
    per_rollout = _per_rollout(samples, leaves)
    value = kl = surrogate = torch.zeros(())
    for parts in per_rollout.values():
        denom = sum(float(m.sum()) for _, _, m in parts)
        k = torch.stack([((s - t) * m).sum() for s, t, m in parts]).sum()
        value = value + k.detach() / denom
        kl = kl + k.detach() / denom
        # the policy-gradient surrogate: its gradient is the loss's, stopgrad(k_t) * s
        surrogate = surrogate + sum(((s - t).detach() * s * m).sum() for s, t, m in parts) / denom
    count = len(per_rollout)
    (surrogate / count).backward()
    return float(value / count), float(kl / count), [x.grad for x in leaves]  # type: ignore[misc]


def _oprd_samples() -> tuple[list[slime.Sample], list[Tensor]]:
    """_samples() with OPRD_REWARDS, the success's invalid turn masked, and an aborted
    trajectory's removable placeholder as rollout 3 (G = 4 rollouts, 1 success, 2 failures)."""
    samples, logits = _samples()
    for sample in samples:
        assert sample.rollout_id is not None
        sample.reward = OPRD_REWARDS[sample.rollout_id]
    samples[1].loss_mask = [0] * samples[1].response_length
    generator = torch.Generator().manual_seed(1)
    samples.append(
        slime.Sample(
            index=len(samples),
            rollout_id=3,
            tokens=torch.randint(0, VOCAB, (6,), generator=generator).tolist(),
            response_length=1,
            loss_mask=[0],
            reward=0.0,
            remove_sample=True,
            rollout_log_probs=[0.0],
            teacher_log_probs=[0.0],
        )
    )
    logits.append(torch.randn(6, VOCAB, generator=generator))
    return samples, logits


def _oprd_reference(
    samples: list[slime.Sample], logits: list[Tensor]
) -> tuple[float, dict[str, float], list[Tensor]]:
    """Loss value, the branch metrics and d(loss)/d(logits) by plain torch: lambda_+ times
    the mean over successes of their token-mean NLL plus lambda_- times the mean over
    failures of their token-mean k_t (gradient: stopgrad(k_t) * s); the placeholder is in
    neither branch."""
    leaves = [x.clone().requires_grad_(True) for x in logits]
    per_rollout = _per_rollout(samples, leaves)
    nll, kl_pos, kl_neg, surrogate = [], [], [], []
    for rollout_id, parts in per_rollout.items():
        denom = sum(float(m.sum()) for _, _, m in parts)
        k = sum(float(((s - t) * m).sum()) for s, t, m in parts) / denom
        if OPRD_REWARDS[rollout_id] > 0:
            nll.append(sum((-s * m).sum() for s, _, m in parts) / denom)
            kl_pos.append(k)
        else:
            kl_neg.append(k)
            surrogate.append(sum(((s - t).detach() * s * m).sum() for s, t, m in parts) / denom)
    success = sum(nll) / len(nll)
    (LAMBDA_POS * success + LAMBDA_NEG * sum(surrogate) / len(surrogate)).backward()
    failure = sum(kl_neg) / len(kl_neg)
    metrics = {
        "success_branch_loss": float(success),
        "failure_branch_loss": failure,
        "opd_reverse_kl_success": sum(kl_pos) / len(kl_pos),
        "opd_reverse_kl_failure": failure,
    }
    value = LAMBDA_POS * float(success) + LAMBDA_NEG * failure
    grads = [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]
    return value, metrics, grads


def _oprd_data(args: Any, samples: list[slime.Sample], cp_rank: int, cp_size: int) -> Any:
    """slime's train data with our reward post-process, then this rank's advantages."""
    data = slime.convert_samples_to_train_data(args, samples, oprd.post_process_rewards)
    slime.custom_advantages(args, data, cp_rank, cp_size, oprd.advantages)
    return data


def _single_process_loss(
    args: Any, data: dict[str, Any], logits: list[Tensor], step_global_batch_size: int
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """slime's loss call on one process with all of `data` as the step's one micro-batch,
    backward done: the loss, its log and d(loss)/d(logits) (the logits packed)."""
    batch = slime.batch_for_rank(data, range(len(logits)), 0, 1)
    packed = torch.cat(logits)[None].clone().requires_grad_(True)
    loss, log = slime.call_loss(
        args, batch, packed, opd_loss, 0, 1, num_microbatches=1,
        step_global_batch_size=step_global_batch_size, dp_cp_size=1,
    )  # fmt: skip
    loss.backward()
    assert packed.grad is not None
    return loss, log, packed.grad[0]


def test_cp_response_slices_match_slimes_offsets() -> None:
    for cp_size in (1, 2, 3):
        for total in range(2, 30):
            for response in range(1, total):
                for cp_rank in range(cp_size):
                    [ours] = response_slices([total], [response], cp_rank, cp_size)
                    values = [float(i) for i in range(response)]
                    if cp_size == 1:
                        expected = values
                    else:
                        expected = slime.slice_log_prob_with_cp(
                            values, total, response, cp_rank, cp_size
                        )
                    assert [float(i) for i in ours.response_index] == expected


def test_single_process_loss_is_the_per_trajectory_mean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path)))
    samples, logits = _samples()
    expected_loss, expected_kl, expected_grads = _reference(samples, logits)
    args = slime.slime_args(rollout_temperature=TEMPERATURE)
    data = slime.convert_samples_to_train_data(args, samples)
    loss, log, grad = _single_process_loss(args, data, logits, step_global_batch_size=3)
    assert float(loss) == pytest.approx(expected_loss, abs=ATOL)
    assert float(log["opd_reverse_kl"]) / 3 == pytest.approx(expected_kl, abs=ATOL)
    assert torch.allclose(grad, torch.cat(expected_grads), atol=ATOL)


def test_oprd_branch_shares_divide_each_training_step_among_its_branches() -> None:
    """A step is --global-batch-size consecutive rollouts (first seen first); a success's
    share is G / successes, a failure's -G / failures, a removed placeholder's 0."""

    def sample(rollout_id: int, reward: float, removed: bool = False) -> slime.Sample:
        return slime.Sample(rollout_id=rollout_id, reward=reward, remove_sample=removed)

    # step 1: 5 (success, two samples), 7 (failure); step 2: 9 (failure), 11 (removed);
    # step 3 (beyond the steps slime trains; still routed): 13 (success)
    samples = [
        sample(5, 1.0), sample(7, 0.0), sample(5, 1.0), sample(9, -1.0),
        sample(11, 0.0, removed=True), sample(13, 0.5),
    ]  # fmt: skip
    raw, shares = oprd.post_process_rewards(slime.slime_args(global_batch_size=2), samples)
    assert raw == [s.reward for s in samples]
    assert shares == [2.0, -2.0, 2.0, -2.0, 0.0, 2.0]
    # with one step of all six: G = 6 over 2 successes and 2 failures
    assert oprd.branch_shares(samples, raw, global_batch_size=6) == [3.0, -3.0, 3.0, -3.0, 0, 3.0]


def test_oprd_advantage_function_puts_each_share_on_every_token_of_the_ranks_slice() -> None:
    samples, _ = _oprd_samples()
    args = slime.slime_args(global_batch_size=4)
    shares = {0: 4.0, 1: -2.0, 2: -2.0, 3: 0.0}  # G = 4: one success, two failures
    for cp_rank in (0, 1):
        data = _oprd_data(args, samples, cp_rank, 2)
        assert data["rewards"] == [shares[s.rollout_id] for s in samples]  # type: ignore[index]
        for sample, advantages in zip(samples, data["advantages"], strict=True):
            local = slime.slice_log_prob_with_cp(
                sample.rollout_log_probs or [], len(sample.tokens), sample.response_length,
                cp_rank, 2,
            )  # fmt: skip
            assert advantages.tolist() == [shares[sample.rollout_id]] * len(local)  # type: ignore[index]
    for flag in oprd.REFUSED_FLAGS:
        data = slime.convert_samples_to_train_data(args, samples, oprd.post_process_rewards)
        with pytest.raises(HookConfigError, match="branch shares"):
            slime.custom_advantages(slime.slime_args(**{flag: True}), data, 0, 1, oprd.advantages)


def test_oprd_loss_is_lambda_weighted_branch_means_of_nll_and_sampled_kl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Successes train on their NLL over loss-masked tokens, failures on the sampled reverse
    KL; each branch is the mean over its trajectories, the placeholder in neither; slime's
    division by G = 4 rollouts included."""
    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path, "oprd")))
    samples, logits = _oprd_samples()
    expected_loss, expected_metrics, expected_grads = _oprd_reference(samples, logits)
    args = slime.slime_args(rollout_temperature=TEMPERATURE, global_batch_size=4)
    data = _oprd_data(args, samples, 0, 1)
    loss, log, grad = _single_process_loss(args, data, logits, step_global_batch_size=4)
    assert float(loss) == pytest.approx(expected_loss, abs=ATOL)
    for key, value in expected_metrics.items():  # slime divides the logged sums by G
        assert float(log[key]) / 4 == pytest.approx(value, abs=ATOL), key
    assert torch.allclose(grad, torch.cat(expected_grads), atol=ATOL)
    # the success's masked turn and the placeholder get no gradient
    starts = [0, *itertools.accumulate(len(x) for x in logits)]
    for index in (1, len(samples) - 1):
        assert torch.count_nonzero(grad[starts[index] : starts[index + 1]]) == 0


def test_oprd_loss_without_branch_shares_names_the_missing_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path, "oprd")))
    samples, logits = _oprd_samples()
    args = slime.slime_args(rollout_temperature=TEMPERATURE, global_batch_size=4)
    data = slime.convert_samples_to_train_data(args, samples, oprd.post_process_rewards)
    batch = slime.batch_for_rank(data, range(len(samples)), 0, 1)
    with pytest.raises(SlimeBatchError, match="custom-advantage-function-path"):
        slime.call_loss(args, batch, torch.cat(logits)[None], opd_loss, 0, 1, 1, 4, 1)


def test_loss_refuses_a_temperature_the_job_does_not_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slime_ext.slime.settings import HookConfigError

    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path)))
    samples, logits = _samples()
    args = slime.slime_args(rollout_temperature=1.0)
    data = slime.convert_samples_to_train_data(args, samples)
    batch = slime.batch_for_rank(data, range(len(samples)), 0, 1)
    with pytest.raises(HookConfigError, match="rollout-temperature"):
        slime.call_loss(args, batch, torch.cat(logits)[None], opd_loss, 0, 1, 1, 3, 1)


def test_teacher_logprobs_of_the_wrong_length_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slime_ext.slime.loss import SlimeBatchError

    monkeypatch.setenv("OPD_JOB_CONFIG", str(_job_yaml(tmp_path)))
    samples, logits = _samples()
    args = slime.slime_args(rollout_temperature=TEMPERATURE)
    data = slime.convert_samples_to_train_data(args, samples)
    batch = slime.batch_for_rank(data, range(len(samples)), 0, 1)
    batch["teacher_log_probs"][1] = batch["teacher_log_probs"][1][:-1]
    with pytest.raises(SlimeBatchError, match="invariant 2"):
        slime.call_loss(args, batch, torch.cat(logits)[None], opd_loss, 0, 1, 1, 3, 1)


def _cp2_tp2_worker(
    rank: int, world_size: int, port: int, config: str, out: str, recipe: str
) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import os

    from megatron.core import parallel_state

    os.environ["OPD_JOB_CONFIG"] = config
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, context_parallel_size=2)
    cp_rank = parallel_state.get_context_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    rollouts = 4 if recipe == "oprd" else 3
    args = slime.slime_args(
        rollout_temperature=TEMPERATURE, padded_vocab_size=VOCAB, global_batch_size=rollouts
    )
    if recipe == "oprd":
        samples, logits = _oprd_samples()
        data = _oprd_data(args, samples, cp_rank, 2)
        step: list[list[int]] = [[0, 1, 2], [3, 4, 5, 6]]
    else:
        samples, logits = _samples()
        data = slime.convert_samples_to_train_data(args, samples)
        step = [[0, 1, 2], [3, 4, 5]]
    columns = slice(tp_rank * VOCAB // 2, (tp_rank + 1) * VOCAB // 2)
    results: dict[str, Any] = {"cp_rank": cp_rank, "tp_rank": tp_rank, "micro": []}
    # two micro-batches hold the step (slime may split one rollout's samples across them);
    # then the short span alone
    for indices in [*step, [5]]:
        local = slime.pack_logits_for_rank([logits[i] for i in indices], cp_rank, 2, columns)
        local = local.clone().requires_grad_(True)
        batch = slime.batch_for_rank(data, indices, cp_rank, 2)
        loss, log = slime.call_loss(
            args, batch, local, opd_loss, cp_rank, 2, num_microbatches=1,
            step_global_batch_size=rollouts, dp_cp_size=1,
        )  # fmt: skip
        loss.backward()
        results["micro"].append(
            {
                "indices": indices,
                "loss": float(loss),
                "log": {key: float(value) for key, value in log.items()},
                "grad": local.grad,
                "connected": loss.requires_grad,
            }
        )
    torch.save(results, f"{out}/rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _cp2_tp2(tmp_path: Path, recipe: str) -> list[dict[str, Any]]:
    """Each of 4 gloo ranks (TP 2 x CP 2) runs the step and the short span alone."""
    config = str(_job_yaml(tmp_path, recipe))
    mp.start_processes(
        _cp2_tp2_worker,
        args=(4, free_port(), config, str(tmp_path), recipe),
        nprocs=4,
        join=True,
        start_method="spawn",
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]


def _assert_ranks_match(
    ranks: list[dict[str, Any]],
    expected_loss: float,
    expected_metrics: dict[str, float],
    expected_grads: list[Tensor],
    rollouts: int,
) -> None:
    """The step's micro-batches: CP ranks' shares sum to the loss and to each metric (slime
    divides the metrics by the rollouts), both TP ranks of a CP rank agree, and each rank's
    slice of d(loss)/d(logits) is the reference's slice. The short span alone: CP rank 1
    holds none of it and still returns a zero connected to its logits."""
    for tp_rank in (0, 1):
        mine = [r for r in ranks if r["tp_rank"] == tp_rank]
        step = [micro for r in mine for micro in r["micro"][:2]]
        assert sum(m["loss"] for m in step) == pytest.approx(expected_loss, abs=ATOL)
        for key, value in expected_metrics.items():
            total = sum(m["log"][key] for m in step) / rollouts
            assert total == pytest.approx(value, abs=ATOL), key
    for r in ranks:
        columns = slice(r["tp_rank"] * VOCAB // 2, (r["tp_rank"] + 1) * VOCAB // 2)
        for micro in r["micro"][:2]:
            want = slime.pack_logits_for_rank(
                [expected_grads[i] for i in micro["indices"]], r["cp_rank"], 2, columns
            )[0]
            assert torch.allclose(micro["grad"][0], want, atol=ATOL)
        alone = r["micro"][2]
        assert alone["connected"]
        if r["cp_rank"] == 1:
            assert alone["loss"] == 0.0
            assert torch.count_nonzero(alone["grad"]) == 0
        else:
            assert alone["loss"] != 0.0


@pytest.mark.timeout(240)
def test_cp2_tp2_loss_and_grads_equal_the_single_process_reference(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    ranks = _cp2_tp2(tmp_path, "opd")
    samples, logits = _samples()
    expected_loss, expected_kl, expected_grads = _reference(samples, logits)
    _assert_ranks_match(ranks, expected_loss, {"opd_reverse_kl": expected_kl}, expected_grads, 3)


@pytest.mark.timeout(240)
def test_cp2_tp2_oprd_loss_and_grads_equal_the_single_process_reference(tmp_path: Path) -> None:
    """OPRD under TP 2 x CP 2 with real gloo groups: the branch shares are spread over each
    rank's CP slice by the advantage function, the loss routes them as on one process."""
    pytest.importorskip("megatron.core")
    ranks = _cp2_tp2(tmp_path, "oprd")
    samples, logits = _oprd_samples()
    expected_loss, expected_metrics, expected_grads = _oprd_reference(samples, logits)
    _assert_ranks_match(ranks, expected_loss, expected_metrics, expected_grads, 4)
