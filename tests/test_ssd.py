"""SSD: self-sampling through `opd ssd sample` (every trajectory kept, resumable) and
`opd ssd export` (per-turn records equal to the sampled turns, invalid turns masked,
aborted trajectories counted and left out, duplicates dropped, parquet round trip)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from launch.ssd_cli import ssd_app
from rollout.chat import ChatRenderer
from rollout.harness.tir import TIRHarness
from rollout.policy import Generation, HFPolicy, SamplingParams
from rollout.runner import Runner, RunnerConfig
from rollout.trajectory import (
    MaskTier,
    Task,
    Trajectory,
    TrajectoryStatus,
    read_jsonl,
    write_jsonl,
)
from slime_ext.cpu_runtime.sglang_http import create_standin
from slime_ext.models.factory import build_model
from slime_ext.sft_data import read_records
from slime_ext.slime.samples import METADATA_KEY
from slime_ext.slime.sft_rollout import generate_rollout
from slime_ext.ssd import (
    SSDInputError,
    export_records,
    load_tasks,
    sample_trajectories,
    summarize_trajectories,
)
from tests.live_server import serve_in_thread
from tests.slime_driver import sample_class
from tests.test_runner import REPLIES, TASKS, ScriptedPolicy

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
Calls = dict[str, list[tuple[list[int], list[int], SamplingParams]]]


@pytest.fixture
def policy_calls(monkeypatch: pytest.MonkeyPatch) -> Calls:
    """Every HFPolicy generation per session: (input ids, output ids, sampling params)."""
    calls: Calls = defaultdict(list)
    original = HFPolicy.generate

    async def recording(
        self: HFPolicy, input_ids: list[int], params: SamplingParams, session_id: str | None = None
    ) -> Generation:
        generation = await original(self, input_ids, params, session_id)
        calls[str(session_id)].append((list(input_ids), list(generation.output_ids), params))
        return generation

    monkeypatch.setattr(HFPolicy, "generate", recording)
    return calls


def _invoke(*args: str) -> Any:
    result = CliRunner().invoke(ssd_app, list(args))
    assert result.exit_code == 0, result.output
    return result


def _expected_record(trajectory: Trajectory, k: int) -> tuple[list[int], list[int]]:
    turn = trajectory.turns[k]
    carries = turn.mask_tier is MaskTier.VALID
    return trajectory.context_ids(k) + turn.span_ids, [int(carries)] * len(turn.span_ids)


@pytest.mark.timeout(240)
def test_sampled_trajectories_export_exactly_as_the_policy_saw_and_sampled_them(
    tmp_path: Path, policy_calls: Calls
) -> None:
    trajectories_path = tmp_path / "ssd.jsonl"
    _invoke(
        "sample",
        *("--policy", "bundled:student", "--tasks", "arithmetic:3", "-n", "2"),
        *("--temperature", "1.1", "--top-k", "10", "--top-p", "0.95"),
        *("--max-turns", "3", "--max-new-tokens", "96", "--out", str(trajectories_path)),
    )
    trajectories = list(read_jsonl(trajectories_path))
    tasks = load_tasks("arithmetic:3")
    # one trajectory per (task, sample), whatever its reward: no rejection sampling
    assert sorted((t.task.task_id, t.sample_index) for t in trajectories) == sorted(
        (task.task_id, i) for task in tasks for i in range(2)
    )
    assert all(t.reward is not None and t.turns for t in trajectories)
    params = {p for calls in policy_calls.values() for _, _, p in calls}
    assert {(p.temperature, p.top_k, p.top_p) for p in params} == {(1.1, 10, 0.95)}
    summary = json.loads((tmp_path / "ssd.jsonl.summary.json").read_text())
    assert summary == {
        **summarize_trajectories(trajectories).model_dump(mode="json"),
        "sampled_this_run": 6,
        "skipped_done": 0,
        "sampling": summary["sampling"],
    }
    assert summary["sampling"]["temperature"] == 1.1 and summary["sampling"]["top_k"] == 10
    assert summary["positives"] + summary["negatives"] == 6
    assert sum(summary["turns_per_tier"].values()) == summary["turns"] > 0

    out = tmp_path / "sft.parquet"
    _invoke("export", "--trajectories", str(trajectories_path), "--out", str(out))
    records = read_records(out)
    by_id = {t.trajectory_id: t for t in trajectories}
    # two T=1.1 samples of one task may sample the same first turn: export keeps one
    distinct = {
        (tuple(tokens), tuple(mask))
        for t in trajectories
        for k in range(t.num_turns)
        for tokens, mask in [_expected_record(t, k)]
    }
    assert len(records) == len(distinct)
    for record in records:
        trajectory = by_id[record.trajectory_id]
        # what the model was given, and what it sampled
        context, span, _params = policy_calls[record.trajectory_id][record.turn]
        tokens, loss_mask = _expected_record(trajectory, record.turn)
        assert record.tokens == tokens == context + span
        assert record.response_length == len(span)
        assert record.loss_mask == loss_mask
        assert record.reward == trajectory.reward
    exported = json.loads((tmp_path / "sft.parquet.summary.json").read_text())
    assert exported["records"] == len(records)
    assert exported["duplicates_dropped"] == sum(t.num_turns for t in trajectories) - len(records)
    assert exported["loss_tokens"] == sum(sum(r.loss_mask) for r in records)
    assert exported["tokens_total"] == sum(len(r.tokens) for r in records)

    # slime's SFT rollout function serves the parquet file unchanged, per trajectory
    args = SimpleNamespace(opd_sft_data=str(out), rollout_batch_size=6, seed=0)
    for [segments] in generate_rollout(args, 0, None, sample_class=sample_class()):
        trajectory_id = segments[0].metadata[METADATA_KEY]["trajectory_id"]
        expected = [r for r in records if r.trajectory_id == trajectory_id]
        assert [(s.tokens, s.loss_mask) for s in segments] == [
            (r.tokens, r.loss_mask) for r in expected
        ]


@pytest.mark.timeout(180)
def test_sample_resumes_after_a_crash_without_resampling_done_samples(
    tmp_path: Path, policy_calls: Calls
) -> None:
    out = tmp_path / "ssd.jsonl"
    common = ("--policy", "factory:qwen3-tiny", "--models-dir", str(tmp_path / "models"))
    limits = ("-n", "2", "--max-turns", "1", "--max-new-tokens", "8", "--out", str(out))
    _invoke("sample", *common, "--tasks", "arithmetic:2", *limits)
    lines = out.read_text().splitlines(keepends=True)
    assert len(lines) == 4
    out.write_text(lines[0] + lines[1][: len(lines[1]) // 2])  # a crash mid-write
    first = Trajectory.from_json_line(lines[0])
    policy_calls.clear()
    result = _invoke("sample", *common, "--tasks", "arithmetic:3", *limits)
    assert "1 of 6 samples are already there" in result.output
    assert out.read_text().startswith(lines[0])  # appended after, never rewritten
    trajectories = list(read_jsonl(out))
    keys = [(t.task.task_id, t.sample_index) for t in trajectories]
    assert len(keys) == len(set(keys)) == 6
    assert first.trajectory_id not in policy_calls  # the done sample was not sampled again
    assert len(policy_calls) == 5
    summary = json.loads((tmp_path / "ssd.jsonl.summary.json").read_text())
    assert (summary["trajectories"], summary["sampled_this_run"], summary["skipped_done"]) == (
        6,
        5,
        1,
    )
    _invoke("sample", *common, "--tasks", "arithmetic:3", *limits)  # all done: no model
    assert len(list(read_jsonl(out))) == 6


def _scripted(factory_tokenizer: Any, out: Path) -> list[Trajectory]:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    runner = Runner(harness, ScriptedPolicy(renderer, REPLIES), renderer, RunnerConfig())
    jobs = [(task, 0) for task in TASKS]
    assert asyncio.run(sample_trajectories(runner, jobs, out, show_progress=False)) == 3
    return list(read_jsonl(out))


@pytest.mark.timeout(120)
def test_export_masks_invalid_turns_skips_aborted_and_drops_duplicates(
    factory_tokenizer: Any, tmp_path: Path
) -> None:
    sampled = tmp_path / "sampled.jsonl"
    trajectories = _scripted(factory_tokenizer, sampled)
    by_task = {t.task.task_id: t for t in trajectories}
    summary = summarize_trajectories(trajectories)
    # positives and the negative are all kept
    assert (summary.positives, summary.negatives) == (2, 1)
    assert summary.turns_per_tier == {"valid": 7, "tier1": 1, "tier2": 0}
    assert summary.masked_share == pytest.approx(1 / 8)

    mul = by_task["mul"]
    mul.turns[1].mask_tier = MaskTier.SHELL_ERROR  # as a swe shell refusal would mark it
    aborted = by_task["wrong"].model_copy(
        update={
            "trajectory_id": "wrong#9",
            "status": TrajectoryStatus.ABORTED,
            "status_reason": "trajectory deadline",
            "reward": None,
        }
    )
    crashed = aborted.model_copy(
        update={"trajectory_id": "wrong#8", "status": TrajectoryStatus.SANDBOX_ERROR}
    )
    first = tmp_path / "first.jsonl"
    write_jsonl(first, [*trajectories, aborted, crashed])
    second = tmp_path / "second.jsonl"
    shutil.copy(first, second)  # the same samples again: every record a duplicate
    other = tmp_path / "other.jsonl"  # another run: same trajectory id, other samples
    rerun = by_task["half"].model_copy(deep=True)
    rerun.turns[2].span_ids[0] += 1  # its last turn sampled one other token
    write_jsonl(other, [rerun])

    out = tmp_path / "sft.parquet"
    exported = export_records([first, second, other], out)
    records = read_records(out)
    expected = [_expected_record(t, k) for t in trajectories for k in range(t.num_turns)]
    expected.append(_expected_record(rerun, 2))  # its turns 0-1 duplicate half's
    assert [(r.tokens, r.loss_mask) for r in records] == expected
    masked = [r for r in records if not any(r.loss_mask)]
    assert {(r.trajectory_id, r.turn) for r in masked} == {("mul#0", 1), ("half#0", 0)}
    assert records[-1].trajectory_id.startswith("half#0~")  # kept apart from the first run's
    assert exported.skipped == {"aborted": 2, "sandbox_error": 2}  # in first and second
    assert exported.duplicates_dropped == 8 + 2
    assert (exported.records, exported.trajectories, exported.renamed_trajectory_ids) == (9, 4, 1)
    assert exported.turns_per_tier == {"valid": 7, "tier1": 1, "tier2": 1}
    assert exported.masked_turns == 2 and exported.masked_share == pytest.approx(2 / 9)
    assert exported.loss_tokens == sum(len(r.loss_mask) for r in records if r.loss_mask[0])
    assert exported.response_tokens == sum(r.response_length for r in records)
    assert exported.tokens_total == sum(len(r.tokens) for r in records)

    jsonl = tmp_path / "sft.jsonl"
    export_records([first, second, other], jsonl)
    assert read_records(jsonl) == records  # parquet and JSONL hold the same records

    # the masking ablation: the same records, the tier-1/2 turns' spans in the loss
    kept = export_records([first], tmp_path / "kept.jsonl", mask_invalid=False)
    assert not kept.mask_invalid and kept.masked_turns == 2
    assert all(all(r.loss_mask) for r in read_records(tmp_path / "kept.jsonl"))
    assert kept.loss_tokens == kept.response_tokens > exported.loss_tokens - 1
    with pytest.raises(SSDInputError, match="written as"):
        export_records([first], tmp_path / "sft.csv")


@pytest.mark.timeout(120)
def test_sample_through_an_sglang_url_and_refuses_what_it_cannot_run(
    factory_tokenizer: Any, factory_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ssd.jsonl"
    refused = CliRunner().invoke(
        ssd_app,
        ["sample", "--policy", "http://127.0.0.1:1", "--tasks", "arithmetic:1", "--out", str(out)],
    )
    assert refused.exit_code == 2 and "--tokenizer" in refused.output
    swe_args = ["--harness", "swe", "--policy", str(factory_dir), "--tasks", "arithmetic:1"]
    wrong_harness = CliRunner().invoke(ssd_app, ["sample", *swe_args, "--out", str(out)])
    assert wrong_harness.exit_code == 2 and "no task family for kind 'tir'" in wrong_harness.output
    assert not out.exists()
    model = build_model("qwen3-tiny", factory_tokenizer, seed=0).eval()
    with serve_in_thread(create_standin(model, context_length=1024)) as url:
        _invoke(
            "sample",
            *("--policy", url, "--tokenizer", str(factory_dir), "--tasks", "arithmetic:1"),
            *("-n", "1", "--max-turns", "1", "--max-new-tokens", "8", "--out", str(out)),
        )
    [trajectory] = read_jsonl(out)
    assert trajectory.status is TrajectoryStatus.TRUNCATED and len(trajectory.turns) == 1


@pytest.mark.timeout(240)
def test_swe_samples_run_in_the_jobs_sandboxes(factory_dir: Path, tmp_path: Path) -> None:
    """`opd ssd sample --harness swe --tasks mini_swe:N`: each trajectory's repository is
    prepared in a sandbox of the job's fleet (here, local), turns are recorded, and the
    export keeps them."""
    out = tmp_path / "swe.jsonl"
    _invoke(
        "sample",
        *("--harness", "swe", "--policy", str(factory_dir), "--tasks", "mini_swe:2"),
        *("-n", "1", "--max-turns", "2", "--max-new-tokens", "8", "--out", str(out)),
    )
    trajectories = read_jsonl(out)
    assert sorted(t.task.kind for t in trajectories) == ["mini_swe", "mini_swe"]
    # each ran its turns in a started sandbox (a failed start is a sandbox_error)
    assert all(t.status is TrajectoryStatus.TRUNCATED and t.num_turns == 2 for t in trajectories)


def test_task_files_need_unique_task_ids(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    task = Task(task_id="t1", kind="tir", prompt="1 + 1?", answer="2")
    path.write_text(task.model_dump_json() + "\n")
    assert load_tasks(str(path)) == [task]
    path.write_text((task.model_dump_json() + "\n") * 2)
    with pytest.raises(SSDInputError, match="appears twice"):
        load_tasks(str(path))
    with pytest.raises(SSDInputError, match="arithmetic:N"):
        load_tasks("arithmetic:zero")
    with pytest.raises(SSDInputError, match="mini_swe:N"):
        load_tasks("mini_swe:-1")
    assert [t.kind for t in load_tasks("mini_swe:2")] == ["mini_swe", "mini_swe"]
