"""The whole job loop on this CPU machine: slime's train.py with its rollout engines (the
SGLang stand-in engine, slime_ext/cpu_runtime/sglang_engine.py, launched by slime's
SGLangEngine actors behind the real sglang-router), our generate hook on the TIR task,
the teacher service in a process of its own (`opd-teacher serve`), rewards, training in
a Megatron train actor, and the weights sent back to the engines after every step.

Disaggregated (colocate: false): one fake GPU trains, one serves; weights move over
slime's update_weights_from_distributed (a gloo group the engine joins as SGLang does).

What must hold: every rollout completes and the OPD reverse KL to the teacher of the
student's samples falls; after every update the engine's top-k
log-probs of a fixed prompt (the engine logs them: $OPD_STANDIN_PROBE_LOG) equal those of
the trainer's model at that step (slime's --save-hf writes it), and the first update's
equal the initial student's.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from launch.plan import train_args
from rollout.tasks.arithmetic import make_tasks
from slime_ext.cpu_runtime import SLIME_FLAGS
from slime_ext.cpu_runtime.sglang_engine import PROBE_LOG_ENV, top_logprobs
from slime_ext.models.factory import build_checkpoint
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


@contextlib.contextmanager
def teacher_service(model_dir: Path, log: Path) -> Iterator[str]:
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
        yield url
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


def loop_args(student: Student, directory: Path, job: Any) -> list[str]:
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
        "--num-rollout", str(ROLLOUTS),
        "--save-hf", str(directory / "hf" / "rollout_{rollout_id}"),
    ]  # fmt: skip


def rollout_metric(log: Path, key: str) -> list[float]:
    """`key` of each rollout, from slime's rollout log lines ("perf N: {...}")."""
    pattern = re.compile(rf"perf (\d+): .*'{re.escape(key)}': (-?[\d.e+-]+)")
    found = {int(m[1]): float(m[2]) for m in pattern.finditer(log.read_text(errors="replace"))}
    return [found[k] for k in sorted(found)]


def probe(model_dir: Path) -> TopK:
    """The trainer's side of the engine's probe: the checkpoint's top-k log-probs of
    PROBE_IDS."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return top_logprobs(model)


@pytest.mark.timeout(600)
def test_train_py_disaggregated_closes_the_loop_and_the_engine_follows_the_trainer(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, student: Student
) -> None:
    directory = tmp_path / "job"
    teacher_dir = peaked_teacher(tmp_path / "teacher")
    probes = tmp_path / "probes.jsonl"
    env = {PROBE_LOG_ENV: str(probes)}
    with (
        teacher_service(teacher_dir, tmp_path / "teacher.log") as teacher_url,
        slime_job.cpu_cluster(tmp_path_factory.mktemp("r"), gpus=2, env=env) as cluster,
    ):
        job = job_for(
            student, directory, "opd", (1, 1, 1), colocate=False, save_every_steps=1,
            teacher={"kind": "remote", "url": teacher_url},
        )  # fmt: skip
        extra = job.cluster.extra_train_args  # Adam as users run it: the student must learn
        extra[extra.index("--adam-eps") + 1] = "1e-8"
        extra[extra.index("--lr") + 1] = extra[extra.index("--min-lr") + 1] = str(LR)
        args = loop_args(student, directory, job)
        slime_job.train(cluster, args, directory / "train.log", timeout_s=480)

    kl = rollout_metric(directory / "train.log", "rollout/opd_reverse_kl")
    assert len(kl) == ROLLOUTS
    # the student's own samples come nearer the teacher (4.2 -> 3.2 nats here)
    assert sum(kl[-2:]) < 0.9 * sum(kl[:2]), kl

    lines = [json.loads(line) for line in probes.read_text().splitlines()]
    by_version = {line["weight_version"]: line for line in lines}
    assert sorted(by_version, key=int) == [str(v) for v in range(1, ROLLOUTS + 2)]
    assert gap(by_version["1"], probe(student.hf_dir)) < MATCH
    # the steps moved the weights: an engine that kept the first ones would fail below
    assert gap(by_version[str(ROLLOUTS + 1)], probe(student.hf_dir)) > 1e-3
    trainer = [probe(directory / "hf" / f"rollout_{r}") for r in range(ROLLOUTS)]
    for rollout_id in range(ROLLOUTS):
        error = gap(by_version[str(rollout_id + 2)], trainer[rollout_id])
        assert error < MATCH, (rollout_id, error)
    # the negative control of the check: an engine one update behind is caught every step
    for rollout_id in range(1, ROLLOUTS):
        assert gap(by_version[str(rollout_id + 2)], trainer[rollout_id - 1]) > 1e-3
