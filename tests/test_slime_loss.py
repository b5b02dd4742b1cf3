"""The custom loss slime calls (slime_ext.slime.loss) under slime's calling conventions.

slime's call site, CP slicing and per-rollout reduction come from tests/slime_standin.py
(pinned to a slime commit). The reference values are computed here by plain torch on
whole sequences: per trajectory, the mean over its loss tokens of k_t = s(x_t) - t(x_t)
at the rollout temperature, averaged over trajectories (DESIGN.md invariant 7).
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from slime_ext.slime.cp import response_slices
from slime_ext.slime.loss import loss as opd_loss
from tests import slime_standin as slime
from tests.live_server import free_port

VOCAB = 16
TEMPERATURE = 0.7
ATOL = 1e-5
# (rollout_id, prompt tokens, response tokens) per sample; rollout 2's last sample has a
# 2-token span that lies wholly in the last of 4 CP chunks (rank 0's), so CP rank 1
# holds none of it.
LAYOUT = [(0, 5, 4), (0, 11, 3), (1, 7, 6), (1, 2, 1), (1, 15, 5), (2, 38, 2)]


def _job_yaml(directory: Path, recipe: str = "opd") -> Path:
    path = directory / "job.yaml"
    path.write_text(
        f"rollout:\n  temperature: {TEMPERATURE}\nalgorithm:\n  recipe: {recipe}\n"
        "teacher:\n  kind: remote\n  url: http://127.0.0.1:1\n"
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


def _reference(
    samples: list[slime.Sample], logits: list[Tensor]
) -> tuple[float, float, list[Tensor]]:
    """Loss value, opd_reverse_kl and d(loss)/d(logits), by plain torch."""
    leaves = [x.clone().requires_grad_(True) for x in logits]
    per_rollout: dict[int, list[tuple[Tensor, Tensor, Tensor]]] = {}
    for sample, x in zip(samples, leaves, strict=True):
        response = sample.response_length
        targets = torch.tensor(sample.tokens[-response:])
        rows = x[len(sample.tokens) - response - 1 : len(sample.tokens) - 1] / TEMPERATURE
        student = torch.log_softmax(rows, -1).gather(-1, targets[:, None])[:, 0]
        teacher = torch.tensor(sample.teacher_log_probs)
        mask = torch.tensor(sample.loss_mask, dtype=torch.float)
        assert sample.rollout_id is not None
        per_rollout.setdefault(sample.rollout_id, []).append((student, teacher, mask))
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
    batch = slime.batch_for_rank(data, range(len(samples)), 0, 1)
    packed = torch.cat(logits)[None].clone().requires_grad_(True)
    loss, log = slime.call_loss(
        args, batch, packed, opd_loss, 0, 1, num_microbatches=1,
        step_global_batch_size=3, dp_cp_size=1,
    )  # fmt: skip
    loss.backward()
    assert float(loss) == pytest.approx(expected_loss, abs=ATOL)
    assert float(log["opd_reverse_kl"]) / 3 == pytest.approx(expected_kl, abs=ATOL)
    assert packed.grad is not None
    assert torch.allclose(packed.grad[0], torch.cat(expected_grads), atol=ATOL)


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


def _cp2_tp2_worker(rank: int, world_size: int, port: int, config: str, out: str) -> None:
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
    samples, logits = _samples()
    args = slime.slime_args(rollout_temperature=TEMPERATURE, padded_vocab_size=VOCAB)
    data = slime.convert_samples_to_train_data(args, samples)
    columns = slice(tp_rank * VOCAB // 2, (tp_rank + 1) * VOCAB // 2)
    results: dict[str, Any] = {"cp_rank": cp_rank, "tp_rank": tp_rank, "micro": []}
    # two micro-batches: slime may split one rollout's samples across them
    for indices in ([0, 1, 2], [3, 4, 5], [5]):
        local = slime.pack_logits_for_rank([logits[i] for i in indices], cp_rank, 2, columns)
        local = local.clone().requires_grad_(True)
        batch = slime.batch_for_rank(data, indices, cp_rank, 2)
        loss, log = slime.call_loss(
            args, batch, local, opd_loss, cp_rank, 2, num_microbatches=1,
            step_global_batch_size=3, dp_cp_size=1,
        )  # fmt: skip
        loss.backward()
        results["micro"].append(
            {
                "indices": indices,
                "loss": float(loss),
                "kl": float(log["opd_reverse_kl"]),
                "grad": local.grad,
                "connected": loss.requires_grad,
            }
        )
    torch.save(results, f"{out}/rank{rank}.pt")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_cp2_tp2_loss_and_grads_equal_the_single_process_reference(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    config = str(_job_yaml(tmp_path))
    mp.start_processes(
        _cp2_tp2_worker,
        args=(4, free_port(), config, str(tmp_path)),
        nprocs=4,
        join=True,
        start_method="spawn",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    samples, logits = _samples()
    expected_loss, expected_kl, expected_grads = _reference(samples, logits)
    # the first two micro-batches hold the step; CP ranks' shares sum to the loss and
    # both TP ranks of a CP rank agree on it
    total = {r["tp_rank"]: 0.0 for r in ranks}
    kl = {r["tp_rank"]: 0.0 for r in ranks}
    for r in ranks:
        total[r["tp_rank"]] += r["micro"][0]["loss"] + r["micro"][1]["loss"]
        kl[r["tp_rank"]] += r["micro"][0]["kl"] + r["micro"][1]["kl"]
    for tp_rank in (0, 1):
        assert total[tp_rank] == pytest.approx(expected_loss, abs=ATOL)
        assert kl[tp_rank] / 3 == pytest.approx(expected_kl, abs=ATOL)
    # gradients: each rank's slice of d(loss)/d(logits) is the reference's slice
    for r in ranks:
        columns = slice(r["tp_rank"] * VOCAB // 2, (r["tp_rank"] + 1) * VOCAB // 2)
        for micro in r["micro"][:2]:
            want = slime.pack_logits_for_rank(
                [expected_grads[i] for i in micro["indices"]], r["cp_rank"], 2, columns
            )[0]
            assert torch.allclose(micro["grad"][0], want, atol=ATOL)
    # the last micro-batch is the short span alone: CP rank 1 holds none of it and still
    # returns a zero connected to its logits
    for r in ranks:
        alone = r["micro"][2]
        assert alone["connected"]
        if r["cp_rank"] == 1:
            assert alone["loss"] == 0.0
            assert torch.count_nonzero(alone["grad"]) == 0
        else:
            assert alone["loss"] != 0.0
