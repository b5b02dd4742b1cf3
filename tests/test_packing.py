"""Tree-packed training sequences (slime_ext.turns.packed_batch) against per-turn samples.

The reference log-probs come from a plain HF forward of each per-turn sample (context_k +
span_k), not from the packing code; losses and gradients are compared with the per-turn
layout's. Trajectories are random (hypothesis): both think policies, drifted turns whose
context keeps a suffix the trunk lost, tier-masked turns.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.trajectory import MaskTier, Task, Trajectory, TrajectoryStatus, Turn
from slime_ext.flex_tree import FlexBackwardUnavailable, flex_tree
from slime_ext.local.trainer import LocalTrainer, TrainerConfig
from slime_ext.models.factory import build_model
from slime_ext.turns import (
    PackingUnsupported,
    attention_rule,
    check_packable,
    pack_trajectory,
    packed_batch,
    per_turn_batch,
    trunk_then_branches,
)

ATOL = 1e-5
TEMPERATURE = 0.9


@st.composite
def trajectories(draw: Any, think_policy: str) -> Trajectory:
    ids = st.integers(5, 400)
    context = draw(st.lists(ids, min_size=2, max_size=8))
    turns: list[Turn] = []
    trunk = list(context)
    for k in range(draw(st.integers(1, 4))):
        span = draw(st.lists(ids, min_size=1, max_size=6))
        think_len = draw(st.integers(0, len(span) - 1))
        suffix: list[int] = []
        rewritten: list[int] = []
        context_len = len(trunk)
        if k > 0 and draw(st.booleans()):
            # drift: later contexts rewrote this turn's last context tokens (the trunk
            # holds the rewrite); the turn keeps what it saw as its suffix
            cut = draw(st.integers(1, 2))
            suffix = trunk[-cut:]
            rewritten = draw(st.lists(ids, min_size=1, max_size=3))
            context_len -= cut
        logprobs = [-draw(st.floats(0.01, 3.0)) for _ in span]
        teacher = [-draw(st.floats(0.01, 3.0)) for _ in span]
        tier = draw(st.sampled_from(list(MaskTier)))
        turns.append(
            Turn(
                context_len=context_len,
                context_suffix_ids=suffix,
                span_ids=span,
                think_len=think_len,
                logprobs=logprobs,
                teacher_logprobs=teacher,
                mask_tier=tier,
                drift=bool(suffix),
                drift_reason="rewritten" if suffix else None,
            )
        )
        observation = draw(st.lists(ids, min_size=1, max_size=4))
        carried = span if think_policy == "keep" else span[think_len:]
        trunk = trunk[:context_len] + (rewritten if suffix else []) + carried + observation
    return Trajectory(
        trajectory_id="t",
        task=Task(task_id="t", kind="synthetic", prompt="p"),
        think_policy=think_policy,  # type: ignore[arg-type]
        trunk_ids=trunk,
        turns=turns,
        status=TrajectoryStatus.COMPLETED,
        status_reason="done",
        reward=1.0,
    )


@pytest.fixture(scope="module")
def model(factory_tokenizer: Any) -> Any:
    return build_model("qwen3-tiny", factory_tokenizer, seed=3).eval()


def _plain_span_logprobs(model: Any, trajectory: Trajectory) -> torch.Tensor:
    values = []
    device = next(model.parameters()).device
    for k, turn in enumerate(trajectory.turns):
        context = trajectory.context_ids(k)
        sample = torch.tensor([context + turn.span_ids], device=device)
        logits = model(input_ids=sample).logits[0]
        rows = torch.log_softmax(logits[len(context) - 1 : -1].float() / TEMPERATURE, -1)
        values.append(rows.gather(-1, sample[0, len(context) :, None])[:, 0])
    return torch.cat(values)


def _trainer(model: Any, layout: str, kernel: str = "kv", kl_discount: float = 0.0) -> LocalTrainer:
    config = TrainerConfig(
        temperature=TEMPERATURE,
        sequence_layout=layout,  # type: ignore[arg-type]
        packed_kernel=kernel,  # type: ignore[arg-type]
        kl_discount=kl_discount,
    )
    return LocalTrainer(model, config)


@pytest.mark.parametrize("kernel", ["kv", "mask", "flex"])
@settings(max_examples=20)
@given(
    st.sampled_from(["drop", "keep"]).flatmap(
        lambda policy: st.lists(trajectories(policy), min_size=1, max_size=3)
    )
)
def test_packed_span_logprobs_equal_plain_per_turn_forwards(
    model: Any, kernel: str, batch: list[Trajectory]
) -> None:
    trainer = _trainer(model, "packed", kernel)
    with torch.no_grad():  # flex: torch's CPU FlexAttention runs forward only
        packed = trainer.span_logprobs(trainer.batch(batch, "kl"))
        expected = torch.cat([_plain_span_logprobs(model, t) for t in batch])
    assert packed.shape == expected.shape
    assert torch.allclose(packed, expected, atol=ATOL)


@pytest.mark.parametrize("kernel", ["kv", "mask"])
@settings(max_examples=12)
@given(
    st.sampled_from(["drop", "keep"]).flatmap(
        lambda policy: st.lists(trajectories(policy), min_size=1, max_size=3)
    ),
    st.sampled_from(["opd", "sft", "rl", "opd kl_discount 0.9"]),
)
def test_packed_losses_and_gradients_equal_per_turn(
    model: Any, kernel: str, batch: list[Trajectory], recipe: str
) -> None:
    """Every recipe, and OPD whose tokens are charged for their trajectory's later KL (the
    discount runs over the same tokens in the same order in both layouts)."""
    results = []
    recipe, _, discount = recipe.partition(" kl_discount ")
    for layout in ("packed", "per_turn"):
        copy_ = copy.deepcopy(model)
        trainer = _trainer(copy_, layout, kernel, float(discount or 0))
        loss, metrics = trainer.loss(batch, recipe)  # type: ignore[arg-type]
        loss.backward()
        grads = [p.grad.clone() for p in copy_.parameters() if p.grad is not None]
        results.append((float(loss), grads, metrics))
    (packed_loss, packed_grads, packed_metrics), (turn_loss, turn_grads, turn_metrics) = results
    assert packed_loss == pytest.approx(turn_loss, abs=ATOL)
    assert len(packed_grads) == len(turn_grads)
    for a, b in zip(packed_grads, turn_grads, strict=True):
        assert torch.allclose(a, b, atol=ATOL)
    assert packed_metrics["train/loss_tokens"] == turn_metrics["train/loss_tokens"]
    assert packed_metrics["train/processed_tokens"] <= turn_metrics["train/processed_tokens"]


@settings(max_examples=30)
@given(st.sampled_from(["drop", "keep"]).flatmap(trajectories))
def test_every_token_once(trajectory: Trajectory) -> None:
    packed = pack_trajectory(trajectory)
    needed = max(t.context_len for t in trajectory.turns)
    spans = sum(len(t.span_ids) + len(t.context_suffix_ids) for t in trajectory.turns)
    assert len(packed.ids) <= max(needed, len(trajectory.trunk_ids)) + spans
    if trajectory.think_policy == "keep" and not any(t.drift for t in trajectory.turns):
        held = all(not t.context_suffix_ids for t in trajectory.turns)
        if held:  # think kept, no drift: the trunk holds every span; no branch at all
            assert set(packed.branch) == {-1}
    rule = attention_rule(packed)
    assert rule.diagonal().all()  # every position sees itself
    assert not rule.triu(1).any()  # nothing sees the future


def test_hybrid_models_pack_through_the_kv_kernel(factory_tokenizer: Any) -> None:
    """Gated DeltaNet hybrids pack (tests/test_packing_hybrid.py); the mask cannot take them."""
    hybrid = build_model("qwen3_5-tiny", factory_tokenizer, seed=0)
    check_packable(hybrid)
    assert LocalTrainer(hybrid, TrainerConfig(sequence_layout="auto")).layout == "packed"
    with pytest.raises(PackingUnsupported, match="packed_kernel kv"):
        check_packable(hybrid, "mask")


def test_full_attention_models_pack_by_default(model: Any) -> None:
    assert LocalTrainer(model, TrainerConfig()).layout == "packed"


def test_packing_cuts_processed_tokens(model: Any) -> None:
    """A 6-turn trajectory: per turn recomputes each context, packed does not."""
    turns, trunk = [], list(range(10, 30))
    for k in range(6):
        span = list(range(100 + 10 * k, 106 + 10 * k))
        turns.append(Turn(context_len=len(trunk), span_ids=span, think_len=3))
        trunk = trunk + span[3:] + list(range(300 + 5 * k, 304 + 5 * k))
    trajectory = Trajectory(
        trajectory_id="t",
        task=Task(task_id="t", kind="synthetic", prompt="p"),
        trunk_ids=trunk,
        turns=turns,
        status=TrajectoryStatus.COMPLETED,
        status_reason="done",
    )
    packed = packed_batch([trajectory], "imitation")
    per_turn = per_turn_batch([trajectory], "imitation")
    lower_bound = turns[-1].context_len + sum(len(t.span_ids) for t in turns)
    assert packed.num_processed_tokens == lower_bound
    assert per_turn.num_processed_tokens > 2.5 * packed.num_processed_tokens


def _long_trajectory(turns: int = 9) -> Trajectory:
    steps, trunk = [], list(range(10, 25))
    for k in range(turns):
        span = [100 + 7 * k + i for i in range(5)]
        steps.append(Turn(context_len=len(trunk), span_ids=span, think_len=2))
        trunk = trunk + span[2:] + [300 + k, 301 + k]
    return Trajectory(
        trajectory_id="t",
        task=Task(task_id="t", kind="synthetic", prompt="p"),
        trunk_ids=trunk,
        turns=steps,
        status=TrajectoryStatus.COMPLETED,
        status_reason="done",
    )


def test_kl_discount_reaches_the_trainers_loss(model: Any) -> None:
    """The trainer charges each token for its trajectory's later KL: with teacher log-probs
    below the student's everywhere (k_t > 0), the discounted loss is larger, by the
    discounted sums' mean over the trajectory's tokens."""
    trajectory = _long_trajectory(3)
    for turn in trajectory.turns:
        turn.teacher_logprobs = [-20.0] * len(turn.span_ids)
    losses = {}
    for discount in (0.0, 0.5):
        trainer = _trainer(copy.deepcopy(model), "packed", kl_discount=discount)
        with torch.no_grad():
            k = trainer.span_logprobs(trainer.batch([trajectory], "kl")).double() + 20.0
            losses[discount] = float(trainer.loss([trajectory], "opd")[0])
    later = [sum(0.5**d * v for d, v in enumerate(k.tolist()[t:])) for t in range(len(k))]
    assert losses[0.0] == pytest.approx(float(k.mean()), rel=1e-4)
    assert losses[0.5] == pytest.approx(sum(later) / len(later), rel=1e-4)
    assert losses[0.5] > 1.5 * losses[0.0]


def test_branch_groups_of_any_size_give_the_same_hidden_states(model: Any) -> None:
    packed = pack_trajectory(_long_trajectory())
    with torch.no_grad():
        one = trunk_then_branches(model, packed, group=1)
        for size in (2, 4, 9):
            assert torch.allclose(trunk_then_branches(model, packed, group=size), one, atol=ATOL)


@settings(max_examples=20)
@given(st.sampled_from(["drop", "keep"]).flatmap(trajectories))
def test_the_tree_kernel_equals_plain_forwards_on_the_trunk_and_at_read_rows(
    model: Any, trajectory: Trajectory
) -> None:
    """The trunk's hidden states are a plain causal forward's; asking for the span rows
    only (the last layer then skips the trunk's unread queries) changes none of them."""
    packed = pack_trajectory(trajectory)
    with torch.no_grad():
        full = trunk_then_branches(model, packed)
        plain = model.base_model(input_ids=torch.tensor([packed.ids[: packed.trunk_len]]))
        read = trunk_then_branches(model, packed, rows=packed.span_rows)
    assert torch.allclose(full[: packed.trunk_len], plain.last_hidden_state[0], atol=ATOL)
    assert torch.allclose(read, full[torch.tensor(packed.span_rows)], atol=ATOL)


def test_plain_forwards_beside_a_packed_forward_are_unchanged(model: Any) -> None:
    """The kernel rides on its own attention mask: the model and its config stay as they
    are, so another thread (the teacher server scores packed trajectories beside its
    batcher) runs plain forwards meanwhile."""
    packed = pack_trajectory(_long_trajectory())
    ids = torch.tensor([packed.ids[: packed.trunk_len]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        results: list[torch.Tensor] = []

        def plain() -> None:
            for _ in range(20):
                results.append(model(input_ids=ids).logits)

        worker = threading.Thread(target=plain)
        worker.start()
        for _ in range(20):
            trunk_then_branches(model, packed)
        worker.join()
    assert model.config._attn_implementation == "sdpa"
    assert len(results) == 20
    assert all(torch.equal(result, expected) for result in results)


def test_the_tree_kernel_refuses_attention_other_than_sdpa(factory_tokenizer: Any) -> None:
    eager = build_model("qwen3-tiny", factory_tokenizer, seed=0)
    eager.config._attn_implementation = "eager"
    with pytest.raises(PackingUnsupported, match="sdpa"):
        trunk_then_branches(eager, pack_trajectory(_long_trajectory()))


def test_flex_training_on_the_cpu_is_refused_naming_the_kernels_that_train(model: Any) -> None:
    trainer = _trainer(copy.deepcopy(model), "packed", "flex")
    with pytest.raises(FlexBackwardUnavailable, match="packed_kernel: kv"):
        trainer.loss([_long_trajectory()], "sft")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention backward needs CUDA")
@settings(max_examples=8, deadline=None)
@given(st.sampled_from(["drop", "keep"]).flatmap(trajectories))
def test_flex_span_logprobs_and_gradients_equal_plain_per_turn_forwards_on_cuda(
    model: Any, trajectory: Trajectory
) -> None:
    results = []
    for packed in (True, False):
        on_cuda = copy.deepcopy(model).cuda()
        if packed:
            pack = pack_trajectory(trajectory)
            rows = flex_tree(on_cuda, pack, rows=pack.span_rows)
            logits = on_cuda.get_output_embeddings()(rows).float() / TEMPERATURE
            targets = [token for turn in trajectory.turns for token in turn.span_ids]
            ids = torch.tensor(targets, device="cuda")[:, None]
            logprobs = torch.log_softmax(logits, -1).gather(-1, ids)[:, 0]
        else:
            logprobs = _plain_span_logprobs(on_cuda, trajectory)
        weights = torch.linspace(0.5, 1.5, len(logprobs), device="cuda")
        (logprobs * weights).sum().backward()
        grads = [p.grad for p in on_cuda.parameters() if p.grad is not None]
        results.append((logprobs.detach(), grads))
    (flex_logprobs, flex_grads), (plain_logprobs, plain_grads) = results
    assert torch.allclose(flex_logprobs, plain_logprobs, atol=ATOL)
    assert len(flex_grads) == len(plain_grads)
    for a, b in zip(flex_grads, plain_grads, strict=True):
        assert torch.allclose(a, b, atol=ATOL)
