"""Tree-packed training sequences through hybrid students (slime_ext.hybrid_tree): Gated
DeltaNet linear-attention layers beside full attention (Qwen3.5, Qwen3-Next), each branch
run from the trunk's recurrent state and convolution window at its fork.

As in tests/test_packing.py, the reference log-probs come from a plain HF forward of each
per-turn sample (context_k + span_k) and the losses and gradients from the per-turn
layout; trajectories are random (both think policies, drifted turns, masked tiers), plus
forks inside one convolution window and a 42-turn trajectory. The negative control runs
every branch from zero states, and misses.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from rollout.trajectory import Task, Trajectory, TrajectoryStatus, Turn
from slime_ext import hybrid_tree
from slime_ext.local.trainer import LocalTrainer, TrainerConfig
from slime_ext.models.factory import build_model
from slime_ext.turns import (
    PackingUnsupported,
    check_packable,
    pack_trajectory,
    trunk_then_branches,
)
from tests.test_packing import (
    ATOL,
    TEMPERATURE,
    _long_trajectory,
    _plain_span_logprobs,
    trajectories,
)


@pytest.fixture(scope="module")
def qwen3_5(factory_tokenizer: Any) -> Any:
    return build_model("qwen3_5-tiny", factory_tokenizer, seed=3).eval()


@pytest.fixture(scope="module")
def qwen3_next(factory_tokenizer: Any) -> Any:
    """Qwen3-Next's layout: grouped value heads (4 per 2 key heads), a sparse-MoE MLP."""
    config = Qwen3NextConfig(
        vocab_size=len(factory_tokenizer),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        pad_token_id=factory_tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return Qwen3NextForCausalLM(config).eval()


def _trainer(model: Any, layout: str) -> LocalTrainer:
    config = TrainerConfig(temperature=TEMPERATURE, sequence_layout=layout)  # type: ignore[arg-type]
    return LocalTrainer(model, config)


def _packed_logprobs(model: Any, batch: list[Trajectory]) -> torch.Tensor:
    trainer = _trainer(model, "packed")
    return trainer.span_logprobs(trainer.batch(batch, "kl"))


def _losses_and_grads(
    model: Any, batch: list[Trajectory], recipe: str
) -> list[tuple[float, list[torch.Tensor]]]:
    results = []
    for layout in ("packed", "per_turn"):
        copy_ = copy.deepcopy(model)
        loss, _ = _trainer(copy_, layout).loss(batch, recipe)  # type: ignore[arg-type]
        loss.backward()
        results.append((float(loss), [p.grad for p in copy_.parameters() if p.grad is not None]))
    return results


def _assert_same(results: list[tuple[float, list[torch.Tensor]]]) -> None:
    (packed_loss, packed_grads), (turn_loss, turn_grads) = results
    assert packed_loss == pytest.approx(turn_loss, abs=ATOL)
    assert len(packed_grads) == len(turn_grads)
    for a, b in zip(packed_grads, turn_grads, strict=True):
        assert torch.allclose(a, b, atol=ATOL)


@settings(max_examples=15)
@given(
    st.sampled_from(["drop", "keep"]).flatmap(
        lambda policy: st.lists(trajectories(policy), min_size=1, max_size=3)
    )
)
def test_packed_span_logprobs_equal_plain_per_turn_forwards(
    qwen3_5: Any, batch: list[Trajectory]
) -> None:
    with torch.no_grad():
        packed = _packed_logprobs(qwen3_5, batch)
        expected = torch.cat([_plain_span_logprobs(qwen3_5, t) for t in batch])
    assert torch.allclose(packed, expected, atol=ATOL)


@settings(max_examples=8)
@given(
    st.sampled_from(["drop", "keep"]).flatmap(
        lambda policy: st.lists(trajectories(policy), min_size=1, max_size=2)
    ),
    st.sampled_from(["opd", "sft", "rl"]),
)
def test_packed_losses_and_gradients_equal_per_turn(
    qwen3_5: Any, batch: list[Trajectory], recipe: str
) -> None:
    _assert_same(_losses_and_grads(qwen3_5, batch, recipe))


def _scored(trajectory: Trajectory) -> Trajectory:
    """Sampler and teacher log-probs on every turn (OPD's loss reads both)."""
    turns = [
        turn.model_copy(
            update={
                "logprobs": [-0.3 - 0.1 * ((k + i) % 7) for i in range(len(turn.span_ids))],
                "teacher_logprobs": [-0.2 - 0.3 * ((k * i) % 5) for i in range(len(turn.span_ids))],
            }
        )
        for k, turn in enumerate(trajectory.turns)
    ]
    return trajectory.model_copy(update={"turns": turns})


def _trajectory(trunk: list[int], turns: list[Turn]) -> Trajectory:
    return Trajectory(
        trajectory_id="t",
        task=Task(task_id="t", kind="synthetic", prompt="p"),
        trunk_ids=trunk,
        turns=turns,
        status=TrajectoryStatus.COMPLETED,
        status_reason="done",
    )


def _forks_in_one_convolution_window() -> Trajectory:
    """Branches leave the trunk after 1, 2 and 3 tokens (the window is 3 inputs back), and
    a drifted turn after 5 whose branch starts with the suffix it saw."""
    trunk = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    turns = [
        Turn(context_len=1, span_ids=[101, 102], think_len=1),
        Turn(context_len=2, span_ids=[103], think_len=1),
        Turn(context_len=3, span_ids=[104, 105, 106], think_len=1),
        Turn(
            context_len=5,
            context_suffix_ids=[201, 202],
            span_ids=[107, 108],
            think_len=1,
            drift=True,
            drift_reason="rewritten",
        ),
        Turn(context_len=10, span_ids=[109, 110, 111, 112], think_len=1),
    ]
    return _trajectory(trunk, turns)


def test_forks_inside_a_convolution_window(qwen3_5: Any) -> None:
    trajectory = _forks_in_one_convolution_window()
    assert qwen3_5.config.linear_conv_kernel_dim - 1 >= 3
    with torch.no_grad():
        packed = _packed_logprobs(qwen3_5, [trajectory])
        expected = _plain_span_logprobs(qwen3_5, trajectory)
    assert torch.allclose(packed, expected, atol=ATOL)
    _assert_same(_losses_and_grads(qwen3_5, [_scored(trajectory)], "opd"))


def test_a_42_turn_trajectory_packs_exactly(qwen3_5: Any) -> None:
    trajectory = _long_trajectory(42)
    pack = pack_trajectory(trajectory)
    assert len(hybrid_tree.hybrid_tree(pack.trunk_len, pack.branches()).forks) == 42
    with torch.no_grad():
        packed = _packed_logprobs(qwen3_5, [trajectory])
        expected = _plain_span_logprobs(qwen3_5, trajectory)
    assert torch.allclose(packed, expected, atol=ATOL)
    _assert_same(_losses_and_grads(qwen3_5, [_scored(trajectory)], "opd"))


def test_qwen3_next_packs_exactly(qwen3_next: Any) -> None:
    batch = [_long_trajectory(7), _forks_in_one_convolution_window()]
    with torch.no_grad():
        packed = _packed_logprobs(qwen3_next, batch)
        expected = torch.cat([_plain_span_logprobs(qwen3_next, t) for t in batch])
    assert torch.allclose(packed, expected, atol=ATOL)
    _assert_same(_losses_and_grads(qwen3_next, batch[:1], "sft"))


def test_the_trunk_equals_a_plain_forward(qwen3_5: Any) -> None:
    """The outer loop run here (embeddings, rotary, layers, norm) is the model's own."""
    pack = pack_trajectory(_long_trajectory(5))
    trunk = torch.tensor([pack.ids[: pack.trunk_len]])
    with torch.no_grad():
        tree = trunk_then_branches(qwen3_5, pack)
        plain = qwen3_5.base_model(input_ids=trunk).last_hidden_state[0]
    assert torch.allclose(tree[: pack.trunk_len], plain, atol=ATOL)


def test_branches_from_zero_states_miss_the_reference(
    qwen3_5: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the same kernel with every branch forking at 0 (fresh recurrent
    and convolution states, the trunk in one segment) no longer matches."""
    trajectory = _long_trajectory(6)
    real = hybrid_tree.hybrid_tree

    def from_zero(trunk_len: int, branches: Any) -> hybrid_tree.HybridTree:
        tree = real(trunk_len, branches)
        batches = [[(start, end, 0) for start, end, _ in batch] for batch in tree.batches]
        return replace(tree, forks=[0], batches=batches)

    with torch.no_grad():
        expected = _plain_span_logprobs(qwen3_5, trajectory)
        monkeypatch.setattr("slime_ext.turns.hybrid_tree", from_zero)
        zero_states = _packed_logprobs(qwen3_5, [trajectory])
    assert (zero_states - expected).abs().max() > 100 * ATOL


def test_branch_batches_keep_padding_bounded_and_every_branch_once() -> None:
    branches = [
        (100 + 10 * k, 100 + 10 * k + length, 5 * k)
        for k, length in enumerate([3, 40, 41, 1, 39, 2, 8])
    ]
    tree = hybrid_tree.hybrid_tree(100, branches)
    flat = sorted(b for batch in tree.batches for b in batch)
    assert flat == sorted(branches)
    for batch in tree.batches:
        lengths = [end - start for start, end, _ in batch]
        assert max(lengths) * len(lengths) <= hybrid_tree.BRANCH_PADDING * sum(lengths)
    with pytest.raises(ValueError, match="outside the trunk"):
        hybrid_tree.hybrid_tree(10, [(10, 12, 11)])


def test_hybrids_pack_through_the_kv_kernel_and_refuse_the_mask_kernels(qwen3_5: Any) -> None:
    trainer = LocalTrainer(qwen3_5, TrainerConfig(sequence_layout="auto"))
    assert (trainer.layout, trainer.packed_kernel) == ("packed", "kv")
    for kernel in ("mask", "flex"):
        with pytest.raises(PackingUnsupported, match="packed_kernel kv"):
            LocalTrainer(qwen3_5, TrainerConfig(sequence_layout="packed", packed_kernel=kernel))
        config = TrainerConfig(sequence_layout="auto", packed_kernel=kernel)
        assert LocalTrainer(qwen3_5, config).layout == "per_turn"


def test_sliding_window_layers_are_still_refused(factory_tokenizer: Any) -> None:
    config = Qwen3Config(
        vocab_size=len(factory_tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = Qwen3ForCausalLM(config)
    with pytest.raises(PackingUnsupported, match="sliding_attention"):
        check_packable(model)
    assert LocalTrainer(model, TrainerConfig(sequence_layout="auto")).layout == "per_turn"
