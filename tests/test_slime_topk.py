"""The teacher's top-k on slime (slime_ext/slime/topk.py): the rows our samples carry, the
wrappers that extend slime's data path, and their refusals. The whole path, slime's own
code from the generate hook's samples to the loss at every layout, is in
tests/test_slime_real.py; the real Megatron step in tests/test_megatron_step.py."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.slime_driver import require_slime

require_slime()

from slime.utils.types import Sample  # noqa: E402

from rollout.trajectory import TrajectoryStatus  # noqa: E402
from slime_ext.slime import topk  # noqa: E402
from slime_ext.slime.extend import before, logged_without, require_source, wrap  # noqa: E402
from slime_ext.slime.samples import to_samples  # noqa: E402
from slime_ext.slime.settings import HookConfigError  # noqa: E402

K = 3


def _with_topk(trajectories: list[Any]) -> list[Any]:
    for trajectory in trajectories:
        for t, turn in enumerate(trajectory.turns):
            n = len(turn.span_ids)
            turn.teacher_topk_ids = [[t * 100 + i, 7, 8] for i in range(n)]
            turn.teacher_topk_logprobs = [[-1.0, -2.0, -3.0 - i] for i in range(n)]
    return trajectories


def _base(index: int = 0) -> Sample:
    return Sample(index=index, group_index=0, prompt="p", metadata={"source": "x"})


def test_samples_carry_their_turns_rows_and_fillers_elsewhere(factory_tokenizer: Any) -> None:
    from tests.test_slime_hooks import _scripted

    drop = _with_topk(_scripted(factory_tokenizer))[0]
    samples = to_samples(drop, _base(), "kl", teacher_top_k=K)
    assert len(samples) == drop.num_turns
    for turn, sample in zip(drop.turns, samples, strict=True):
        rows = topk.of_sample(sample)
        assert rows is not None and rows.ids.dtype == torch.int32
        assert rows.ids.tolist() == turn.teacher_topk_ids
        assert rows.logprobs.tolist() == turn.teacher_topk_logprobs
    assert topk.of_sample(to_samples(drop, _base(), "kl")[0]) is None  # k 0: nothing
    keep = _with_topk(_scripted(factory_tokenizer, think_policy="keep"))[0]
    [whole] = to_samples(keep, _base(), "kl", teacher_top_k=K)
    rows = topk.of_sample(whole)
    assert rows is not None and rows.ids.shape == (whole.response_length, K)
    prompt = len(whole.tokens) - whole.response_length
    covered = set()
    for t, turn in enumerate(keep.turns):
        start = len(keep.context_ids(t)) - prompt
        span = range(start, start + len(turn.span_ids))
        assert rows.ids[span.start : span.stop].tolist() == turn.teacher_topk_ids
        covered.update(span)
    others = [i for i in range(whole.response_length) if i not in covered]
    assert others and all(rows.ids[i].tolist() == list(range(K)) for i in others)
    assert rows.logprobs[others].allclose(torch.tensor(-math.log(K)))


def test_trajectories_without_fitting_rows_become_placeholders(factory_tokenizer: Any) -> None:
    from tests.test_slime_hooks import _scripted

    trajectory = _with_topk(_scripted(factory_tokenizer))[0]
    trajectory.turns[1].teacher_topk_ids = None
    [missing] = to_samples(trajectory, _base(), "kl", teacher_top_k=K)
    assert missing.remove_sample and "teacher top-k" in missing.metadata["opd"]["abort_reason"]
    rows = topk.of_sample(missing)
    assert rows is not None and rows.ids.shape == (1, K)  # every sample carries rows
    narrow = _with_topk(_scripted(factory_tokenizer))[0]
    narrow.turns[0].teacher_topk_ids = [row[:2] for row in narrow.turns[0].teacher_topk_ids]
    [refused] = to_samples(narrow, _base(), "kl", teacher_top_k=K)
    assert refused.remove_sample and f"not {K} wide" in refused.metadata["opd"]["abort_reason"]
    aborted = _with_topk(_scripted(factory_tokenizer))[0].model_copy(
        update={"status": TrajectoryStatus.SANDBOX_ERROR, "status_reason": "gone"}
    )
    [placeholder] = to_samples(aborted, _base(), "kl", teacher_top_k=K)
    assert topk.of_sample(placeholder) is not None


def test_the_split_wrapper_refuses_rows_that_do_not_fit_the_step(factory_tokenizer: Any) -> None:
    from tests.test_slime_hooks import _scripted

    trajectory = _with_topk(_scripted(factory_tokenizer))[0]
    samples = to_samples(trajectory, _base(), "kl", teacher_top_k=K)
    topk.record_step(samples)
    lengths = [s.response_length for s in samples]
    rank = {"partition": [2, 0], "response_lengths": [lengths[2], lengths[0]]}
    topk.add_rank_rows(rank)
    assert [t.shape[0] for t in rank[topk.TOPK_IDS]] == [lengths[2], lengths[0]]
    with pytest.raises(topk.TopKError, match="another list of samples"):
        topk.add_rank_rows({"partition": [len(samples)], "response_lengths": [1]})
    with pytest.raises(topk.TopKError, match="rows for a response"):
        topk.add_rank_rows({"partition": [0], "response_lengths": [lengths[0] + 1]})
    topk.record_step([_base()])  # a step without rows: the wrapper adds nothing
    nothing: dict[str, Any] = {"partition": [0], "response_lengths": [1]}
    topk.add_rank_rows(nothing)
    assert topk.TOPK_IDS not in nothing


def test_wrappers_are_installed_once_and_checked_against_slimes_code() -> None:
    from slime.backends.megatron_utils import model
    from slime.observability import train_metric_utils
    from slime.ray import rollout

    topk.install_rollout_side()
    topk.install_train_side()
    wrapped = rollout.tensorize_rollout_data_for_training
    topk.install_rollout_side()
    topk.install_train_side()
    assert rollout.tensorize_rollout_data_for_training is wrapped
    for module, name in [
        (rollout, "tensorize_rollout_data_for_training"),
        (model, "get_batch"),
        (train_metric_utils, "log_rollout_data"),
    ]:
        assert topk.TAG in extension_tags(getattr(module, name))

    def step_without_the_call() -> None:
        """a slime whose step fetches its batch some other way"""

    with pytest.raises(HookConfigError, match="SLIME_COMMIT"):
        require_source(step_without_the_call, ("get_batch(",), "train_one_step", topk._drifted)


def extension_tags(function: Any) -> list[str]:
    """The tags of the extensions whose wrappers chain into `function`."""
    tags = []
    while function is not None:
        if hasattr(function, "__opd_extension__"):
            tags.append(function.__opd_extension__)
        function = getattr(function, "__opd_wraps__", None)
    return tags


def test_two_extensions_chain_their_wrappers_and_each_wraps_once() -> None:
    from types import SimpleNamespace

    calls: list[str] = []
    module = SimpleNamespace(__name__="fake", step=lambda data: calls.append("slime"))
    for _ in range(3):
        for tag in ("a", "b"):
            wrap(module, "step", before(lambda data, t=tag: calls.append(t)), tag, topk._drifted)
    module.step({})
    assert calls == ["b", "a", "slime"] and extension_tags(module.step) == ["b", "a"]


def test_train_side_wrappers_add_and_hide_only_our_keys() -> None:
    seen: dict[str, Any] = {}

    def get_batch(iterator: Any, keys: list[str], *args: Any) -> None:
        seen["keys"] = list(keys)

    wrapped = topk._with_batch_keys(get_batch)
    wrapped(None, ["tokens", "teacher_log_probs"], 128)
    assert seen["keys"] == ["tokens", "teacher_log_probs", *topk.BATCH_KEYS]
    wrapped(None, ["tokens", "log_probs"], 128)  # the log-prob forward: nothing added
    assert seen["keys"] == ["tokens", "log_probs"]

    def log(rollout_id: int, args: Any, data: dict[str, Any]) -> None:
        seen["logged"] = sorted(data)

    logged_without(topk.BATCH_KEYS)(log)(
        0, None, {"tokens": 1, topk.TOPK_IDS: 2, topk.TOPK_LOGPROBS: 3}
    )
    assert seen["logged"] == ["tokens"]
