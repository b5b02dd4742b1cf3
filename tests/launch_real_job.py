"""Test-only: what the real-cluster launch tests (tests/test_launch_slurm.py,
tests/test_launch_ssh.py) put in a job's config so that `opd launch` runs slime's REAL
train.py on their nodes: the job of tests/test_slime_loop.py (OPD on the TIR task, the
tiny factory student and a factory teacher, the SGLang stand-in engine colocated on one
fake GPU), for 2 rollouts.

The nodes are processes of this host, so the job's processes need the CPU runtime
(slime_ext/cpu_runtime, a test and rehearsal aid) as slime_job's do: it travels in
`cluster.env` (the Ray job's runtime env: every actor, engine and the driver get it), and
its Megatron settings and layer spec in `cluster.extra_train_args`, as a user passes theirs.
Megatron-LM is `make slime`'s checkout; the student's torch_dist checkpoint is made
beforehand by slime's converter (the plan's convert step then finds it and skips).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from rollout.tasks.arithmetic import make_tasks
from slime_ext.cpu_runtime import SLIME_FLAGS, runtime_env_vars
from tests import slime_job
from tests.test_slime_train import Student

ROLLOUTS = 2
CPU_SPEC = ("--spec", "slime_ext.cpu_runtime.spec", "layer_spec")
OPTIMIZER = ("--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-8")
RAY_CPUS = 12
"""Each GPU node's Ray CPUs: slime asks one per GPU bundle and one per helper actor (the
rollout manager, the engine, the router's), beyond this host's cores."""


def real_train_settings(directory: Path, student: Student) -> dict[str, Any]:
    """The parts of a job config (model, parallel, rollout, algorithm, cluster) that run
    the real train.py; merge them into the launch test's own."""
    megatron_dir = Path(__import__("megatron.training").training.__file__).parents[2]
    slime = slime_job.slime_dir()
    directory.mkdir(parents=True, exist_ok=True)
    model_args = directory / "model_args.sh"
    model_args.write_text(f"MODEL_ARGS=({shlex.join(slime_job.model_args(student.hf_dir))})\n")
    tasks = directory / "tasks.jsonl"
    rows = [
        {"prompt": t.prompt, "label": t.answer, "metadata": {}}
        for t in make_tasks(6, "train", seed=0)
    ]
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = runtime_env_vars(str(slime))
    env["PYTHONPATH"] += f":{megatron_dir}"
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return {
        "model": {"student": str(student.hf_dir)},
        "parallel": {"num_nodes": 1, "gpus_per_node": 1, "max_tokens_per_gpu": 640},
        "rollout": {
            "temperature": 0.8,
            "max_context_tokens": 256,
            "max_new_tokens": 48,
            "tasks_per_step": 3,
            "samples_per_task": 2,
        },
        "algorithm": {
            "recipe": "opd",
            "steps": ROLLOUTS,
            "lr": 1e-3,
            "min_lr": 1e-3,
            "weight_decay": 0,
            # the CPU runtime's layer spec is per turn's (the plan sets tree attention's)
            "sequence_layout": "per_turn",
        },
        "logging": {"save_every_steps": 1},
        "cluster": {
            "slime_dir": str(slime),
            "megatron_dir": str(megatron_dir),
            "model_args_script": str(model_args),
            "megatron_checkpoint": str(student.torch_dist),
            "save_dir": str(directory / "save"),
            "tasks_file": str(tasks),
            "env": env,
            "extra_train_args": [*SLIME_FLAGS, *CPU_SPEC, *OPTIMIZER],
        },
    }


def merged(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`base` with `update`'s sections merged in (a section's keys replaced one by one)."""
    out = dict(base)
    for key, value in update.items():
        out[key] = {**out.get(key, {}), **value} if isinstance(value, dict) else value
    return out


def assert_trained(log: Path, directory: Path) -> None:
    """The job's driver output (`log`: what followed its submission) shows every rollout
    scored by the teacher and trained on, and its last rollout's checkpoint is saved."""
    output = log.read_text(errors="replace")
    for rollout_id in range(ROLLOUTS):
        # the sampled estimate (mean of s - t over the sampled tokens) may be negative
        rollout = re.search(rf"perf {rollout_id}: .*'rollout/opd_reverse_kl': (-?[\d.e-]+)", output)
        assert rollout, f"rollout {rollout_id} logged no OPD reverse KL:\n{output[-4000:]}"
        assert re.search(rf"step {rollout_id}: .*'train/loss'", output), output[-4000:]
    save = directory / "save"
    latest = (save / "latest_checkpointed_iteration.txt").read_text().strip()
    assert int(latest) == ROLLOUTS - 1, latest  # slime numbers them by rollout
