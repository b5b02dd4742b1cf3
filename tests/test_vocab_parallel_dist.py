"""Multi-process checks on gloo: vocabulary-sharded losses equal the unsharded ones.

TP=2 (two processes hold half the vocabulary each, with padding rows; masked rows holding
NaN or inf change nothing; a teacher's -inf top-k log-prob on a loss row stays finite) and
CP=2 x TP=2 (four processes; tokens split the way context parallelism splits them) for the
per-trajectory reduction. Megatron-core's vocab-parallel cross entropy is the independent
oracle for the sharded log-prob path.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from slime_ext.losses import (
    generalized_jsd,
    reverse_kl_pg_loss,
    teacher_topk_kl,
    topk_shared_support_kl,
    trajectory_token_weights,
    weighted_sum,
)
from slime_ext.vocab_parallel import VocabShard, token_logprobs
from tests.slime_driver import spawn_ranks

TOKENS, PADDED_VOCAB, REAL_VOCAB = 12, 16, 13
ATOL = 1e-5


def _spawn(worker: Callable[..., None], world_size: int) -> None:
    spawn_ranks(worker, world_size)


def _init(rank: int, world_size: int, init_method: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )


def _batch() -> dict[str, Tensor]:
    """The same batch on every rank: padded logits, teacher data, masks, trajectories."""
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(TOKENS, PADDED_VOCAB, generator=generator) * 3
    teacher = torch.randn(TOKENS, PADDED_VOCAB, generator=generator) * 3
    student[:, REAL_VOCAB:] = 50.0  # padding rows: huge logits that must be ignored
    teacher[:, REAL_VOCAB:] = 50.0
    teacher_topk = torch.log_softmax(teacher[:, :REAL_VOCAB], dim=-1).topk(4, dim=-1)
    teacher_topk.values[0, -1] = -math.inf  # a teacher's probability 0, on a loss row
    return {
        "student": student,
        "teacher": teacher,
        "ids": torch.randint(0, REAL_VOCAB, (TOKENS,), generator=generator),
        "teacher_lp": torch.randn(TOKENS, generator=generator) - 2,
        "topk_ids": teacher_topk.indices,
        "topk_lp": teacher_topk.values,
        "mask": torch.tensor([True] * 5 + [False] * 2 + [True] * 5),
        "trajectory": torch.tensor([0] * 4 + [1] * 5 + [2] * 3),
        "weights": torch.rand(TOKENS, generator=generator),
    }


LOSSES: dict[str, Callable[[Tensor, dict[str, Tensor], VocabShard, int | None], Tensor]] = {
    "token_logprobs": lambda s, b, sh, c: token_logprobs(s, b["ids"], sh, 0.7, c, mask=b["mask"]),
    "reverse_kl_pg": lambda s, b, sh, c: (
        reverse_kl_pg_loss(
            token_logprobs(s, b["ids"], sh, 0.7, c, mask=b["mask"]), b["teacher_lp"], b["mask"]
        ).per_token
    ),
    "teacher_topk_tail": lambda s, b, sh, c: (
        teacher_topk_kl(s, b["topk_ids"], b["topk_lp"], b["mask"], shard=sh, chunk_size=c).per_token
    ),
    "topk_shared": lambda s, b, sh, c: (
        topk_shared_support_kl(
            s, b["teacher"], b["mask"], k=5, temperature=1.3, shard=sh, chunk_size=c
        ).per_token
    ),
    "jsd_vocab_clip": lambda s, b, sh, c: (
        generalized_jsd(
            s, b["teacher"], b["mask"], 0.5, clip=0.05, shard=sh, chunk_size=c
        ).per_token
    ),
    "jsd_top_k": lambda s, b, sh, c: (
        generalized_jsd(s, b["teacher"], b["mask"], 0.0, top_k=4, shard=sh, chunk_size=c).per_token
    ),
}


POISONED = ("student", "teacher", "teacher_lp", "topk_lp")
"""The float inputs a hostile masked row may hold NaN or inf in."""


def _poisoned(batch: dict[str, Tensor], poison: float) -> dict[str, Tensor]:
    """The batch with every masked row of every float input holding `poison` (the
    padding columns too)."""
    dirty = {**batch}
    for key in POISONED:
        dirty[key] = batch[key].clone()
        dirty[key][~batch["mask"]] = poison
    return dirty


def _tp2_worker(rank: int, world_size: int, init_method: str) -> None:
    _init(rank, world_size, init_method)
    batch = _batch()
    width = PADDED_VOCAB // world_size
    shard = VocabShard.for_rank(dist.group.WORLD, PADDED_VOCAB, REAL_VOCAB)
    assert shard.start == rank * width
    rows = slice(shard.start, shard.start + width)
    for name, loss_fn in LOSSES.items():
        reference_logits = batch["student"][:, :REAL_VOCAB].clone().requires_grad_()
        unpadded = {**batch, "teacher": batch["teacher"][:, :REAL_VOCAB]}
        reference = loss_fn(reference_logits, unpadded, VocabShard(), None)
        (reference * batch["weights"]).sum().backward()
        assert reference_logits.grad is not None
        assert reference.isfinite().all() and reference_logits.grad.isfinite().all(), name
        expected_grad = torch.cat(
            [reference_logits.grad, torch.zeros(TOKENS, PADDED_VOCAB - REAL_VOCAB)], dim=1
        )
        variants = {"clean": batch} | {
            f"masked rows {p}": _poisoned(batch, p) for p in (math.nan, math.inf, -math.inf)
        }
        for variant, given in variants.items():
            for chunk in (None, 5):
                local = given["student"][:, rows].clone().requires_grad_()
                sharded_batch = {**given, "teacher": given["teacher"][:, rows]}
                value = loss_fn(local, sharded_batch, shard, chunk)
                (value * batch["weights"]).sum().backward()
                where = (name, variant, chunk)
                assert torch.allclose(value, reference, atol=ATOL), (*where, value, reference)
                assert local.grad is not None
                assert torch.allclose(local.grad, expected_grad[:, rows], atol=ATOL), where
    dist.destroy_process_group()


def _megatron_worker(rank: int, world_size: int, init_method: str) -> None:
    _init(rank, world_size, init_method)
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)
    batch = _batch()
    group = parallel_state.get_tensor_model_parallel_group()
    shard = VocabShard.for_rank(group, PADDED_VOCAB)
    rows = slice(shard.start, shard.start + PADDED_VOCAB // world_size)
    ours_logits = batch["student"][:, rows].clone().requires_grad_()
    theirs_logits = batch["student"][:, rows].clone().requires_grad_()
    ours = -token_logprobs(ours_logits, batch["ids"], shard)
    # megatron's layout is [sequence, batch, vocab / TP]
    theirs = tensor_parallel.vocab_parallel_cross_entropy(
        theirs_logits[:, None, :], batch["ids"][:, None]
    )[:, 0]
    assert torch.allclose(ours, theirs.float(), atol=ATOL), (ours, theirs)
    (ours * batch["weights"]).sum().backward()
    (theirs * batch["weights"]).sum().backward()
    assert ours_logits.grad is not None and theirs_logits.grad is not None
    assert torch.allclose(ours_logits.grad, theirs_logits.grad, atol=ATOL)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _cp_chunks(num_tokens: int, cp_size: int, cp_rank: int) -> Tensor:
    """Token positions CP rank r holds: chunks r and 2*CP - 1 - r of 2*CP equal chunks."""
    chunks = torch.arange(num_tokens).chunk(2 * cp_size)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def _per_trajectory_objective(
    logits: Tensor, batch: dict[str, Tensor], shard: VocabShard, positions: Tensor
) -> Tensor:
    """An OPD step's loss: PG reverse KL + teacher top-k KL, per-trajectory normalized."""
    weights = trajectory_token_weights(batch["mask"], batch["trajectory"], num_trajectories=4)
    mask = batch["mask"][positions]
    student_lp = token_logprobs(logits, batch["ids"][positions], shard)
    pg = reverse_kl_pg_loss(student_lp, batch["teacher_lp"][positions], mask).per_token
    topk = teacher_topk_kl(
        logits,
        batch["topk_ids"][positions],
        batch["topk_lp"][positions],
        mask,
        shard=shard,
        chunk_size=2,
    ).per_token
    return weighted_sum(pg + 0.5 * topk, weights[positions])


def _cp2_tp2_worker(rank: int, world_size: int, init_method: str) -> None:
    _init(rank, world_size, init_method)
    tp_size, cp_size = 2, 2
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_rank, tp_rank = divmod(rank, tp_size)
    batch = _batch()
    shard = VocabShard.for_rank(tp_groups[cp_rank], PADDED_VOCAB, REAL_VOCAB)
    assert dist.get_rank(tp_groups[cp_rank]) == tp_rank
    rows = slice(shard.start, shard.start + PADDED_VOCAB // tp_size)
    positions = _cp_chunks(TOKENS, cp_size, cp_rank)

    reference_logits = batch["student"][:, :REAL_VOCAB].clone().requires_grad_()
    reference = _per_trajectory_objective(
        reference_logits, batch, VocabShard(), torch.arange(TOKENS)
    )
    reference.backward()
    assert reference_logits.grad is not None
    expected_grad = torch.cat(
        [reference_logits.grad, torch.zeros(TOKENS, PADDED_VOCAB - REAL_VOCAB)], dim=1
    )

    local = batch["student"][positions][:, rows].clone().requires_grad_()
    partial = _per_trajectory_objective(local, batch, shard, positions)
    partial.backward()
    total = partial.detach().clone()
    dist.all_reduce(total, group=cp_groups[tp_rank])  # the CP ranks' shares sum to the loss
    assert torch.allclose(total, reference.detach(), atol=ATOL), (total, reference)
    assert local.grad is not None
    assert torch.allclose(local.grad, expected_grad[positions][:, rows], atol=ATOL)
    dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_tp2_sharded_losses_and_gradients_equal_unsharded() -> None:
    _spawn(_tp2_worker, 2)


@pytest.mark.timeout(180)
def test_tp2_logprobs_match_megatron_vocab_parallel_cross_entropy() -> None:
    pytest.importorskip("megatron.core")
    _spawn(_megatron_worker, 2)


@pytest.mark.timeout(240)
def test_cp2_tp2_per_trajectory_reduction_equals_unsharded() -> None:
    _spawn(_cp2_tp2_worker, 4)
