"""Learning-rate warmup and schedules: the local trainer trains each optimizer step at the
rate Megatron's scheduler gives slime for the flags the plan passes (and torch's own
schedulers give), reports it, and a resumed run continues the schedule."""

from __future__ import annotations

import argparse
import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from launch.plan import train_args
from rollout.chat import ChatRenderer, trajectory_from_conversation
from rollout.harness.tir import TIRHarness
from rollout.tasks.arithmetic import make_tasks, trace_messages
from rollout.trajectory import Trajectory
from slime_ext.job.config import ConfigError, JobConfig, config_from_dict
from slime_ext.local.loop import trainer_config
from slime_ext.local.trainer import LocalTrainer, ScheduledLR, TrainerConfig
from slime_ext.models.factory import build_model
from tests import slime_cpu

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

ROOT = Path(__file__).resolve().parents[1]
LR, MIN_LR, STEPS = 3e-4, 3e-5, 12
SCHEDULES = ("constant", "cosine", "linear")
SETTINGS = [(schedule, warmup) for schedule in SCHEDULES for warmup in (0, 3)]
EXAMPLE = ROOT / "launch/configs/swe-opd-cluster.yaml"


def _cluster_job(schedule: str, warmup: int) -> JobConfig:
    """The example cluster job, 32 tasks x 4 samples a step (--global-batch-size 128)."""
    base: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    base["rollout"]["samples_per_task"] = 4
    base["algorithm"].update(
        steps=STEPS, lr=LR, min_lr=MIN_LR, lr_schedule=schedule, lr_warmup_steps=warmup
    )
    return config_from_dict(base)


def _stand_in_optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def _local_lrs(config: TrainerConfig, steps: int) -> list[float]:
    """The LR of each optimizer step, the trainer's schedule stepped as LocalTrainer.step does."""
    optimizer = _stand_in_optimizer(config.lr)
    schedule = ScheduledLR(optimizer, config)
    lrs = []
    for _ in range(steps):
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        schedule.step()
    return lrs


def _slime_args(argv: list[str]) -> argparse.Namespace:
    """The plan's arguments that size the LR schedule, with Megatron-LM's defaults
    (megatron/training/arguments.py) for those it leaves out."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    for flag, kind, default in [
        ("--lr", float, None), ("--min-lr", float, 0.0), ("--lr-warmup-iters", int, 0),
        ("--lr-warmup-init", float, 0.0), ("--lr-warmup-fraction", float, None),
        ("--lr-decay-iters", int, None), ("--lr-decay-style", str, "linear"),
        ("--weight-decay", float, 0.01), ("--num-rollout", int, None),
        ("--rollout-batch-size", int, None), ("--n-samples-per-prompt", int, 1),
        ("--global-batch-size", int, None),
    ]:  # fmt: skip
        parser.add_argument(flag, type=kind, default=default)
    args, _ = parser.parse_known_args(argv)
    return args


def _megatron_lrs(args: argparse.Namespace) -> list[float]:
    """The LR of each of slime's optimizer steps: Megatron's OptimizerParamScheduler built
    as slime builds it (slime/backends/megatron_utils/model.py, get_optimizer_param_scheduler:
    iterations times --global-batch-size) and stepped by the step's global batch after each
    optimizer step (train_one_step)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    batch = args.global_batch_size
    iterations = args.num_rollout * args.rollout_batch_size * args.n_samples_per_prompt // batch
    decay_iters = iterations if args.lr_decay_iters is None else args.lr_decay_iters
    optimizer = _stand_in_optimizer(args.lr)
    scheduler = OptimizerParamScheduler(
        optimizer,  # type: ignore[arg-type]  # it reads param_groups only
        init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * batch, lr_decay_steps=decay_iters * batch,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=iterations * batch, wd_incr_style="constant",
    )  # fmt: skip
    lrs = []
    for _ in range(iterations):
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        scheduler.step(increment=batch)
    return lrs


@pytest.mark.parametrize(("schedule", "warmup"), SETTINGS)
def test_local_lr_is_megatrons_for_the_flags_the_plan_passes(schedule: str, warmup: int) -> None:
    job = _cluster_job(schedule, warmup)
    args = _slime_args(train_args(job, "hooks.yaml"))
    assert args.global_batch_size == 128  # one optimizer step per rollout
    megatron = _megatron_lrs(args)
    local = _local_lrs(trainer_config(job), STEPS)  # as LocalRun builds it
    assert len(megatron) == STEPS
    assert local == pytest.approx(megatron, rel=1e-12, abs=0.0)
    if warmup:  # from 0 to the peak
        assert local[0] == 0.0 and local[warmup] == LR and local[1] == pytest.approx(LR / warmup)
    if schedule == "constant":
        assert local[warmup:] == [LR] * (STEPS - warmup)
    else:  # the last step trains one step short of min_lr
        assert MIN_LR < local[-1] < local[warmup + 1] < LR


def _torch_lrs(schedule: str, warmup: int) -> list[float]:
    """torch's own schedulers: LinearLR warmup (from 1e-12 of the peak: LinearLR refuses 0)
    then ConstantLR / CosineAnnealingLR / LinearLR decay to MIN_LR at step STEPS."""
    lr_scheduler = torch.optim.lr_scheduler
    optimizer = _stand_in_optimizer(LR)
    decay_steps = STEPS - warmup
    decay: lr_scheduler.LRScheduler = {
        "constant": lambda: lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0),
        "cosine": lambda: lr_scheduler.CosineAnnealingLR(optimizer, decay_steps, MIN_LR),
        "linear": lambda: lr_scheduler.LinearLR(optimizer, 1.0, MIN_LR / LR, decay_steps),
    }[schedule]()
    scheduler = decay
    if warmup:
        ramp = lr_scheduler.LinearLR(optimizer, 1e-12, 1.0, total_iters=warmup)
        scheduler = lr_scheduler.SequentialLR(optimizer, [ramp, decay], milestones=[warmup])
    lrs = []
    for _ in range(STEPS):
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(("schedule", "warmup"), SETTINGS)
def test_local_lr_is_torchs_own_schedulers(schedule: str, warmup: int) -> None:
    config = TrainerConfig(
        lr=LR, lr_schedule=schedule, lr_warmup_steps=warmup, min_lr=MIN_LR, lr_decay_steps=STEPS
    )
    assert _local_lrs(config, STEPS) == pytest.approx(_torch_lrs(schedule, warmup), abs=1e-15)


def test_slimes_own_scheduler_builder_takes_the_plans_flags_as_the_test_does() -> None:
    """The Megatron reference above restates slime's get_optimizer_param_scheduler; slime's
    own, given the plan's flags and Megatron-LM's defaults, builds the same schedule."""
    if not slime_cpu.slime_installed():
        pytest.skip(slime_cpu.HOW_TO_INSTALL)
    slime_cpu.install()
    from slime.backends.megatron_utils.model import get_optimizer_param_scheduler

    job = _cluster_job("cosine", 3)
    args = _slime_args(train_args(job, "hooks.yaml"))
    expected = _megatron_lrs(args)
    args.lr_wsd_decay_iters, args.lr_wsd_decay_style = None, "exponential"
    args.start_weight_decay = args.end_weight_decay = args.weight_decay
    args.weight_decay_incr_style = "constant"
    args.use_checkpoint_opt_param_scheduler = args.override_opt_param_scheduler = False
    optimizer = _stand_in_optimizer(LR)
    scheduler = get_optimizer_param_scheduler(args, optimizer)  # type: ignore[arg-type]
    lrs = []
    for _ in range(STEPS):
        lrs.append(float(optimizer.param_groups[0]["lr"]))
        scheduler.step(increment=args.global_batch_size)
    assert lrs == expected
    assert args.train_iters == args.lr_decay_iters == STEPS


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_plan_passes_the_schedule_as_megatrons_flags(schedule: str) -> None:
    argv = train_args(_cluster_job(schedule, 3), "hooks.yaml")
    pairs = dict(itertools.pairwise(argv))
    assert pairs["--lr-decay-style"] == schedule  # Megatron-LM's own default is linear
    given = (pairs["--lr"], pairs["--min-lr"], pairs["--lr-warmup-iters"])
    assert given == ("0.0003", "3e-05", "3")
    assert pairs.get("--lr-decay-iters") == (None if schedule == "constant" else str(STEPS))


def test_config_refuses_a_floor_above_the_peak_and_a_warmup_past_training() -> None:
    with pytest.raises(ConfigError, match=r"algorithm: min_lr \(0\.01\) is above lr"):
        config_from_dict({"algorithm": {"lr": 1e-3, "min_lr": 1e-2}})
    with pytest.raises(ConfigError, match=r"lr_warmup_steps \(5\) must be below steps \(5\)"):
        config_from_dict({"algorithm": {"steps": 5, "lr_warmup_steps": 5}})
    with pytest.raises(ValueError, match="lr_schedule 'cosine' decays over lr_decay_steps"):
        TrainerConfig(lr_schedule="cosine")
    assert config_from_dict({"algorithm": {"lr": 1e-3, "min_lr": 1e-3}}).algorithm.min_lr == 1e-3


def _traces(tokenizer: Any, count: int) -> list[Trajectory]:
    harness = TIRHarness()
    renderer = ChatRenderer(tokenizer, harness.tools)
    return [
        trajectory_from_conversation(
            renderer, task, harness.initial_messages(task) + trace_messages(task), task.task_id
        )
        for task in make_tasks(count, "train", seed=3)
    ]


def test_trainer_trains_at_and_reports_the_scheduled_lr(factory_tokenizer: Any) -> None:
    """Linear warmup over 2 steps then linear decay: step 0 trains at 0 (the weights stay),
    step 1 at half the peak, and train/lr says so."""
    model = build_model("qwen3-tiny", factory_tokenizer, seed=1)
    config = TrainerConfig(
        lr=1e-3, lr_schedule="linear", lr_warmup_steps=2, min_lr=1e-4, lr_decay_steps=4
    )
    trainer = LocalTrainer(model, config)
    trajectories = _traces(factory_tokenizer, 2)
    before = [p.detach().clone() for p in model.parameters()]
    reported = [trainer.step(trajectories, "sft")["train/lr"]]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    reported += [trainer.step(trajectories, "sft")["train/lr"] for _ in range(3)]
    assert reported == pytest.approx([0.0, 5e-4, 1e-3, 1e-4 + 0.5 * 9e-4], rel=1e-12)
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # a step with nothing to train still moves the schedule on (slime steps every rollout)
    trainer = LocalTrainer(model, config)
    trainer.step(trajectories, "sft")
    trainer.skip()
    assert trainer.step(trajectories, "sft")["train/lr"] == pytest.approx(1e-3, rel=1e-12)


def test_resumed_run_continues_the_schedule(tmp_path: Path) -> None:
    """Save after 3 of 6 cosine steps (2 of warmup), reload: the next step's LR is the one
    the uninterrupted run takes; a checkpoint from before schedules resumes at its step."""
    from slime_ext.local.loop import LocalRun
    from slime_ext.models.refs import resolve_model

    job = JobConfig.model_validate(
        {
            "model": {"student": "factory:qwen3-tiny", "seed": 0},
            "algorithm": dict(
                recipe="sft", steps=6, lr=1e-3, min_lr=1e-4, lr_schedule="cosine", lr_warmup_steps=2
            ),
            "logging": {"run_dir": str(tmp_path / "run"), "wandb_mode": "disabled"},
        }
    )
    student_dir = resolve_model(job.model.student, tmp_path / "models", seed=0)
    run = LocalRun(job, student_dir, tmp_path / "run")
    trajectories = _traces(run.tokenizer, 2)
    for _ in range(3):
        run.trainer.step(trajectories, "sft")
    run.step = 3
    run.save()
    uninterrupted = run.trainer.step(trajectories, "sft")["train/lr"]
    ratio = (3 - 2) / (6 - 2)
    assert uninterrupted == pytest.approx(1e-4 + 0.5 * (math.cos(math.pi * ratio) + 1) * 9e-4)
    resumed = LocalRun(job, student_dir, tmp_path / "run")
    assert resumed.trainer.step(trajectories, "sft")["train/lr"] == uninterrupted
    state_path = tmp_path / "run/checkpoint/trainer.pt"
    state = torch.load(state_path, weights_only=False)
    del state["lr_schedule"]  # as written before LR schedules
    torch.save(state, state_path)
    old = LocalRun(job, student_dir, tmp_path / "run")
    assert old.trainer.step(trajectories, "sft")["train/lr"] == uninterrupted
