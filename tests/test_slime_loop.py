"""The whole job loop on this CPU machine: slime's train.py with its rollout engines (the
SGLang stand-in engine, slime_ext/cpu_runtime/sglang_engine.py, launched by slime's
SGLangEngine actors behind the real sglang-router), our generate hook on the TIR task,
the teacher service in a process of its own (`opd-teacher serve`), rewards, training in
a Megatron train actor, and the weights sent back to the engines after every step.

Two runs: disaggregated (colocate: false): one fake GPU trains, one serves, weights over
slime's update_weights_from_distributed (a gloo group the engine joins as SGLang does);
colocated (colocate: true, what the example cluster configs run): the engine shares the
training GPU, releases its memory while the trainer trains (slime's offload_rollout) and
takes the weights over update_weights_from_tensor. slime's train_async.py refuses
colocated engines (its first line asserts it) and `opd launch` submits train.py, so the
colocated run is train.py's.

What must hold: every rollout completes and the OPD reverse KL to the teacher of the
student's samples falls; after every update the engine's top-k log-probs of a fixed
prompt (the engine logs them: $OPD_STANDIN_PROBE_LOG) equal those of the trainer's model
at that step (slime's --save-hf writes it), and the first update's equal the initial
student's; when train.py ends, so have the engines. The colocated run's teacher is killed
after 6 rollouts: the job stops, its error naming the teacher's address.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from launch.plan import train_args
from rollout.tasks.arithmetic import make_tasks
from slime_ext.cpu_runtime import SLIME_FLAGS
from slime_ext.cpu_runtime.sglang_engine import PROBE_LOG_ENV, top_logprobs
from slime_ext.job.config import config_from_dict
from slime_ext.local.loop import trainer_config
from slime_ext.local.trainer import LocalTrainer
from slime_ext.models.factory import build_checkpoint
from slime_ext.turns import TurnBatch
from tests import slime_job
from tests.engine_driver import TopK, gap
from tests.live_server import free_port, wait_until_healthy
from tests.test_slime_train import Student, job_for, make_student

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
ROLLOUTS = 6
LR = 3e-3
MATCH = 1e-4
"""fp32 forwards of the same weights in two processes (Megatron's and HF's kernels)."""


@pytest.fixture(scope="module")
def student(tmp_path_factory: pytest.TempPathFactory) -> Student:
    """Its embedding one row per token (Megatron pads it, slime's converter cuts the
    padding off for the engine): the random student samples every row it has, and the
    teacher scores only ids its tokenizer has."""
    return make_student(tmp_path_factory.mktemp("student"), vocab=None)


@dataclass
class Teacher:
    url: str
    process: subprocess.Popen[bytes]


@contextlib.contextmanager
def teacher_service(model_dir: Path, log: Path) -> Iterator[Teacher]:
    """`opd-teacher serve` on 127.0.0.1, in a process of its own; killed on exit."""
    port = free_port()
    command = [
        str(Path(sys.executable).parent / "opd-teacher"), "serve", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--max-context", "4096",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, process, log)
        yield Teacher(url, process)
    finally:
        process.kill()
        process.wait(timeout=30)


def peaked_teacher(directory: Path) -> Path:
    """Another factory model whose logits are scaled up 8x (its final norm's weight): a
    random student is far from it, so the KL it learns to close is larger than the noise
    of a few trajectories' estimate."""
    hf_dir = build_checkpoint("qwen3-tiny", directory, seed=8)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(8.0)
    model.save_pretrained(hf_dir)
    return hf_dir


def loop_args(student: Student, directory: Path, job: Any, rollouts: int) -> list[str]:
    """What `opd launch` writes (job.yaml, hook config, the tasks file) and train.py's
    arguments, as test_slime_train.prepare has them, without a replay."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json")))
    hooks = {"opd_job_config": str(directory / "job.yaml")}
    (directory / "hooks.yaml").write_text(yaml.safe_dump(hooks))
    rows = [
        {"prompt": task.prompt, "label": task.answer, "metadata": {}}
        for task in make_tasks(12, "train", seed=0)
    ]
    Path(str(job.cluster.tasks_file)).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        *slime_job.model_args(student.hf_dir),
        *SLIME_FLAGS,
        *slime_job.cpu_spec(train_args(job, str(directory / "hooks.yaml"))),
        "--num-rollout", str(rollouts),
        "--save-hf", str(directory / "hf" / "rollout_{rollout_id}"),
        "--save-debug-rollout-data", str(directory / "debug" / "rollout_{rollout_id}.pt"),
    ]  # fmt: skip


def rollout_metric(log: Path, key: str) -> list[float]:
    """`key` of each rollout, from slime's rollout log lines ("perf N: {...}")."""
    pattern = re.compile(rf"perf (\d+): .*'{re.escape(key)}': (-?[\d.e+-]+)")
    found = {int(m[1]): float(m[2]) for m in pattern.finditer(log.read_text(errors="replace"))}
    return [found[k] for k in sorted(found)]


def train_metrics(log: Path, step: int) -> dict[str, float]:
    """The train actor's metrics of `step` (its "step N: {...}" line)."""
    pattern = re.compile(rf"step {step}: (\{{.*\}})")
    found = pattern.search(log.read_text(errors="replace"))
    assert found, f"no step {step} in {log}"
    return dict(ast.literal_eval(found[1]))


def turn_batch(samples: list[Any], pad_id: int) -> TurnBatch:
    """slime's per-turn samples (what train.py trained on: removed ones carry no loss) as
    the local trainer's batch: one row per sample, its response the span, its rollout_id
    the trajectory."""
    kept = [s for s in samples if not s.remove_sample]
    trajectories = {rid: n for n, rid in enumerate(dict.fromkeys(s.rollout_id for s in kept))}
    width = max(len(s.tokens) for s in kept)
    ids = torch.full((len(kept), width), pad_id)
    attention = torch.zeros((len(kept), width), dtype=torch.long)
    rows, targets, mask, owner, teacher, sampler = [], [], [], [], [], []
    for b, sample in enumerate(kept):
        length, start = len(sample.tokens), len(sample.tokens) - sample.response_length
        ids[b, :length], attention[b, :length] = torch.tensor(sample.tokens), 1
        rows += [b * width + start - 1 + j for j in range(sample.response_length)]
        targets += sample.tokens[start:]
        mask += [bool(m) for m in sample.loss_mask]
        owner += [trajectories[sample.rollout_id]] * sample.response_length
        teacher += list(sample.teacher_log_probs)
        sampler += list(sample.rollout_log_probs)
    return TurnBatch(
        input_ids=ids, attention_mask=attention, span_rows=torch.tensor(rows),
        targets=torch.tensor(targets), loss_mask=torch.tensor(mask),
        trajectory_index=torch.tensor(owner), sampler_logprobs=torch.tensor(sampler),
        teacher_logprobs=torch.tensor(teacher), teacher_topk_ids=None,
        teacher_topk_logprobs=None, num_trajectories=len(trajectories),
        num_processed_tokens=int(attention.sum()),
    )  # fmt: skip


def local_step0(loop: Loop, student: Student) -> dict[str, float]:
    """The local trainer's loss and metrics (the embedded mode's, its settings from the
    job) of the initial student on the samples train.py trained on at step 0 (slime's
    --save-debug-rollout-data)."""
    from slime.observability.rollout_data_utils import load_debug_rollout_data

    template = str(loop.directory / "debug" / "rollout_{rollout_id}.pt")
    samples = load_debug_rollout_data(template, rollout_id=0)
    job = config_from_dict(yaml.safe_load((loop.directory / "job.yaml").read_text()))
    model = AutoModelForCausalLM.from_pretrained(student.hf_dir, dtype=torch.float32)
    trainer = LocalTrainer(model, trainer_config(job))
    with torch.no_grad():
        _, metrics = trainer.batch_loss(turn_batch(samples, trainer.pad_id), "opd")
    return metrics


def probe(model_dir: Path) -> TopK:
    """The trainer's side of the engine's probe: the checkpoint's top-k log-probs of
    PROBE_IDS."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return top_logprobs(model)


@dataclass
class Loop:
    directory: Path
    log: Path
    returncode: int
    teacher_url: str
    probes: dict[str, dict[str, Any]]
    """The engine's probe after each update, by weight version ("1": the initial push)."""


def run_loop(
    tmp_path: Path, roots: pytest.TempPathFactory, student: Student, *, colocate: bool,
    rollouts: int = ROLLOUTS, kill_teacher_at: int | None = None,
) -> Loop:  # fmt: skip
    """The job on a fresh loopback cluster (1 fake GPU colocated, else 2). With
    `kill_teacher_at`, the teacher is killed once the engine reports that weight version;
    the exit status is then the test's to judge. Every engine process is gone once
    train.py has ended (before the cluster is torn down)."""
    directory = tmp_path / "job"
    teacher_dir = peaked_teacher(tmp_path / "teacher")
    probes = tmp_path / "probes.jsonl"
    env = {PROBE_LOG_ENV: str(probes)}
    with (
        teacher_service(teacher_dir, tmp_path / "teacher.log") as teacher,
        slime_job.cpu_cluster(roots.mktemp("r"), gpus=1 if colocate else 2, env=env) as cluster,
    ):
        job = job_for(
            student, directory, "opd", (1, 1, 1), colocate=colocate, save_every_steps=1,
            teacher={"kind": "remote", "url": teacher.url},
        )  # fmt: skip
        extra = job.cluster.extra_train_args  # Adam as users run it: the student must learn
        extra[extra.index("--adam-eps") + 1] = "1e-8"
        extra[extra.index("--lr") + 1] = extra[extra.index("--min-lr") + 1] = str(LR)
        args = loop_args(student, directory, job, rollouts)
        if kill_teacher_at is not None:
            watch = (probes, str(kill_teacher_at), teacher.process)
            threading.Thread(target=kill_when_probed, args=watch, daemon=True).start()
        log = directory / "train.log"
        returncode = slime_job.train(
            cluster, args, log, timeout_s=480, check=kill_teacher_at is None
        )
        lines = [json.loads(line) for line in probes.read_text().splitlines()]
        assert_gone({line["pid"] for line in lines}, log)
    by_version = {line["weight_version"]: line for line in lines}
    return Loop(directory, log, returncode, teacher.url, by_version)


def kill_when_probed(probes: Path, version: str, process: subprocess.Popen[bytes]) -> None:
    """SIGKILL `process` once the engine's probe log has `version`."""
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline and process.poll() is None:
        if probes.exists() and f'"weight_version": "{version}"' in probes.read_text():
            process.kill()
            return
        time.sleep(0.05)


def assert_gone(pids: set[int], log: Path, within_s: float = 30) -> None:
    """No process of `pids` is left (a zombie counts as gone)."""
    deadline = time.monotonic() + within_s
    while True:
        left = [p for p in pids if psutil.pid_exists(p) and not _zombie(p)]
        if not left:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine processes {left} outlived train.py (its log: {log})")
        time.sleep(0.2)


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_learned_and_followed(loop: Loop, student: Student) -> None:
    """The KL and the engine's weights over the first ROLLOUTS rollouts (module doc)."""
    kl = rollout_metric(loop.log, "rollout/opd_reverse_kl")[:ROLLOUTS]
    assert len(kl) == ROLLOUTS
    # the student's own samples come nearer the teacher (about 4.2 -> 3.2 nats here)
    assert sum(kl[-2:]) < 0.9 * sum(kl[:2]), kl

    by_version = loop.probes
    assert [str(v) for v in range(1, ROLLOUTS + 2)] == sorted(by_version, key=int)[: ROLLOUTS + 1]
    assert gap(by_version["1"], probe(student.hf_dir)) < MATCH
    # the steps moved the weights: an engine that kept the first ones would fail below
    assert gap(by_version[str(ROLLOUTS + 1)], probe(student.hf_dir)) > 1e-3
    trainer = [probe(loop.directory / "hf" / f"rollout_{r}") for r in range(ROLLOUTS)]
    for rollout_id in range(ROLLOUTS):
        error = gap(by_version[str(rollout_id + 2)], trainer[rollout_id])
        assert error < MATCH, (rollout_id, error)
    # the negative control of the check: an engine one update behind is caught every step
    for rollout_id in range(1, ROLLOUTS):
        assert gap(by_version[str(rollout_id + 2)], trainer[rollout_id - 1]) > 1e-3

    # step 0's loss is the local trainer's on the same samples (the same initial weights:
    # Megatron's forward and HF's, the padded vocabulary columns left out)
    local, cluster = local_step0(loop, student), train_metrics(loop.log, 0)
    assert cluster["train/loss"] == pytest.approx(local["train/loss"], rel=1e-5)
    assert cluster["train/opd_reverse_kl"] == pytest.approx(local["train/opd_reverse_kl"], rel=1e-5)


@pytest.mark.timeout(600)
def test_train_py_disaggregated_closes_the_loop_and_the_engine_follows_the_trainer(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, student: Student
) -> None:
    loop = run_loop(tmp_path, tmp_path_factory, student, colocate=False)
    assert_learned_and_followed(loop, student)


@pytest.mark.timeout(600)
def test_train_py_colocated_follows_the_trainer_and_stops_naming_the_killed_teacher(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, student: Student
) -> None:
    loop = run_loop(
        tmp_path, tmp_path_factory, student, colocate=True, rollouts=ROLLOUTS + 6,
        kill_teacher_at=ROLLOUTS + 1,
    )  # fmt: skip
    assert_learned_and_followed(loop, student)
    console = loop.log.read_text(errors="replace")
    assert loop.returncode != 0, console[-3000:]
    stop = re.search(
        r"RolloutsFailedError: rollout (\d+): all \d+ rollouts failed \(teacher_error", console
    )
    assert stop, console[-3000:]
    assert loop.teacher_url in console[stop.start() :].splitlines()[0]
    # rollouts after the kill trained on nothing; 3 in a row stop the job (INFRA_FAILED_STEPS)
    assert ROLLOUTS + 2 <= int(stop[1]) <= ROLLOUTS + 3, stop[0]
