"""The embedded trainer: per-turn batches, the loss it applies, and train -> kill -> resume."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rollout.chat import ChatRenderer, trajectory_from_conversation
from rollout.harness.tir import TIRHarness
from rollout.tasks.arithmetic import make_tasks, trace_messages
from rollout.trajectory import MaskTier, Trajectory, read_jsonl
from slime_ext.local.evaluate import paired_difference
from slime_ext.local.loop import tasks_for_step
from slime_ext.local.trainer import LocalTrainer, TrainerConfig, group_advantages
from slime_ext.losses import (
    masked_nll,
    per_trajectory_mean,
    reverse_kl_pg_loss,
    teacher_topk_kl,
)
from slime_ext.models.factory import build_model
from slime_ext.turns import per_turn_batch
from tests.processes import running

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _traces(factory_tokenizer: Any, count: int) -> list[Trajectory]:
    harness = TIRHarness()
    renderer = ChatRenderer(factory_tokenizer, harness.tools)
    return [
        trajectory_from_conversation(
            renderer,
            task,
            harness.initial_messages(task) + trace_messages(task),
            task.task_id,
            reward=1.0,
        )
        for task in make_tasks(count, "train", seed=3)
    ]


def _direct_span_logprobs(model: Any, trajectories: list[Trajectory]) -> torch.Tensor:
    values = []
    for trajectory in trajectories:
        for k in range(trajectory.num_turns):
            context, span = trajectory.context_ids(k), trajectory.span_ids(k)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([context + span])).logits[0].float()
            rows = torch.log_softmax(logits[len(context) - 1 : -1], dim=-1)
            values.append(rows.gather(-1, torch.tensor(span)[:, None])[:, 0])
    return torch.cat(values)


def test_per_turn_batch_rows_predict_the_span(factory_tokenizer: Any) -> None:
    trajectories = _traces(factory_tokenizer, 3)
    trajectories[1].turns[0].mask_tier = MaskTier.INVALID_ACTION
    batch = per_turn_batch(trajectories, "imitation")
    flat = batch.input_ids.reshape(-1)
    assert torch.equal(flat[batch.span_rows + 1], batch.targets)  # row p predicts p + 1
    span_1_0 = len(trajectories[1].turns[0].span_ids)
    start = sum(len(t.span_ids) for t in trajectories[0].turns)
    assert not batch.loss_mask[start : start + span_1_0].any()  # tier 1: no imitation
    assert per_turn_batch(trajectories, "kl").loss_mask.all()  # KL keeps it by default
    assert batch.trajectory_index.tolist().count(2) == trajectories[2].span_token_count()
    per_turn_cost = sum(
        len(t.context_ids(k)) + len(turn.span_ids)
        for t in trajectories
        for k, turn in enumerate(t.turns)
    )
    assert batch.num_processed_tokens == per_turn_cost


def test_trainer_topk_loss_is_teacher_topk_kl_per_trajectory(factory_tokenizer: Any) -> None:
    trajectories = _traces(factory_tokenizer, 2)
    generator = torch.Generator().manual_seed(0)
    for trajectory in trajectories:
        for turn in trajectory.turns:
            span = len(turn.span_ids)
            turn.teacher_topk_ids = torch.randint(0, 50, (span, 4), generator=generator).tolist()
            turn.teacher_topk_logprobs = (torch.rand(span, 4, generator=generator) - 3).tolist()
    model = build_model("qwen3-tiny", factory_tokenizer, seed=2)
    trainer = LocalTrainer(model, TrainerConfig(opd_loss="topk_tail", chunk_size=5))
    loss, metrics = trainer.loss(trajectories, "opd")
    batch = per_turn_batch(trajectories, "kl")
    rows = []
    for trajectory in trajectories:
        for k in range(trajectory.num_turns):
            context, span = trajectory.context_ids(k), trajectory.span_ids(k)
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([context + span])).logits[0]
            rows.append(logits[len(context) - 1 : -1])
    assert batch.teacher_topk_ids is not None and batch.teacher_topk_logprobs is not None
    per_token = teacher_topk_kl(
        torch.cat(rows),
        batch.teacher_topk_ids,
        batch.teacher_topk_logprobs,
        batch.loss_mask,
        tail=True,
    ).per_token
    expected = per_trajectory_mean(per_token, batch.loss_mask, batch.trajectory_index, 2)
    assert float(loss) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)
    assert "train/teacher_topk_kl" in metrics


@pytest.mark.parametrize("recipe", ["sft", "opd"])
def test_trainer_loss_is_the_loss_module_per_trajectory(
    factory_tokenizer: Any, recipe: str
) -> None:
    trajectories = _traces(factory_tokenizer, 3)
    for trajectory in trajectories:
        for turn in trajectory.turns:
            turn.teacher_logprobs = [-1.5] * len(turn.span_ids)
    model = build_model("qwen3-tiny", factory_tokenizer, seed=2)
    trainer = LocalTrainer(model, TrainerConfig(chunk_size=7))
    loss, _ = trainer.loss(trajectories, recipe)  # type: ignore[arg-type]
    student = _direct_span_logprobs(model, trajectories)
    batch = per_turn_batch(trajectories, "imitation" if recipe == "sft" else "kl")
    per_token = (
        masked_nll(student, batch.loss_mask).per_token
        if recipe == "sft"
        else reverse_kl_pg_loss(student, batch.teacher_logprobs, batch.loss_mask).per_token
    )
    expected = per_trajectory_mean(per_token, batch.loss_mask, batch.trajectory_index, 3)
    assert float(loss) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)


def _groups_of_two(factory_tokenizer: Any) -> list[Trajectory]:
    """Two tasks, each a group of a solved and a failed copy of its trace, teacher-scored."""
    trajectories = []
    for trace in _traces(factory_tokenizer, 2):
        for reward in (1.0, 0.0):
            copy = trace.model_copy(deep=True)
            copy.trajectory_id, copy.reward = f"{trace.task.task_id}#{int(reward)}", reward
            for turn in copy.turns:
                turn.teacher_logprobs = [-1.5] * len(turn.span_ids)
            trajectories.append(copy)
    return trajectories


@pytest.mark.parametrize("opd_loss", ["sampled", "topk_tail"])
def test_opd_plus_reward_is_the_kl_plus_the_weighted_rl_loss(
    factory_tokenizer: Any, opd_loss: str
) -> None:
    """algorithm.reward_weight w: the OPD loss plus w times recipe rl's loss on the same
    trajectories, gradients included."""
    trajectories = _groups_of_two(factory_tokenizer)
    for trajectory in trajectories:
        for turn in trajectory.turns:
            turn.teacher_topk_ids = [[5, 6]] * len(turn.span_ids)
            turn.teacher_topk_logprobs = [[-0.5, -1.5]] * len(turn.span_ids)
    model = build_model("qwen3-tiny", factory_tokenizer, seed=2)

    def loss_and_grad(weight: float, recipe: str) -> tuple[float, torch.Tensor]:
        model.zero_grad()
        config = TrainerConfig(reward_weight=weight, opd_loss=opd_loss)  # type: ignore[arg-type]
        loss, metrics = LocalTrainer(model, config).loss(trajectories, recipe)  # type: ignore[arg-type]
        loss.backward()
        if weight or recipe == "rl":
            assert metrics["train/nonzero_advantage_frac"] == 1.0
        return float(loss), model.get_output_embeddings().weight.grad.clone()

    kl, kl_grad = loss_and_grad(0.0, "opd")
    rl, rl_grad = loss_and_grad(0.0, "rl")
    both, both_grad = loss_and_grad(0.5, "opd")
    assert rl != 0.0
    assert both == pytest.approx(kl + 0.5 * rl, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(both_grad, kl_grad + 0.5 * rl_grad, rtol=1e-4, atol=1e-6)


def test_rl_logs_groups_without_signal(factory_tokenizer: Any) -> None:
    trajectories = _groups_of_two(factory_tokenizer)
    trajectories[2].reward = trajectories[3].reward = 0.0  # the second group all failed
    trainer = LocalTrainer(build_model("qwen3-tiny", factory_tokenizer, seed=2))
    assert trainer.loss(trajectories, "rl")[1]["train/nonzero_advantage_frac"] == 0.5


def test_sft_masks_invalid_turns_unless_the_ablation_keeps_them(factory_tokenizer: Any) -> None:
    trajectories = _traces(factory_tokenizer, 2)
    for trajectory in trajectories:
        for turn in trajectory.turns:  # (the answer turn reads as tier 1 to the parser)
            turn.mask_tier = MaskTier.VALID
    invalid = trajectories[0].turns[0]
    invalid.mask_tier = MaskTier.INVALID_ACTION
    model = build_model("qwen3-tiny", factory_tokenizer, seed=2)
    all_tokens = sum(len(turn.span_ids) for t in trajectories for turn in t.turns)
    masked = LocalTrainer(model).loss(trajectories, "sft")[1]["train/loss_tokens"]
    kept = LocalTrainer(model, TrainerConfig(mask_invalid_turns=False)).loss(trajectories, "sft")
    assert masked == all_tokens - len(invalid.span_ids)
    assert kept[1]["train/loss_tokens"] == all_tokens


def test_sft_lowers_the_nll(factory_tokenizer: Any) -> None:
    trajectories = _traces(factory_tokenizer, 8)
    trainer = LocalTrainer(
        build_model("qwen3-tiny", factory_tokenizer, seed=1), TrainerConfig(lr=3e-3)
    )
    first = trainer.step(trajectories, "sft")["train/nll"]
    for _ in range(5):
        last = trainer.step(trajectories, "sft")["train/nll"]
    assert last < first - 0.5


def test_group_advantages() -> None:
    trajectories = _traces_stub([("a", 1.0), ("a", 0.0), ("b", 1.0), ("c", 0.0)])
    advantages = group_advantages(trajectories)
    assert advantages[0] == pytest.approx(1.0, abs=1e-4)
    assert advantages[1] == pytest.approx(-1.0, abs=1e-4)
    assert advantages[2] == pytest.approx(1.0 - 0.5)  # alone: against the batch mean
    assert advantages[3] == pytest.approx(0.0 - 0.5)


def _traces_stub(rows: list[tuple[str, float]]) -> list[Trajectory]:
    from rollout.trajectory import Task, TrajectoryStatus

    return [
        Trajectory(
            trajectory_id=f"{task}#{i}",
            task=Task(task_id=task, kind="tir", prompt="p"),
            trunk_ids=[1],
            status=TrajectoryStatus.COMPLETED,
            status_reason="r",
            reward=reward,
        )
        for i, (task, reward) in enumerate(rows)
    ]


def test_data_order_is_a_function_of_seed_and_step() -> None:
    tasks = make_tasks(20, "train")
    steps = [tasks_for_step(tasks, step, 4, seed=0) for step in range(10)]
    assert steps == [tasks_for_step(tasks, step, 4, seed=0) for step in range(10)]
    first_epoch = [t.task_id for batch in steps[:5] for t in batch]
    assert sorted(first_epoch) == sorted(t.task_id for t in tasks)  # each once per epoch


def test_paired_difference() -> None:
    mean, low, high = paired_difference([0, 0, 1, 1], [1, 1, 1, 0])
    assert mean == pytest.approx(0.25)
    assert low < mean < high
    with pytest.raises(ValueError, match="same, non-empty"):
        paired_difference([1.0], [])


@pytest.mark.timeout(600)
def test_train_kill_resume_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """Random-init models, a short OPD config: rollout -> teacher -> loss -> update ->
    checkpoint; SIGKILL after the first checkpoint; rerun; every step exactly once."""
    run_dir = tmp_path / "run"
    config = {
        "model": {"student": "factory:qwen3-tiny", "seed": 0},
        "rollout": {
            "max_turns": 2,
            "max_new_tokens": 12,
            "max_context_tokens": 1024,
            "tasks_per_step": 2,
            "samples_per_task": 2,
            "concurrency": 4,
        },
        "teacher": {"kind": "embedded", "model": "factory:qwen3-tiny"},
        "algorithm": {"recipe": "opd", "steps": 4, "lr": 1e-3},
        "logging": {"run_dir": str(run_dir), "wandb_mode": "disabled", "save_every_steps": 1},
    }
    config_path = tmp_path / "job.yaml"
    config_path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "launch.cli", "train", str(config_path)]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    first = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    state = run_dir / "checkpoint" / "trainer.pt"
    deadline = time.monotonic() + 300
    while not (state.is_file() and _checkpoint_step(state) >= 1):
        assert first.poll() is None, first.stderr.read().decode() if first.stderr else ""
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.2)
    teachers = _children(first.pid, "teacher_server")
    assert len(teachers) == 1
    os.kill(first.pid, signal.SIGKILL)  # the trainer alone, mid-run (as an OOM kill would)
    first.wait(timeout=30)
    _gone(teachers[0], timeout_s=30)  # its teacher did not outlive it
    with contextlib.suppress(ProcessLookupError):
        os.killpg(first.pid, signal.SIGKILL)  # whatever else of its group is left
    resumed_from = _checkpoint_step(state)
    second = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=400, check=False
    )
    assert second.returncode == 0, second.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    tasks = make_tasks(4000, "train", seed=0)
    for step in range(4):
        trajectories = list(read_jsonl(run_dir / "trajectories" / f"step_{step:05d}.jsonl"))
        expected = sorted(t.task_id for t in tasks_for_step(tasks, step, 2, seed=0) for _ in "ab")
        assert sorted(t.task.task_id for t in trajectories) == expected
        assert len({t.trajectory_id for t in trajectories}) == 4
        assert all(turn.teacher_logprobs is not None for t in trajectories for turn in t.turns)
    assert resumed_from >= 1 and _checkpoint_step(state) == 4
    assert all("train/loss" in m for m in metrics)
    for m in metrics:
        assert m["perf/processed_tokens_per_loss_token"] == pytest.approx(
            m["train/processed_tokens"] / m["train/loss_tokens"]
        )
        assert m["perf/processed_tokens_per_loss_token"] > 1  # contexts are recomputed
        assert m["perf/effective_tokens_per_gpu_per_sec"] > 0


def _children(pid: int, command: str) -> list[int]:
    found = subprocess.run(
        ["pgrep", "-P", str(pid), "-f", command], capture_output=True, text=True, check=False
    )
    return [int(child) for child in found.stdout.split()]


def _gone(pid: int, timeout_s: float) -> None:
    """Wait for `pid` to end (a zombie waiting for its reaper counts as ended)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not running(pid):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)  # not left behind by the failure
    raise AssertionError(f"process {pid} still runs {timeout_s} s after its parent was killed")


def _checkpoint_step(path: Path) -> int:
    for _ in range(20):
        try:
            return int(torch.load(path, weights_only=False)["step"])
        except (EOFError, RuntimeError, FileNotFoundError):
            time.sleep(0.1)  # being replaced
    raise AssertionError(f"{path} unreadable")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "snapshot",
    [
        {"snapshot": "fixed"},
        {"snapshot": "refresh", "refresh_at": [0.5]},
        {"snapshot": "ema", "ema_sync_every": 1},
    ],
    ids=["fixed", "refresh", "ema"],
)
def test_opsd_trains_against_a_hinted_self_teacher(tmp_path: Path, snapshot: dict) -> None:
    """Recipe opsd: the teacher is the student's initial checkpoint served on 127.0.0.1,
    its contexts carry a reference hint; two steps train and log the hint metrics; refresh
    and ema push the student's (averaged) weights to the service between steps."""
    from slime_ext.job.config import config_from_dict
    from slime_ext.local.run_config import run_local_job

    job = config_from_dict(
        {
            "model": {"student": "factory:qwen3-tiny", "seed": 0},
            "rollout": {"max_turns": 2, "max_new_tokens": 12, "tasks_per_step": 2},
            "teacher": {"kind": "self", **snapshot},
            "algorithm": {"recipe": "opsd", "steps": 2, "lr": 1e-3},
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
        }
    )
    history = run_local_job(job)
    assert len(history) == 2
    for metrics in history:
        assert metrics["rollout/hint_count"] >= 2 and metrics["rollout/hint_leak_refusals"] == 0
        assert metrics["rollout/hint_tokens"] > 0
        assert "rollout/opd_reverse_kl" in metrics
    assert history[0]["train/loss_tokens"] > 0
    pushed = sorted(p.name for p in (tmp_path / "run/teacher_snapshots").glob("step_*"))
    expected = {"fixed": [], "refresh": ["step_00001"], "ema": ["step_00001", "step_00002"]}
    assert pushed == expected[snapshot["snapshot"]]
    if pushed:
        assert history[0]["teacher/snapshot_step"] == 1.0


@pytest.mark.timeout(600)
def test_opsd_with_the_students_own_hint_trains_on_the_local_trainer(tmp_path: Path) -> None:
    """hint: student: after each trajectory the local HF policy (the student being trained)
    writes the hint; every trajectory asks once, and its turns are scored after it."""
    from slime_ext.job.config import config_from_dict
    from slime_ext.local.run_config import run_local_job

    job = config_from_dict(
        {
            "model": {"student": "factory:qwen3-tiny", "seed": 0},
            "rollout": {"max_turns": 2, "max_new_tokens": 12, "tasks_per_step": 2},
            "teacher": {"kind": "self", "hint": "student", "hint_max_new_tokens": 16},
            "algorithm": {"recipe": "opsd", "steps": 1, "lr": 1e-3},
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
        }
    )
    [metrics] = run_local_job(job)
    asked = sum(
        metrics[f"rollout/hint_{key}"] for key in ("count", "leak_refusals", "missing", "errors")
    )
    assert asked == 2 and metrics["rollout/hint_errors"] == 0
    assert metrics["train/trajectories_trained"] == 2 and "rollout/opd_reverse_kl" in metrics


@pytest.mark.timeout(600)
@pytest.mark.parametrize("recipe", ["opd"])  # rl, sft, opsd, oprd: the same loop (see TIR's)
def test_swe_trains_on_the_local_trainer_in_the_jobs_sandboxes(tmp_path: Path, recipe: str) -> None:
    """`opd train` on the SWE config (mini-SWE repositories, local sandboxes through the
    job's fleet): a step trains, its metrics carry the fleet's, trajectories are written,
    and periodic evaluation runs held-out mini-SWE tasks in the same sandboxes."""
    from slime_ext.job.config import load_config
    from slime_ext.local.run_config import run_local_job

    job = load_config(
        Path("launch/configs/swe-local.yaml"),
        [
            f"algorithm.recipe={recipe}",
            "algorithm.steps=1",
            "rollout.tasks_per_step=1",
            "logging.eval_every_steps=1",
            "logging.eval_problems=2",
            f"logging.run_dir={tmp_path / 'run'}",
            "logging.wandb_mode=disabled",
        ],
    )
    [metrics] = run_local_job(job)
    assert metrics["rollout/sandbox_acquired"] >= 2 + 2  # the step's 2 samples, 2 held out
    assert metrics["rollout/sandbox_host_active/here-local"] == 0  # every one given back
    assert metrics["eval/heldout_problems"] == 2.0
    assert metrics["train/trajectories_trained"] == 2
    written = list((tmp_path / "run/trajectories").glob("*.jsonl"))
    lines = [line for path in written for line in path.read_text().splitlines()]
    assert len(lines) == 2 and all('"kind":"mini_swe"' in line.replace(" ", "") for line in lines)
