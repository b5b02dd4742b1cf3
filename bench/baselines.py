"""Fair baselines: OPD against tuned outcome RL, SFT on traces and SSD, at equal optimizer
steps and at equal compute, on the math TIR task from the bundled student (bench/README.md;
the report it writes: docs/baselines.md).

Every run trains the bundled student for `--steps` steps of 16 trajectories, saves a
checkpoint every `--eval-every` steps and is scored greedily on the held-out TEST set at
each checkpoint (the accuracy-vs-compute curve) and on a VALIDATION set at its end
(validation: held-out problems drawn with another seed, none of them in the test set).
Tuning picks each recipe's setting by validation accuracy; the tables report test.

Recipes (16 trajectories per step for each):
- opd: the bundled teacher's log-probs of the student's sampled tokens (per-turn sampled
  reverse KL, as `opd demo`), 16 tasks x 1 sample;
- rl: REINFORCE on group-normalized outcome advantages, 16/G tasks x G samples;
- opd_rl: OPD plus the outcome advantage (algorithm.reward_weight 1), OPD's tuned lr and
  RL's tuned group size;
- sft: SFT on worked teacher-style traces (the scripted solutions the bundled teacher was
  trained on; no rollouts);
- ssd: simple self-distillation: `opd ssd sample` of the student's own trajectories
  (temperature 1.1, top-k 10, top-p 0.95: the report's spec) once, then SFT on them, tier-1/2
  turns masked.

Compute, per run, by the code's own accounting: student tokens processed by training
(the trainer's train/processed_tokens) plus student tokens sampled (the runner's span
tokens of every trajectory) plus teacher tokens computed (the teacher service's
opd_teacher_tokens_computed_total; scored tokens are also kept). Prefill of the student's
rollout contexts is not counted (the HF policy's cache makes it implementation-defined).

Parts (each resumable: finished runs are kept in --out as results, a killed LocalRun
continues from its newest checkpoint, SSD's sampling from its file; each fits in a
session of 3 hours on 2 cores: tune about 90 minutes, compare about 95, extend about 40,
ablate about 90). Two parts may run at once on one --out: a run (and an SSD sample file)
is trained by one process at a time, the other waits for it and reuses its result; two
processes of compare (or of ablate, or of extend) leave the runs the other has to the end,
so they share the part's runs (each with OMP_NUM_THREADS=1 on 2 cores).
The parts:
    tune     every recipe's grid, seed 0 (RL: 3 lrs x 2 group sizes; others: 3 lrs),
             scored on the test set at the end only
    compare  the tuned settings at every seed and opd_rl, scored every --eval-every steps
             (equal steps; the accuracy-vs-compute curves)
    extend   each non-OPD run trained on until its compute reaches OPD's (equal compute)
    ablate   SSD temperature (0.8, 1.1, 1.4) and SSD without tier-1/2 masking, at SSD's
             tuned lr and at the top of its grid; OPD with think kept in later
             contexts; every seed, scored at the end
    report   tables, paired differences against OPD, the plot (needs no training)

    .venv/bin/python bench/baselines.py tune [--out runs/baselines]
    .venv/bin/python bench/baselines.py compare
    .venv/bin/python bench/baselines.py extend
    .venv/bin/python bench/baselines.py ablate
    .venv/bin/python bench/baselines.py report [--report-dir docs/baselines]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from rollout.trajectory import Task, Trajectory, read_jsonl
from slime_ext.job.config import JobConfig
from slime_ext.local.checkpoints import ResumeOptions
from slime_ext.local.opd_demo import demo_job, heldout_scores

RECIPES = ("opd", "rl", "sft", "ssd")
LRS = {  # math TIR's grids
    "opd": (3e-4, 1e-3, 3e-3),
    "rl": (1e-4, 3e-4, 1e-3),
    "sft": (3e-4, 1e-3, 3e-3),
    "ssd": (1e-4, 3e-4, 1e-3),
}
LADDER = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)
"""Learning rates a grid extends along when its best sits at an edge."""
MAX_EDGE = 2
GROUPS = (4, 8)
"""RL's group sizes (8: slime's and GRPO's usual --n-samples-per-prompt)."""
SSD_SAMPLING = {"temperature": 1.1, "top_k": 10, "top_p": 0.95}
SSD_TEMPERATURES = (0.8, 1.1, 1.4)
SSD_MOVING_LR = max(LRS["ssd"])
"""SSD's ablations run again at this rate, the top of its tuning grid: at its tuned rate
SSD leaves the student where it started, and so does every ablation of it."""
TRAJECTORIES_PER_STEP = 16
SWE_LRS = {
    "opd": (1e-4, 3e-4, 1e-3),  # `opd demo swe` runs 3e-4 (1e-3 fell to 7%, 5e-4 to 23%)
    "rl": (3e-5, 1e-4, 3e-4),
    "sft": (1e-4, 3e-4, 1e-3),
    "ssd": (3e-5, 1e-4, 3e-4),
}
"""SWE's grids: the student is fine-tuned past its own SFT (lr 3e-3), so lower rates."""
TEACHER_SAMPLING = {"temperature": 1.0, "top_k": -1, "top_p": 1.0}
"""SWE's SFT traces: the teacher's own distribution, untruncated; resolved ones kept."""
MAX_TRACE_TASKS = 8
"""Teacher traces: at most this many tasks sampled per resolved trace wanted."""
MAX_EXTEND = 4
"""A run extended for equal compute trains at most this many times --steps."""


@dataclass(frozen=True)
class Arm:
    """One training run's settings."""

    recipe: str
    lr: float
    seed: int = 0
    group: int = 1
    temperature: float = 1.0
    mask_invalid: bool = True
    think: str = "drop"
    reward_weight: float = 0.0
    opd_loss: str = ""
    """OPD's loss where it is not the platform's (the demo config's: topk_tail)."""
    kl_discount: float = 0.0
    """algorithm.kl_discount: each token's signal is the discounted sum of the reverse KL
    of the trajectory's tokens from it on (0: its own token's alone)."""

    @property
    def key(self) -> str:
        parts = [self.recipe, f"lr{self.lr:g}"]
        if self.group != 1:
            parts.append(f"g{self.group}")
        if self.recipe == "ssd":
            parts.append(f"t{self.temperature:g}")
        if not self.mask_invalid:
            parts.append("nomask")
        if self.think != "drop":
            parts.append(f"think-{self.think}")
        if self.reward_weight:
            parts.append(f"rw{self.reward_weight:g}")
        if self.opd_loss:
            parts.append(self.opd_loss)
        if self.kl_discount:
            parts.append(f"kd{self.kl_discount:g}")
        return "-".join(parts) + f"-s{self.seed}"

    @property
    def setting(self) -> str:
        """The key without the seed: what tuning compares."""
        return self.key.rsplit("-s", 1)[0]


@dataclass
class Scale:
    steps: int = 12
    eval_every: int = 4
    n_test: int = 200
    n_val: int = 100
    seeds: int = 3


@dataclass(frozen=True)
class Platform:
    """What the math TIR bench and the SWE bench differ in; the procedure is one code."""

    harness: str
    scale: Scale
    """The default scale (each field can be set on the command line)."""
    lrs: Mapping[str, tuple[float, ...]]
    trajectories_per_step: int
    unit: str
    sft_traces: str
    """worked: the scripted solutions the bundled teacher was trained on (free to make);
    teacher: the bundled teacher's own resolved trajectories, sampled at T=1, their
    generation counted as teacher compute."""
    ssd_temperatures: tuple[float, ...]
    """SSD's temperature ablation (one value: no such ablation)."""
    think_ablation: bool
    """OPD with think kept against dropped (only where the student thinks)."""
    kl_discounts: tuple[float, ...]
    """OPD's algorithm.kl_discount arms beside 0 (empty: no such ablation)."""

    @property
    def ssd_moving_lr(self) -> float:
        return max(self.lrs["ssd"])


PLATFORMS = {
    "tir": Platform(
        harness="tir",
        scale=Scale(),
        lrs=LRS,
        trajectories_per_step=TRAJECTORIES_PER_STEP,
        unit="problems",
        sft_traces="worked",
        ssd_temperatures=SSD_TEMPERATURES,
        think_ablation=True,
        kl_discounts=(),
    ),
    "swe": Platform(
        harness="swe",
        scale=Scale(steps=16, eval_every=8, n_test=100, n_val=100, seeds=3),
        lrs=SWE_LRS,
        trajectories_per_step=8,  # `opd demo swe`'s 8 tasks per step
        unit="tasks",
        sft_traces="teacher",
        ssd_temperatures=(SSD_SAMPLING["temperature"],),
        think_ablation=False,  # the bundled SWE models write no think
        kl_discounts=(0.9, 0.99),
    ),
}


@dataclass
class Result:
    arm: Arm
    steps: int
    """Steps trained (--steps, or more when extended for equal compute)."""
    test: dict[int, float]
    """Test accuracy at each evaluated step (0: the start)."""
    test_scores: dict[int, list[float]]
    """Per-problem test scores at each evaluated step."""
    validation: float
    """Validation accuracy at --steps."""
    compute: list[dict[str, float]] = field(default_factory=list)
    """Per step: student_train, student_sampled, teacher_computed, teacher_scored tokens."""
    wall_s: float = 0.0
    notes: dict[str, float] = field(default_factory=dict)
    """Run statistics (mean reward of the rollouts, share of RL trajectories with a
    non-zero advantage, ...)."""

    def compute_at(self, step: int) -> float:
        return sum(total(c) for c in self.compute[:step])


def total(step: dict[str, float]) -> float:
    return step["student_train"] + step["student_sampled"] + step["teacher_computed"]


# -- the data ----------------------------------------------------------------------------


SWE_VALIDATION_SEED = -2
"""mini-SWE's validation tasks: a seed no training or test draw uses (test: -1, the
held-out split `opd demo swe` scores; training: the run's seed, >= 0)."""


def test_tasks(scale: Scale, harness: str = "tir") -> list[Task]:
    """The held-out split `opd demo` (`opd demo swe`) scores."""
    from slime_ext.local.evaluate import heldout_tasks

    return heldout_tasks(scale.n_test, harness)


def validation_tasks(scale: Scale, harness: str = "tir") -> list[Task]:
    """Held-out problems drawn with another seed, none with a test problem's statement."""
    from slime_ext.local.evaluate import tasks_apart_from_test

    seed = SWE_VALIDATION_SEED if harness == "swe" else 2
    return tasks_apart_from_test(harness, scale.n_val, seed, scale.n_test)


def train_tasks(harness: str, seed: int, count: int | None = None) -> list[Task]:
    """A run's training problems in order (`opd demo`'s pool, drawn with the run's seed);
    `count`: the first that many (imitation trains on them in order)."""
    from rollout.tasks import mini_swe
    from rollout.tasks.arithmetic import make_tasks
    from slime_ext.local.opd_demo import SWE_TRAIN_TASKS

    if harness == "swe":
        return mini_swe.generate_tasks(count or SWE_TRAIN_TASKS, seed=seed)
    return make_tasks(count or 4000, "train", seed=seed)


# -- one run -----------------------------------------------------------------------------


def run_dir_of(out: Path, arm: Arm) -> Path:
    return out / "runs" / arm.key


def load_result(out: Path, arm: Arm) -> Result | None:
    path = run_dir_of(out, arm) / "result.json"
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return Result(
        arm=Arm(**data["arm"]),
        steps=data["steps"],
        test={int(k): v for k, v in data["test"].items()},
        test_scores={int(k): v for k, v in data["test_scores"].items()},
        validation=data["validation"],
        compute=data["compute"],
        wall_s=data["wall_s"],
        notes=data.get("notes", {}),
    )


def save_result(out: Path, result: Result) -> None:
    path = run_dir_of(out, result.arm) / "result.json"
    data = asdict(result)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


class Compute:
    """Per-step token counts of a run, appended as each step ends (a resumed run's redone
    steps replace theirs)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: dict[int, dict[str, float]] = {}
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.steps[int(row.pop("step"))] = row

    def add(self, step: int, row: dict[str, float]) -> None:
        self.steps[step] = row
        with self.path.open("a") as handle:
            handle.write(json.dumps({"step": step, **row}) + "\n")

    def rows(self, steps: int) -> list[dict[str, float]]:
        missing = [s for s in range(steps) if s not in self.steps]
        if missing:
            raise RuntimeError(f"{self.path}: no token counts for steps {missing}")
        return [self.steps[s] for s in range(steps)]


def teacher_counters(url: str) -> tuple[float, float]:
    """(tokens scored, tokens computed) so far, from the teacher service's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return (
        float(values["opd_teacher_tokens_scored_total"]),
        float(values["opd_teacher_tokens_computed_total"]),
    )


def sampled_tokens(metrics: dict[str, float], trajectories: int) -> float:
    """Span tokens of every trajectory of a step (the runner's per-turn means, undone)."""
    return metrics["rollout/tokens_per_turn"] * metrics["rollout/num_turns"] * trajectories


def run_job(arm: Arm, steps: int, run_dir: Path, platform: Platform) -> JobConfig:
    """The arm's job: `opd demo`'s config (the platform's harness) with the arm's settings,
    validated as `opd train` validates a config."""
    from slime_ext.job.config import JobConfig

    job = demo_job(run_dir, steps, seed=arm.seed, harness=platform.harness)
    data = job.model_dump(mode="json")
    data["algorithm"].update(
        recipe="rl" if arm.recipe == "rl" else "opd",
        lr=arm.lr,
        reward_weight=arm.reward_weight,
        kl_discount=arm.kl_discount,
    )
    if arm.opd_loss:
        data["algorithm"]["opd_loss"] = arm.opd_loss
    data["rollout"].update(
        samples_per_task=arm.group,
        tasks_per_step=platform.trajectories_per_step // arm.group,
        think_policy=arm.think,
    )
    data["logging"].update(wandb_mode="disabled", keep_checkpoints=10_000)
    return JobConfig.model_validate(data)


def train_local_run(
    arm: Arm, steps: int, run_dir: Path, student: Path, teacher: Path, platform: Platform
) -> None:
    """opd, rl, opd_rl: the local trainer's loop (`opd train`), resumed where it stopped."""
    from slime_ext.local.loop import LocalRun, embedded_teacher

    job = run_job(arm, steps, run_dir, platform)
    tasks = train_tasks(platform.harness, arm.seed)
    compute = Compute(run_dir / "compute.jsonl")
    resume = ResumeOptions(allow_changed=("algorithm.steps", "logging.save_every_steps"))
    job.logging.save_every_steps = 1  # every step (13 MB): a killed run loses none
    run = LocalRun(job, student, run_dir, resume=resume)
    if run.step >= steps:
        return
    per_step = platform.trajectories_per_step

    def account(url: str | None) -> Callable[[int, dict[str, float]], None]:
        last = [0.0, 0.0]

        def on_step(step: int, metrics: dict[str, float]) -> None:
            if not metrics.get("train/trajectories_trained"):
                aborts = {k: v for k, v in metrics.items() if k.startswith("rollout/abort")}
                raise RuntimeError(
                    f"{run_dir}: step {step} trained no trajectory ({aborts}); the numbers "
                    "would be meaningless: fix the cause, delete the run directory, rerun"
                )
            scored = computed = 0.0
            if url is not None:
                now = teacher_counters(url)
                scored, computed = now[0] - last[0], now[1] - last[1]
                last[:] = now
            row = {
                "student_train": metrics.get("train/processed_tokens", 0.0),
                "student_sampled": sampled_tokens(metrics, per_step),
                "teacher_scored": scored,
                "teacher_computed": computed,
                "reward": metrics.get("rollout/reward", 0.0),
                "nonzero_advantage_frac": metrics.get("train/nonzero_advantage_frac", math.nan),
            }
            compute.add(step, row)

        return on_step

    if job.algorithm.recipe == "rl":
        asyncio.run(run.train(tasks, None, on_step=account(None)))
    else:
        with embedded_teacher(teacher, run_dir / "teacher.log") as url:
            asyncio.run(run.train(tasks, url, on_step=account(url)))


def imitation_data(
    arm: Arm, count: int, samples: Path, student: Path, teacher: Path, platform: Platform
) -> tuple[list[Trajectory], list[float]]:
    """The trajectories an sft / ssd run trains on, in training-task order (never by
    finishing time), and the teacher tokens each one cost to make:
    - sft on math: worked traces (the scripts the bundled teacher was trained on; free);
    - sft on SWE: the bundled teacher's own resolved trajectories (`teacher_traces`);
    - ssd: the student's own samples by `opd ssd sample` (resumed from its file)."""
    from rollout.chat import ChatRenderer
    from slime_ext.local.demo_models import trace_trajectories
    from slime_ext.local.loop import tir_harness

    if arm.recipe == "sft" and platform.sft_traces == "worked":
        from transformers import AutoTokenizer

        harness = tir_harness()
        renderer = ChatRenderer(AutoTokenizer.from_pretrained(student), harness.tools)
        return trace_trajectories(renderer, harness, count, arm.seed), [0.0] * count
    if arm.recipe == "sft":
        with exclusive(samples):
            return teacher_traces(arm.seed, count, samples, teacher, platform)
    with exclusive(samples):
        sampling = {**SSD_SAMPLING, "temperature": arm.temperature}
        sample(student, count, sampling, arm.seed, samples, platform)
    trajectories = in_task_order(read_jsonl(samples), platform.harness, arm.seed, count)
    return trajectories, [0.0] * len(trajectories)


def in_task_order(
    trajectories: Iterable[Trajectory], harness: str, seed: int, count: int
) -> list[Trajectory]:
    """The trajectories of the first `count` training tasks, in task order."""
    order = {task.task_id: i for i, task in enumerate(train_tasks(harness, seed, count))}
    kept = [t for t in trajectories if t.task.task_id in order]
    return sorted(kept, key=lambda t: order[t.task.task_id])


def teacher_traces(
    seed: int, count: int, samples: Path, teacher: Path, platform: Platform
) -> tuple[list[Trajectory], list[float]]:
    """`count` resolved trajectories of the teacher on the training tasks, in task order,
    and what each cost: the teacher's generated tokens of every attempt since the one
    before it (failed attempts included). Sampled into `samples` in chunks sized by the
    yield so far, resumed from the file (its draws depend on the chunks asked, as a
    resumed `opd ssd sample` does: a file grown another way holds other samples)."""
    tasks = count
    while True:
        sample(teacher, tasks, TEACHER_SAMPLING, seed, samples, platform)
        attempts = in_task_order(read_jsonl(samples), platform.harness, seed, tasks)
        resolved = [t for t in attempts if (t.reward or 0.0) > 0]
        if len(resolved) >= count:
            break
        cap = MAX_TRACE_TASKS * count
        if tasks >= cap:
            raise RuntimeError(
                f"{samples}: the teacher resolved {len(resolved)} of {tasks} tasks, short of "
                f"the {count} traces wanted within {cap} tasks"
            )
        rate = max(len(resolved), 1) / tasks
        tasks = min(math.ceil(1.1 * count / rate) + 1, cap)
    kept, costs, spent = [], [], 0.0
    for trajectory in attempts:
        spent += sum(len(turn.span_ids) for turn in trajectory.turns)
        if (trajectory.reward or 0.0) > 0:
            kept.append(trajectory)
            costs.append(spent)
            spent = 0.0
            if len(kept) == count:
                break
    return kept, costs


def sample(
    policy: Path,
    count: int,
    sampling: dict[str, float],
    seed: int,
    samples: Path,
    platform: Platform,
) -> None:
    """`opd ssd sample` of `policy` on the first `count` training problems into `samples`
    (resumes the file), within the platform's rollout limits."""
    job = demo_job(Path("unused"), 1, harness=platform.harness)
    rollout = job.rollout
    tasks = f"mini_swe:{count}" if platform.harness == "swe" else f"arithmetic:{count}"
    command = [
        sys.executable, "-m", "launch.cli", "ssd", "sample",
        "--policy", str(policy), "--tasks", tasks, "--harness", platform.harness,
        "--temperature", str(sampling["temperature"]), "--top-k", str(int(sampling["top_k"])),
        "--top-p", str(sampling["top_p"]), "-n", "1",
        "--seed", str(seed), "--out", str(samples),
    ]  # fmt: skip
    if platform.harness == "swe":  # the SWE demo's limits (math: the demo's are the eval's)
        command += [
            "--max-turns", str(rollout.max_turns),
            "--max-new-tokens", str(rollout.max_new_tokens),
            "--max-context-tokens", str(rollout.max_context_tokens),
            "--concurrency", str(rollout.concurrency),
            "--trajectory-timeout-s", str(rollout.trajectory_timeout_s),
            "--command-timeout-s", str(job.sandbox.command_timeout_s),
        ]  # fmt: skip
    else:
        command += ["--max-turns", "4", "--max-new-tokens", "64", "--max-context-tokens", "1024"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"opd ssd sample failed:\n{done.stdout}\n{done.stderr}")


def train_imitation(
    arm: Arm,
    steps: int,
    run_dir: Path,
    models: tuple[Path, Path],
    eval_every: int,
    samples: Path,
    platform: Platform,
) -> None:
    """sft / ssd: SFT steps of the platform's trajectories per step (tier-1/2 turns masked
    unless the arm says not), a checkpoint at every evaluation step. A killed run redoes
    its steps (seconds)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slime_ext.local.trainer import LocalTrainer, TrainerConfig

    if ckpt_dir(run_dir, steps).is_dir():
        return
    student, teacher = models
    per_step = platform.trajectories_per_step
    data, costs = imitation_data(arm, steps * per_step, samples, student, teacher, platform)
    if len(data) != steps * per_step:
        raise RuntimeError(f"{samples}: {len(data)} trajectories, wanted {steps * per_step}")
    tokenizer = AutoTokenizer.from_pretrained(student)
    model = AutoModelForCausalLM.from_pretrained(student)
    config = TrainerConfig(lr=arm.lr, grad_clip=1.0, mask_invalid_turns=arm.mask_invalid)
    trainer = LocalTrainer(model, config)  # NLL at temperature 1: the model's own distribution
    compute = Compute(run_dir / "compute.jsonl")
    sampled = arm.recipe == "ssd"
    for step in range(steps):
        batch = data[step * per_step : (step + 1) * per_step]
        metrics = trainer.step(batch, "sft")
        span = sum(len(turn.span_ids) for t in batch for turn in t.turns) if sampled else 0
        compute.add(
            step,
            {
                "student_train": metrics["train/processed_tokens"],
                "student_sampled": float(span),
                "teacher_scored": 0.0,
                "teacher_computed": sum(costs[step * per_step : (step + 1) * per_step]),
                "reward": statistics.fmean(t.reward or 0.0 for t in batch) if sampled else 1.0,
                "nonzero_advantage_frac": math.nan,
            },
        )
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            model.save_pretrained(ckpt_dir(run_dir, step + 1))
            tokenizer.save_pretrained(ckpt_dir(run_dir, step + 1))


_HELD: set[Path] = set()


@contextlib.contextmanager
def exclusive(path: Path, log: Callable[[str], None] = print, wait: bool = True) -> Iterator[bool]:
    """Hold `path`.lock against other processes (two bench parts on one --out); says so
    when it has to wait. With `wait` False, a lock another process holds is not waited
    for: yields False (and holds nothing). Reentrant within a process; the lock goes with
    the process, killed or not."""
    lock = path.with_name(path.name + ".lock").resolve()
    if lock in _HELD:
        yield True
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            log(f"{path.name}: another bench process holds it, waiting")
            fcntl.flock(handle, fcntl.LOCK_EX)
        _HELD.add(lock)
        try:
            yield True
        finally:
            _HELD.discard(lock)
            fcntl.flock(handle, fcntl.LOCK_UN)


def ckpt_dir(run_dir: Path, step: int) -> Path:
    """A step's model: the local loop's checkpoint, or an imitation run's save."""
    return run_dir / "checkpoints" / f"step_{step:05d}"


def eval_steps(steps: int, eval_every: int) -> list[int]:
    return sorted({s for s in range(eval_every, steps + 1, eval_every)} | {steps})


class Bench:
    def __init__(
        self,
        out: Path,
        scale: Scale,
        log: Callable[[str], None] = print,
        harness: str = "tir",
    ) -> None:
        from slime_ext.models.refs import bundled_models

        self.out, self.scale, self.log = out, scale, log
        self.platform = PLATFORMS[harness]
        self.student, self.teacher = bundled_models(harness)
        self.test = test_tasks(scale, harness)
        self.validation = validation_tasks(scale, harness)
        out.mkdir(parents=True, exist_ok=True)
        self._check_scale()

    def _check_scale(self) -> None:
        """One --out holds one scale of one harness: mixing would compare runs of other
        lengths or tasks."""
        path = self.out / "scale.json"
        wanted: dict[str, object] = {k: v for k, v in asdict(self.scale).items() if k != "seeds"}
        if self.platform.harness != "tir":  # math's kept scale.json predates the harness
            wanted["harness"] = self.platform.harness
        if path.is_file():
            found = json.loads(path.read_text())
            if found != wanted:
                raise SystemExit(
                    f"{self.out} holds runs at {found}, not {wanted}: use another --out"
                )
        else:
            path.write_text(json.dumps(wanted))

    def start_scores(self, split: str = "test") -> list[float]:
        """The untrained student's scores on the test (or validation) set."""
        path = self.out / ("start.json" if split == "test" else f"start-{split}.json")
        if path.is_file():
            return list(json.loads(path.read_text()))
        tasks = self.test if split == "test" else self.validation
        scores = self.scores(self.student, tasks)
        path.write_text(json.dumps(scores))
        return scores

    def scores(self, model_dir: Path, tasks: list[Task]) -> list[float]:
        """1.0 per task `model_dir` solves greedily (`opd demo`'s scoring of the harness:
        SWE in the demo's sandboxes and rollout limits), 0.0 per other."""
        job = None
        if self.platform.harness != "tir":
            job = demo_job(self.out / "eval", 1, harness=self.platform.harness)
        return asyncio.run(heldout_scores(model_dir, tasks, job))

    def run(self, arm: Arm, steps: int | None = None, curve: bool = True) -> Result:
        """The arm trained to `steps` (default --steps) and scored on the test set at every
        evaluation step (`curve`) or at `steps` only (tuning); kept results and scores are
        reused, a shorter finished run is extended, a missing score is filled in. One
        process at a time per run: another waits, then reuses what it finds."""
        with exclusive(run_dir_of(self.out, arm), self.log):
            return self._run(arm, steps, curve)

    def _run(self, arm: Arm, steps: int | None, curve: bool) -> Result:
        steps = steps or self.scale.steps
        every = self.scale.eval_every
        base = min(steps, self.scale.steps)  # past --steps (equal compute): the end only
        wanted = sorted({*(eval_steps(base, every) if curve else []), base, steps})
        found = load_result(self.out, arm)
        if found is not None and found.steps >= steps:
            if all(s in found.test_scores for s in wanted):
                return found
            steps = found.steps  # only scores to fill in
        run_dir = run_dir_of(self.out, arm)
        run_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        if found is None or found.steps < steps:
            self.log(f"{arm.key}: training {steps} steps")
        compute = self.train(arm, steps)
        test_scores = dict(found.test_scores) if found else {0: self.start_scores()}
        for step in sorted({*wanted, steps}):
            if step not in test_scores:
                self.log(f"{arm.key}: scoring step {step} on {len(self.test)} test problems")
                test_scores[step] = self.scores(ckpt_dir(run_dir, step), self.test)
        test = {step: statistics.fmean(scores) for step, scores in sorted(test_scores.items())}
        if found is not None:
            validation = found.validation
        else:
            checkpoint = ckpt_dir(run_dir, self.scale.steps)
            validation = statistics.fmean(self.scores(checkpoint, self.validation))
        wall = (found.wall_s if found else 0.0) + time.perf_counter() - started
        result = Result(arm, steps, test, test_scores, validation, compute, wall, {})
        result.notes = {
            "reward_mean": statistics.fmean(c["reward"] for c in compute),
            "nonzero_advantage_frac": _nanmean(c["nonzero_advantage_frac"] for c in compute),
        }
        save_result(self.out, result)
        self._trim(run_dir, steps)
        self.log(
            f"{arm.key}: test {test[self.scale.steps]:.1%} at step {self.scale.steps} "
            f"(validation {validation:.1%}), {result.compute_at(steps):,.0f} tokens, "
            f"{wall:.0f} s"
        )
        return result

    def train(self, arm: Arm, steps: int) -> list[dict[str, float]]:
        """Train the arm to `steps` (nothing to do where it got there before); its per-step
        token counts. The caller holds the run's lock (`run`, `extend`)."""
        run_dir = run_dir_of(self.out, arm)
        run_dir.mkdir(parents=True, exist_ok=True)
        models = (self.student, self.teacher)
        if arm.recipe in ("sft", "ssd"):
            samples = self.out / "ssd-samples" / f"t{arm.temperature:g}-s{arm.seed}.jsonl"
            if arm.recipe == "sft":  # SWE: the teacher's traces (math: worked, no file)
                samples = self.out / "teacher-traces" / f"s{arm.seed}.jsonl"
            every = self.scale.eval_every
            train_imitation(arm, steps, run_dir, models, every, samples, self.platform)
        else:
            train_local_run(arm, steps, run_dir, *models, self.platform)
        return Compute(run_dir / "compute.jsonl").rows(steps)

    def _trim(self, run_dir: Path, steps: int) -> None:
        """Keep the checkpoints of the evaluation steps (a score left out in tuning is
        filled in later) and the last (an extension resumes from it)."""
        keep = {*eval_steps(steps, self.scale.eval_every), steps}
        for path in (run_dir / "checkpoints").glob("step_*"):
            if int(path.name.split("_")[1]) not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # -- parts ----------------------------------------------------------------------------

    def _arms(self, recipe: str, lrs: Iterable[float]) -> list[Arm]:
        if recipe == "rl":
            return [Arm("rl", lr, group=g) for lr in lrs for g in GROUPS]
        if recipe == "ssd":
            return [Arm("ssd", lr, temperature=SSD_SAMPLING["temperature"]) for lr in lrs]
        return [Arm(recipe, lr) for lr in lrs]

    def grid(self, recipe: str) -> list[Arm]:
        """The recipe's tuning runs: its 3 lrs, and where the best of them (by validation)
        sits at the grid's edge, the next lr of LADDER beyond it (at most MAX_EDGE times):
        a best setting at the edge says the optimum may lie outside."""
        grid = self.platform.lrs[recipe]
        lrs = sorted(grid)
        while True:
            arms = self._arms(recipe, lrs)
            results = [load_result(self.out, arm) for arm in arms]
            if any(r is None for r in results) or len(lrs) == len(grid) + MAX_EDGE:
                return arms
            best = max((r for r in results if r), key=lambda r: (r.validation, -r.arm.lr))
            rung = LADDER.index(best.arm.lr)
            if best.arm.lr == lrs[0] and rung > 0:
                lrs.insert(0, LADDER[rung - 1])
            elif best.arm.lr == lrs[-1] and rung + 1 < len(LADDER):
                lrs.append(LADDER[rung + 1])
            else:
                return arms

    def tune(self, recipes: Iterable[str] = RECIPES) -> None:
        recipes = list(recipes)
        if unknown := set(recipes) - set(RECIPES):
            raise SystemExit(f"tune: no such recipe {sorted(unknown)}; one of {list(RECIPES)}")
        for recipe in recipes:
            while missing := [a for a in self.grid(recipe) if not load_result(self.out, a)]:
                for arm in missing:
                    self.run(arm, curve=False)

    def tuned(self, recipe: str) -> Arm:
        """The recipe's setting with the best validation accuracy at seed 0 (ties: the
        lower lr)."""
        results = [load_result(self.out, arm) for arm in self.grid(recipe)]
        done = [r for r in results if r is not None]
        if len(done) < len(results):
            raise SystemExit(f"tuning {recipe} is not finished: run the tune part first")
        return max(done, key=lambda r: (r.validation, -r.arm.lr)).arm

    def compare_arms(self) -> dict[str, list[Arm]]:
        seeds = range(self.scale.seeds)
        arms = {r: [replace(self.tuned(r), seed=s) for s in seeds] for r in RECIPES}
        opd, rl = self.tuned("opd"), self.tuned("rl")
        arms["opd_rl"] = [
            replace(opd, group=rl.group, reward_weight=1.0, seed=s) for s in range(self.scale.seeds)
        ]
        return arms

    def run_all(self, arms: Iterable[Arm], curve: bool = True) -> None:
        """Each arm run (`run`) in order, but one that another bench process is running
        now is left to the end, then waited for and reused: two processes of one part on
        one --out share its runs instead of queueing behind each other."""
        self.each_shared(arms, lambda arm: self._run(arm, None, curve), "running")

    def each_shared(self, arms: Iterable[Arm], work: Callable[[Arm], object], doing: str) -> None:
        """`work(arm)` for each arm, holding its run's lock; an arm another bench process
        holds now is left to the end, then waited for (`work` reuses what it finds)."""
        later = []
        for arm in arms:
            with exclusive(run_dir_of(self.out, arm), self.log, wait=False) as mine:
                if mine:
                    work(arm)
                else:
                    self.log(f"{arm.key}: another bench process is {doing} it, left to the end")
                    later.append(arm)
        for arm in later:
            with exclusive(run_dir_of(self.out, arm), self.log):
                work(arm)

    def compare(self) -> None:
        """Equal steps: the tuned settings at every seed, scored along the way."""
        arms = self.compare_arms()
        seeds = range(self.scale.seeds)  # seed-major: each seed's arms pair up early
        self.run_all(group[seed] for seed in seeds for group in arms.values())

    def extend(self, recipes: Iterable[str] | None = None) -> None:
        """Equal compute: each non-OPD run (of `recipes`, default all) trained on until its
        compute reaches OPD's mean at --steps (at most MAX_EXTEND x --steps), scored where
        it gets there."""
        arms = self.compare_arms()
        wanted = set(arms) - {"opd"} if recipes is None else set(recipes)
        if unknown := wanted - set(arms) | wanted & {"opd"}:
            raise SystemExit(f"extend: no such baseline {sorted(unknown)}; one of {list(arms)[1:]}")
        budget, cap = self.budget(), MAX_EXTEND * self.scale.steps
        chosen = (arm for recipe, group in arms.items() if recipe in wanted for arm in group)
        self.each_shared(chosen, lambda arm: self._extend(arm, budget, cap), "extending")

    def _extend(self, arm: Arm, budget: float, cap: int) -> None:
        result = self.run(arm)
        steps, rows = result.steps, result.compute
        spent = sum(map(total, rows))
        while spent < budget and steps < cap:  # trained, not scored
            steps = min(max(steps + 1, math.ceil(budget / (spent / steps))), cap)
            self.log(f"{arm.key}: {spent:,.0f} tokens of {budget:,.0f}")
            spent = sum(map(total, self.train(arm, steps)))
        self.run(arm, steps)  # scored where it got there

    def budget(self) -> float:
        """OPD's mean compute at --steps: the equal-compute budget."""
        runs = [load_result(self.out, arm) for arm in self.compare_arms()["opd"]]
        if any(r is None for r in runs):
            raise SystemExit("OPD's runs at every seed come first: run the compare part")
        return statistics.fmean(r.compute_at(self.scale.steps) for r in runs if r is not None)

    def ablation_blocks(self) -> list[dict[str, list[Arm]]]:
        """The ablations, in blocks: each block's first arm is the one the others are
        paired with. SSD's blocks run at its tuned lr and again at the top of its tuning
        grid (the platform's ssd_moving_lr), a rate at which its training changes the
        student: its temperatures (where the platform has several) and tier-1/2 masking.
        Then OPD's think kept against dropped (where the student thinks), and OPD's
        kl_discount arms (the sampled reverse KL, the loss kl_discount needs, at 0 first)."""
        platform = self.platform
        ssd, opd = self.tuned("ssd"), self.tuned("opd")
        seeds = range(self.scale.seeds)
        blocks = []
        for lr in dict.fromkeys([ssd.lr, platform.ssd_moving_lr]):
            at = replace(ssd, lr=lr)
            tag = "" if lr == ssd.lr else f", lr {lr:g}"
            if len(platform.ssd_temperatures) > 1:
                temperatures = sorted(platform.ssd_temperatures, key=lambda t: t != at.temperature)
                blocks.append(
                    {
                        f"ssd T={t:g}{tag}": [replace(at, temperature=t, seed=s) for s in seeds]
                        for t in temperatures  # the report's T=1.1 first
                    }
                )
            blocks.append(
                {
                    f"ssd, tier-1/2 masked{tag}": [replace(at, seed=s) for s in seeds],
                    f"ssd, tier-1/2 trained{tag}": [
                        replace(at, mask_invalid=False, seed=s) for s in seeds
                    ],
                }
            )
        if platform.think_ablation:
            blocks.append(
                {
                    "opd, think dropped": [replace(opd, seed=s) for s in seeds],
                    "opd, think kept": [replace(opd, think="keep", seed=s) for s in seeds],
                }
            )
        if platform.kl_discounts:
            sampled = replace(opd, opd_loss="sampled")
            blocks.append(
                {
                    f"opd sampled, kl_discount {gamma:g}": [
                        replace(sampled, kl_discount=gamma, seed=s) for s in seeds
                    ]
                    for gamma in (0.0, *platform.kl_discounts)
                }
            )
        return blocks

    def ablate(self) -> None:
        blocks = self.ablation_blocks()
        seeds = range(self.scale.seeds)
        self.run_all(
            (group[seed] for seed in seeds for block in blocks for group in block.values()),
            curve=False,
        )


def _nanmean(values: Iterable[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.fmean(kept) if kept else math.nan


# -- statistics ----------------------------------------------------------------------------


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and the 95% Student-t interval over runs (seeds)."""
    from scipy.stats import t

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = float(t.ppf(0.975, len(values) - 1)) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def at_compute(result: Result, budget: float) -> float:
    """Test accuracy at `budget` tokens: linear between the evaluated steps' (compute,
    accuracy) points; a run that never reached the budget gives NaN."""
    points = sorted((result.compute_at(step), acc) for step, acc in result.test.items())
    for (c0, a0), (c1, a1) in itertools.pairwise(points):
        if c0 <= budget <= c1:
            return a0 + (a1 - a0) * (budget - c0) / max(c1 - c0, 1e-9)
    return math.nan


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["tune", "compare", "extend", "ablate", "report", "all"])
    parser.add_argument(
        "--harness",
        choices=sorted(PLATFORMS),
        default="tir",
        help="tir: math with a python tool; swe: mini-SWE repositories in local sandboxes",
    )
    parser.add_argument(
        "--out", type=Path, help="default: runs/baselines (swe: runs/baselines-swe)"
    )
    parser.add_argument(
        "--report-dir", type=Path, help="default: docs/baselines (swe: docs/baselines-swe)"
    )
    parser.add_argument(
        "--recipes",
        help="tune (default: opd,rl,sft,ssd) and extend (default: rl,sft,ssd,opd_rl): these "
        "recipes only (two extend, compare or ablate processes share their part's runs "
        "without it)",
    )
    for name in asdict(Scale()):
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            help=" / ".join(f"{h}: {getattr(p.scale, name)}" for h, p in PLATFORMS.items()),
        )
    args = parser.parse_args()
    suffix = "" if args.harness == "tir" else f"-{args.harness}"
    out = args.out or Path(f"runs/baselines{suffix}")
    report_dir = args.report_dir or Path(f"docs/baselines{suffix}")
    defaults = PLATFORMS[args.harness].scale
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    scale = Scale(
        **{
            name: default if getattr(args, name) is None else getattr(args, name)
            for name, default in asdict(defaults).items()
        }
    )
    started = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - started:7.0f} s] {text}", flush=True)

    bench = Bench(out, scale, log, args.harness)
    if args.part in ("tune", "all"):
        bench.tune(args.recipes.split(",") if args.recipes else RECIPES)
    if args.part in ("compare", "all"):
        bench.compare()
    if args.part in ("extend", "all"):
        bench.extend(args.recipes.split(",") if args.part == "extend" and args.recipes else None)
    if args.part in ("ablate", "all"):
        bench.ablate()
    from baselines_report import write_report

    write_report(bench, report_dir, log)


if __name__ == "__main__":
    main()
