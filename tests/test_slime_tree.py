"""Tree-packed samples on slime, piece by piece (the whole path, with real Megatron steps,
is tests/test_megatron_step.py): the sample's layout, the trees' ride through slime's data
path, and the tree attention's rule, kernels and CP rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.slime_driver import require_slime

require_slime()

from slime.utils.types import Sample  # noqa: E402

from rollout.trajectory import TrajectoryStatus  # noqa: E402
from slime_ext.slime import tree  # noqa: E402
from slime_ext.slime.extend import logged_without  # noqa: E402
from slime_ext.slime.samples import TREE_KEY, causal_tree, to_samples  # noqa: E402
from slime_ext.slime.topk import of_sample as topk_of  # noqa: E402
from slime_ext.slime.tree_attention import (  # noqa: E402
    TreeTable,
    _block_mask,
    _dense,
    _flex,
    zigzag_indices,
)
from slime_ext.turns import attention_rule, pack  # noqa: E402
from tests.test_packing import trajectories  # noqa: E402
from tests.test_slime_real import scripted_with_topk  # noqa: E402


def _base(index: int = 0) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", metadata={})


@pytest.fixture(scope="module")
def tiny_model(factory_tokenizer: Any) -> Any:
    from slime_ext.models.factory import build_model

    return build_model("qwen3-tiny", factory_tokenizer, seed=3).eval()


@pytest.fixture(scope="module")
def scripted(factory_tokenizer: Any) -> list[Any]:
    return scripted_with_topk(factory_tokenizer)


def test_a_packed_sample_holds_every_span_token_where_its_predictor_is_before_it(
    scripted: list[Any],
) -> None:
    for trajectory in scripted:
        per_turn = to_samples(trajectory, _base(), "kl", teacher_top_k=4)
        [packed] = to_samples(trajectory, _base(), "kl", teacher_top_k=4, layout="packed")
        response = packed.tokens[-packed.response_length :]
        mask = torch.tensor(packed.loss_mask, dtype=torch.bool)
        # the loss tokens, in order, are the per-turn samples' responses, with their values
        assert [t for t, m in zip(response, packed.loss_mask, strict=True) if m] == [
            t for s in per_turn for t in s.tokens[-s.response_length :]
        ]
        for key in ("rollout_log_probs", "teacher_log_probs"):
            kept = [v for v, m in zip(getattr(packed, key), packed.loss_mask, strict=True) if m]
            assert kept == [v for s in per_turn for v in getattr(s, key)]
        rows = topk_of(packed)
        assert rows is not None and rows.ids.shape[0] == packed.response_length
        assert torch.equal(rows.ids[mask], torch.cat([topk_of(s).ids for s in per_turn]))  # type: ignore[union-attr]
        assert len(packed.tokens) < sum(len(s.tokens) for s in per_turn)
        tree_rows = packed.train_metadata[TREE_KEY]
        assert tree_rows.shape == (3, len(packed.tokens)) and tree_rows.dtype == torch.int32


def test_stems_predict_a_span_exactly_as_the_trunk_would(
    scripted: list[Any], factory_tokenizer: Any
) -> None:
    """A branch's stem repeats its context's last token at that token's position and sees
    the trunk before it: its hidden state is the trunk's there, so the span's log-probs
    match the packing without stems (the local trainer's)."""
    from slime_ext.models.factory import build_model

    model = build_model("qwen3-tiny", factory_tokenizer, seed=0).eval()
    trajectory = scripted[0]

    def span_logits(stems: bool) -> torch.Tensor:
        packed = pack(trajectory.trunk_ids, trajectory.turns, stems=stems)
        mask = attention_rule(packed)[None, None]
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor([packed.ids]),
                position_ids=torch.tensor([packed.positions]),
                attention_mask=mask,
            )
        return out.logits[0, packed.span_rows]

    assert torch.allclose(span_logits(True), span_logits(False), atol=1e-5)


def test_placeholders_carry_a_causal_tree_and_a_step_is_packed_throughout(
    scripted: list[Any],
) -> None:
    aborted = scripted[0].model_copy(
        update={"status": TrajectoryStatus.SANDBOX_ERROR, "status_reason": "gone"}
    )
    [placeholder] = to_samples(aborted, _base(1), "kl", layout="packed")
    assert placeholder.remove_sample
    assert torch.equal(placeholder.train_metadata[TREE_KEY], causal_tree(len(placeholder.tokens)))
    [packed] = to_samples(scripted[1], _base(2), "kl", layout="packed")
    per_turn = to_samples(scripted[1], _base(3), "kl")
    with pytest.raises(tree.TreeError, match="packed throughout"):
        tree.record_step([packed, *per_turn])
    tree.record_step(per_turn)  # none packed: nothing carried
    data: dict[str, Any] = {"partition": [0], "tokens": [per_turn[0].tokens]}
    tree.add_rank_trees(data)
    assert tree.TREE_ROWS not in data


def test_each_dp_rank_gets_its_partitions_trees_and_a_misfit_is_refused(
    scripted: list[Any],
) -> None:
    samples = [to_samples(t, _base(i), "kl", layout="packed")[0] for i, t in enumerate(scripted)]
    tree.record_step(samples)
    rank = {"partition": [2, 0], "tokens": [samples[2].tokens, samples[0].tokens]}
    tree.add_rank_trees(rank)
    assert [t.shape[1] for t in rank[tree.TREE_ROWS]] == [
        len(samples[2].tokens),
        len(samples[0].tokens),
    ]
    with pytest.raises(tree.TreeError, match="for 3 tokens"):
        tree.add_rank_trees({"partition": [1], "tokens": [[1, 2, 3]]})
    with pytest.raises(tree.TreeError, match="another list of samples"):
        tree.add_rank_trees({"partition": [7], "tokens": [[1]]})
    tree.record_step([])


def test_get_batch_hangs_the_trees_on_packed_seq_params_and_logs_skip_them() -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    seen: dict[str, Any] = {}
    trees = [causal_tree(3)]

    def get_batch(iterator: Any, keys: list[str], *args: Any) -> dict[str, Any]:
        seen["keys"] = list(keys)
        return {"tokens": 1, "packed_seq_params": PackedSeqParams(), tree.TREE_ROWS: trees}

    batch = tree._with_trees(get_batch)(None, ["tokens", "log_probs"], 128, False)
    assert seen["keys"] == ["tokens", "log_probs", tree.TREE_ROWS]
    assert batch["packed_seq_params"].opd_tree == trees and tree.TREE_ROWS not in batch
    with pytest.raises(Exception, match="allgather-cp"):
        tree._with_trees(get_batch)(None, ["tokens"], 128, True)

    def log(rollout_id: int, args: Any, data: dict[str, Any]) -> None:
        seen["logged"] = sorted(data)

    logged_without((tree.TREE_ROWS,))(log)(0, None, {"tokens": 1, tree.TREE_ROWS: 2})
    assert seen["logged"] == ["tokens"]


def test_the_tables_rule_is_the_packed_rule_per_sequence_and_padding_is_causal(
    scripted: list[Any],
) -> None:
    packs = [pack(t.trunk_ids, t.turns, stems=True) for t in scripted[:2]]
    trees = [torch.tensor([p.positions, p.branch, p.visible_trunk]) for p in packs]
    lengths = [len(p.ids) + 3 for p in packs]  # slime pads each sample (CP); and a tail
    starts = [0, lengths[0], lengths[0] + lengths[1], lengths[0] + lengths[1] + 5]
    table = TreeTable.of(starts, trees)
    rows = torch.arange(starts[-1])
    rule = table.may_attend(rows[:, None], rows[None])
    for s, p in enumerate(packs):
        lo, n = starts[s], len(p.ids)
        assert torch.equal(rule[lo : lo + n, lo : lo + n], attention_rule(p))
        assert not rule[lo : lo + n, :lo].any()  # nothing of another sequence
        pad = rule[lo + n : lo + lengths[s], lo + n : lo + lengths[s]]
        assert torch.equal(pad, torch.ones(3, 3, dtype=torch.bool).tril())
    assert rule.diagonal().all()


def test_cp_ranks_hold_zigzag_chunks_and_share_an_uneven_padding_tail() -> None:
    held = torch.cat([zigzag_indices(16, r, 2) for r in range(2)]).sort().values
    assert torch.equal(held, torch.arange(16))
    assert zigzag_indices(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(torch.cat([zigzag_indices(6, r, 2) for r in range(2)]), torch.arange(6))


def test_flex_and_dense_kernels_agree(scripted: list[Any]) -> None:
    """FlexAttention's block mask from the same rule (CPU: its forward, unfused)."""
    packs = [pack(t.trunk_ids, t.turns, stems=True) for t in scripted]
    trees = [torch.tensor([p.positions, p.branch, p.visible_trunk]) for p in packs]
    starts = [0]
    for p in packs:
        starts.append(starts[-1] + len(p.ids))
    table = TreeTable.of(starts, trees)
    rows = table.rank_rows(0, 1)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(starts[-1], h, 8, generator=generator) for h in (4, 2, 2))
    dense = _dense(q, k, v, table.may_attend(rows[:, None], rows[None]), 8**-0.5)
    flex = _flex(q, k, v, _block_mask(table, rows, rows), 8**-0.5)
    assert torch.allclose(dense, flex, atol=1e-5)


def _spec_args(**overrides: Any) -> Any:
    from types import SimpleNamespace

    values: dict[str, Any] = {
        "position_embedding_type": "rope", "transformer_impl": "local", "num_experts": None,
        "moe_grouped_gemm": False, "qk_layernorm": True, "moe_use_legacy_grouped_gemm": False,
        "rotary_percent": 1.0, "rotary_base": 1000000, "allgather_cp": False,
    }  # fmt: skip
    return SimpleNamespace(**(values | overrides))


def test_slimes_spec_hook_puts_the_tree_attention_in_every_layer_and_takes_rope_over() -> None:
    """--spec slime_ext.slime.tree_attention layer_spec, as slime's provider calls it: the
    default layer with our core attention; RoPE (also as slime's model scripts set it, with
    the legacy --use-rotary-position-embeddings) moves into the attention."""
    from slime_ext.slime.settings import HookConfigError
    from slime_ext.slime.tree_attention import TreeCoreAttention, layer_spec

    args = _spec_args()
    spec = layer_spec(args, config=None)
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is TreeCoreAttention and core.params["rope"].rotary_base == 1000000
    assert spec.submodules.self_attention.submodules.q_layernorm is not None  # Qwen3's QK norm
    assert args.position_embedding_type == "none"  # slime builds GPTModel from args next
    for bad, match in [
        ({"position_embedding_type": "learned_absolute"}, "plain RoPE"),
        ({"use_rope_scaling": True}, "no rope scaling"),
        ({"allgather_cp": True}, "allgather-cp"),
    ]:
        with pytest.raises(HookConfigError, match=match):
            layer_spec(_spec_args(**bad), config=None)


def test_the_spec_hook_refuses_a_slime_whose_provider_reads_rope_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from slime.backends.megatron_utils import model_provider

    from slime_ext.slime.settings import HookConfigError
    from slime_ext.slime.tree_attention import layer_spec

    def provider(args: Any) -> Any:
        kwargs = {"position_embedding_type": args.position_embedding_type}
        return kwargs, args.spec(args, None, None)

    monkeypatch.setattr(model_provider, "_get_model_provider_func", provider)
    with pytest.raises(HookConfigError, match="SLIME_COMMIT"):
        layer_spec(_spec_args(), config=None)


@settings(max_examples=25, deadline=None)
@given(trajectory=st.sampled_from(["drop", "keep"]).flatmap(trajectories))
def test_any_trajectory_packs_into_one_sample_that_trains_what_per_turn_does(
    trajectory: Any, tiny_model: Any
) -> None:
    """Any number of turns, drifted suffixes, spans held in the trunk or not (a held span
    lies inside the trunk, before earlier turns' branches: the places are not in turn
    order, which a per-trajectory sum does not see), any mask tier: each span token is at
    its own place with its own mask and log-probs, and the outputs that predict them (the
    rows right before them, stems included) equal the packing without stems (the local
    trainer's, exact against per-turn forwards)."""
    from rollout.masking import loss_mask_for

    [packed] = to_samples(trajectory, _base(), "imitation", layout="packed")
    with_stems = pack(trajectory.trunk_ids, trajectory.turns, stems=True)
    plain = pack(trajectory.trunk_ids, trajectory.turns)
    prompt = len(packed.tokens) - packed.response_length
    places = [row + 1 - prompt for row in with_stems.span_rows]
    assert len(set(places)) == len(places) and min(places) == 0
    turn_tokens = [
        (token, int(loss_mask_for(turn.mask_tier, "imitation", True)), logprob)
        for turn in trajectory.turns
        for token, logprob in zip(turn.span_ids, turn.logprobs, strict=True)
    ]
    response = packed.tokens[prompt:]
    assert [
        (response[i], packed.loss_mask[i], packed.rollout_log_probs[i]) for i in places
    ] == turn_tokens
    assert sum(packed.loss_mask) == sum(m for _, m, _ in turn_tokens)  # nothing else carries

    def rows(layout: Any) -> torch.Tensor:
        with torch.no_grad():
            out = tiny_model(
                input_ids=torch.tensor([layout.ids]),
                position_ids=torch.tensor([layout.positions]),
                attention_mask=attention_rule(layout)[None, None],
            )
        return out.logits[0, layout.span_rows]

    assert torch.allclose(rows(with_stems), rows(plain), atol=1e-5)


def test_the_rollout_log_reports_processed_tokens_per_loss_token(scripted: list[Any]) -> None:
    """perf/processed_tokens_per_loss_token on slime, the local trainer's definition: the
    kept samples' tokens over their loss tokens; packed about the every-token-once bound,
    per turn every context again."""
    from slime_ext.slime.metrics import sample_metrics

    aborted = scripted[2].model_copy(
        update={"status": TrajectoryStatus.ABORTED, "status_reason": "deadline"}
    )
    ratios = {}
    for layout in ("per_turn", "packed"):
        samples = [
            s
            for i, t in enumerate([*scripted, aborted])
            for s in to_samples(t, _base(i), "kl", layout=layout)  # type: ignore[arg-type]
        ]
        metrics = sample_metrics(samples)
        kept = [s for s in samples if not s.remove_sample]
        assert metrics["perf/processed_tokens"] == sum(len(s.tokens) for s in kept)
        assert metrics["perf/loss_tokens"] == sum(sum(s.loss_mask) for s in kept)
        ratios[layout] = metrics["perf/processed_tokens_per_loss_token"]
    assert ratios["packed"] < ratios["per_turn"] / 1.5


def test_a_packed_job_whose_micro_batch_lost_its_trees_fails_instead_of_attending_causally(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without its tree a packed sample would be attended causally (a silently wrong
    model): on a packed job's ranks get_batch refuses a micro-batch without trees."""
    import yaml
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime_ext.job.config import config_from_dict

    def get_batch(iterator: Any, keys: list[str], *args: Any) -> dict[str, Any]:
        return {"tokens": 1, "packed_seq_params": PackedSeqParams()}

    monkeypatch.setattr(tree, "install_train_side", lambda: None)
    monkeypatch.setattr(tree.topk, "install_train_side", lambda: None)
    monkeypatch.setattr(tree, "_expect_trees", False)
    for layout, fails in (("per_turn", False), ("packed", True)):
        job = config_from_dict({"algorithm": {"sequence_layout": layout}})
        path = tmp_path / f"{layout}.yaml"
        path.write_text(yaml.safe_dump(job.model_dump(mode="json")))
        tree.init(type("Args", (), {"opd_job_config": str(path)})())
        if fails:
            with pytest.raises(tree.TreeError, match="without its trees"):
                tree._with_trees(get_batch)(None, ["tokens"], 128, False)
        else:
            assert "packed_seq_params" in tree._with_trees(get_batch)(None, ["tokens"], 128, False)


def test_the_split_wrapper_reaches_a_rollout_manager_whose_methods_read_copied_globals(
    scripted: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a job Ray ships the RolloutManager class by value: its methods read a copy of
    slime.ray.rollout's globals (tests/test_slime_train.py runs that for real). A wrapper
    put on the module alone would never run there; installed from inside a manager's
    generate, it wraps the copy the split reads too."""
    from slime.ray import rollout

    monkeypatch.setattr(rollout, "tensorize_rollout_data_for_training", lambda data: None)
    copied = dict(vars(rollout))  # what the unpickled class's methods read

    class Manager:  # generate and the split run with the copied globals, as in the actor
        def _split_train_data_by_dp(self, data: dict[str, Any]) -> dict[str, Any]:
            copied["tensorize_rollout_data_for_training"](data)
            return data

    source = "def generate(self, samples):\n    record_step(samples)\n"
    namespace: dict[str, Any] = {}
    exec(compile(source, "slime/ray/rollout.py", "exec"), copied, namespace)
    Manager.generate = namespace["generate"]  # type: ignore[attr-defined]
    copied["record_step"] = tree.record_step
    samples = [to_samples(t, _base(i), "kl", layout="packed")[0] for i, t in enumerate(scripted)]
    Manager().generate(samples)  # type: ignore[attr-defined]
    data = Manager()._split_train_data_by_dp({"partition": [1], "tokens": [samples[1].tokens]})
    assert [t.shape[1] for t in data[tree.TREE_ROWS]] == [len(samples[1].tokens)]
    tree.record_step([])
