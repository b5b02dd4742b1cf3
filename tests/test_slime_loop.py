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

The disaggregated run is on the TIR task; the colocated one on mini-SWE tasks, whose
sandboxes our generate hook opens through the fleet on two sandbox-host Ray nodes (local
sandboxes there, as `opd launch` starts those nodes: a sandbox-host resource, no CPU).

What must hold: in both, after every update the engine's top-k log-probs of a fixed
prompt (the engine logs them: $OPD_STANDIN_PROBE_LOG) equal those of the trainer's model
at that step (slime's --save-hf writes it), the first update's equal the initial
student's, and step 0's loss equals the local trainer's on the same samples; when
train.py ends, so have the engines. On TIR the OPD reverse KL to the teacher of the
student's samples falls. The colocated run loses a sandbox host during rollout 2 (its
whole session killed): the trajectories whose sandboxes were there end sandbox_error and
the job goes on, training every step; its teacher is killed after 6 rollouts: the job
stops, its error naming the teacher's address.
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from launch.plan import train_args
from launch.rehearsal import synthetic_rows
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
from tests.test_slime_train import Student, job_for

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
ROLLOUTS = 6
LOST_AT = 2
"""The rollout during which the SWE run loses a sandbox host."""
LR = 3e-3
MATCH = 1e-4
"""fp32 forwards of the same weights in two processes (Megatron's and HF's kernels)."""


@pytest.fixture(scope="module")
def student(unpadded_student: Student) -> Student:
    """Its embedding one row per token (Megatron pads it, slime's converter cuts the
    padding off for the engine): the random student samples every row it has, and the
    teacher scores only ids its tokenizer has."""
    return unpadded_student


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
    """What `opd launch` writes (job.yaml, hook config, the tasks file: the rehearsal's
    rows of the job's harness) and train.py's arguments, as test_slime_train.prepare has
    them, without a replay."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "job.yaml").write_text(yaml.safe_dump(job.model_dump(mode="json")))
    hooks = {"opd_job_config": str(directory / "job.yaml")}
    (directory / "hooks.yaml").write_text(yaml.safe_dump(hooks))
    rows = synthetic_rows(job, 12)
    Path(str(job.cluster.tasks_file)).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        *slime_job.model_args(student.hf_dir),
        *SLIME_FLAGS,
        *slime_job.cpu_spec(train_args(job, str(directory / "hooks.yaml"))),
        "--num-rollout", str(rollouts),
        "--save-hf", str(directory / "hf" / "rollout_{rollout_id}"),
        "--save-debug-rollout-data", str(directory / "debug" / "rollout_{rollout_id}.pt"),
    ]  # fmt: skip


def rollout_metric(log: Path, key: str, missing: float | None = None) -> list[float]:
    """`key` of each rollout, from slime's rollout log lines ("perf N: {...}"); a rollout
    that did not log it counts `missing` (None: is left out)."""
    text = log.read_text(errors="replace")
    rollouts = {int(m[1]) for m in re.finditer(r"perf (\d+): \{'rollout/", text)}
    pattern = re.compile(rf"perf (\d+): .*'{re.escape(key)}': (-?[\d.e+-]+)")
    found = {int(m[1]): float(m[2]) for m in pattern.finditer(text)}
    if missing is not None:
        found = {r: found.get(r, missing) for r in rollouts}
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
    rollouts: int = ROLLOUTS, kill_teacher_at: int | None = None, swe: bool = False,
    kill_sandbox_host_at: int | None = None,
) -> Loop:  # fmt: skip
    """The job on a fresh loopback cluster (1 fake GPU colocated, else 2); with `swe`, on
    mini-SWE tasks whose sandboxes the fleet places on two sandbox-host nodes. With
    `kill_teacher_at`, the teacher is killed once the engine reports that weight version
    (the exit status is then the test's to judge); with `kill_sandbox_host_at`, the second
    sandbox host (its whole session: a machine lost) a second after rollout N began.
    Every engine process is gone once train.py has ended (before the cluster is torn
    down)."""
    directory = tmp_path / "job"
    teacher_dir = peaked_teacher(tmp_path / "teacher")
    probes = tmp_path / "probes.jsonl"
    env = {PROBE_LOG_ENV: str(probes)}
    gpus, hosts = 1 if colocate else 2, 2 if swe else 0
    with (
        teacher_service(teacher_dir, tmp_path / "teacher.log") as teacher,
        slime_job.cpu_cluster(roots.mktemp("r"), gpus, env, sandbox_hosts=hosts) as cluster,
    ):
        job = job_for(
            student, directory, "opd", (1, 1, 1), colocate=colocate, save_every_steps=1,
            teacher={"kind": "remote", "url": teacher.url},
        )  # fmt: skip
        if swe:
            job = swe_job(job)
        extra = job.cluster.extra_train_args  # Adam as users run it: the student must learn
        extra[extra.index("--adam-eps") + 1] = "1e-8"
        extra[extra.index("--lr") + 1] = extra[extra.index("--min-lr") + 1] = str(LR)
        args = loop_args(student, directory, job, rollouts)
        if kill_teacher_at is not None:
            watch = (probes, str(kill_teacher_at), teacher.process.kill)
            threading.Thread(target=kill_when_probed, args=watch, daemon=True).start()
        if kill_sandbox_host_at is not None:  # weight version N + 1: rollout N began
            watch = (probes, str(kill_sandbox_host_at + 1), cluster.nodes[2].kill, 1.0)
            threading.Thread(target=kill_when_probed, args=watch, daemon=True).start()
        log = directory / "train.log"
        returncode = slime_job.train(
            cluster, args, log, timeout_s=480, check=kill_teacher_at is None
        )
        lines = [json.loads(line) for line in probes.read_text().splitlines()]
        assert_gone({line["pid"] for line in lines}, log)
    by_version = {line["weight_version"]: line for line in lines}
    return Loop(directory, log, returncode, teacher.url, by_version)


def kill_when_probed(
    probes: Path, version: str, kill: Callable[[], None], after_s: float = 0.0
) -> None:
    """`kill()` `after_s` seconds after the engine's probe log has `version`."""
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline:
        if probes.exists() and f'"weight_version": "{version}"' in probes.read_text():
            time.sleep(after_s)
            kill()
            return
        time.sleep(0.05)


def swe_job(job: Any) -> Any:
    """`job` on mini-SWE tasks, 2 a step, 2 turns each, their sandboxes local ones on the
    Ray nodes offering the sandbox-host resource (placed by the fleet)."""
    data = job.model_dump(mode="json")
    data["rollout"] |= {
        "harness": "swe", "max_turns": 2, "max_context_tokens": 2048, "tasks_per_step": 2,
        "samples_per_task": 1,
    }  # fmt: skip
    data["parallel"]["max_tokens_per_gpu"] = 2048 + data["rollout"]["max_new_tokens"]
    data["sandbox"] |= {"backend": "local", "hosts": "ray", "command_timeout_s": 20}
    return config_from_dict(data)


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


def assert_learned(loop: Loop) -> None:
    """The student's own samples come nearer the teacher over the first ROLLOUTS rollouts
    (about 4.2 -> 3.2 nats here, on the TIR task)."""
    kl = rollout_metric(loop.log, "rollout/opd_reverse_kl")[:ROLLOUTS]
    assert len(kl) == ROLLOUTS
    assert sum(kl[-2:]) < 0.9 * sum(kl[:2]), kl


def assert_followed(loop: Loop, student: Student) -> None:
    """The engine's weights after each of the first ROLLOUTS updates, and step 0's loss
    (module doc)."""
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
    assert_learned(loop)
    assert_followed(loop, student)


@pytest.mark.timeout(600)
def test_train_py_colocated_on_mini_swe_outlives_a_lost_sandbox_host_not_the_teacher(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, student: Student
) -> None:
    """Colocated, on mini-SWE tasks whose sandboxes the fleet places on two sandbox-host
    nodes: one node is lost during rollout 2 and the job goes on, every later step's
    sandboxes opened on the other host (the fleet retries the starts the lost one fails,
    its breaker opens) and trained on; then the teacher is killed and the job stops naming
    it. The random student writes no valid command after a sandbox's setup, so no
    trajectory uses its sandbox again after the loss: that a trajectory mid-command on a
    lost host ends sandbox_error is tests/test_fleet_job.py's check (the same hook, a
    scripted policy, a node killed mid-batch)."""
    loop = run_loop(
        tmp_path, tmp_path_factory, student, colocate=True, rollouts=ROLLOUTS + 6,
        kill_teacher_at=ROLLOUTS + 1, swe=True, kill_sandbox_host_at=LOST_AT,
    )  # fmt: skip
    assert_followed(loop, student)
    seen = [
        retries + opens
        for retries, opens in zip(
            rollout_metric(loop.log, "rollout/sandbox_start_retries"),
            rollout_metric(loop.log, "rollout/sandbox_breaker_opens"),
            strict=True,
        )
    ]  # counters since the fleet opened
    assert seen[LOST_AT - 1] == 0 and seen[ROLLOUTS - 1] > 0, seen  # the loss was seen
    errors = rollout_metric(loop.log, "rollout/status_sandbox_error", missing=0.0)
    # the job went on: every later step's sandboxes opened (during the loss, a trajectory
    # whose setup was under way there would end sandbox_error, as it should)
    assert all(errors[r] == 0 for r in range(ROLLOUTS) if r != LOST_AT), errors
    for rollout_id in range(ROLLOUTS):
        assert train_metrics(loop.log, rollout_id)["train/loss_tokens"] > 0
    opened = rollout_metric(loop.log, "rollout/sandbox_acquired")
    assert opened[ROLLOUTS - 1] == 2 * ROLLOUTS, opened  # 2 trajectories each step
    console = loop.log.read_text(errors="replace")
    assert loop.returncode != 0, console[-3000:]
    stop = re.search(
        r"RolloutsFailedError: rollout (\d+): all \d+ rollouts failed \(teacher_error", console
    )
    assert stop, console[-3000:]
    assert loop.teacher_url in console[stop.start() :].splitlines()[0]
    # rollouts after the kill trained on nothing; 3 in a row stop the job (INFRA_FAILED_STEPS)
    assert ROLLOUTS + 2 <= int(stop[1]) <= ROLLOUTS + 3, stop[0]
