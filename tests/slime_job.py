"""Test-only: slime's own train.py / train_async.py, whole, on this CPU machine.

The job `opd launch` would submit, run as slime runs it: a Ray cluster of loopback nodes
with fake GPUs (`ray start --num-gpus`), slime's train.py as the driver, its
RolloutManager and MegatronTrainRayActors as Ray actors in processes of their own, real
Megatron-LM (`megatron.training`) and megatron-core. Each of those processes gets
slime_ext.cpu_runtime (the CPU runtime, a test and rehearsal aid) from the nodes'
environment (`cpu_runtime.runtime_env_vars`), before anything of slime loads.

Train-only replay: the rollouts are written beforehand in slime's own format (slime's
`save_debug_rollout_data`, what `--save-debug-rollout-data` writes) and replayed with
`--load-debug-rollout-data`, so no rollout engine is needed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from launch.plan import SANDBOX_RESOURCE
from slime_ext.cpu_runtime import MEGATRON_FLAGS, runtime_env_vars
from slime_ext.models.megatron_args import qwen3_model_args
from tests.live_server import free_port
from tests.ray_nodes import RayCluster, ray_cluster, ray_env

ROOT = Path(__file__).resolve().parents[1]


def slime_dir() -> Path:
    """The installed slime's checkout (`make slime` installs it editable, tools/ beside it)."""
    import slime

    return Path(slime.__file__).resolve().parents[1]


def cpu_env() -> dict[str, str]:
    """What every process of a CPU job gets on top of tests.ray_nodes.ray_env (this
    environment without this process's Ray address and W&B service): the CPU runtime,
    slime's checkout and this project importable, W&B offline."""
    env = runtime_env_vars(str(slime_dir()))
    return env | {
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def model_args(hf_dir: Path) -> list[str]:
    """MODEL_ARGS (slime's scripts/models/qwen3-*.sh) of a Qwen3 HF checkpoint."""
    return qwen3_model_args(hf_dir)


def cpu_spec(train_args: Sequence[str]) -> list[str]:
    """The plan's arguments with its layer spec as the CPU runtime builds it: the tree
    attention's (tree-packed samples) or slime's default local layer."""
    args = list(train_args)
    if "--spec" in args:
        at = args.index("--spec")
        if args[at + 1 : at + 3] != ["slime_ext.slime.tree_attention", "layer_spec"]:
            raise ValueError(f"a spec the CPU runtime does not wrap: {args[at : at + 3]}")
        args[at + 1 : at + 3] = ["slime_ext.cpu_runtime.spec", "tree_layer_spec"]
        return args
    return [*args, "--spec", "slime_ext.cpu_runtime.spec", "layer_spec"]


def run(
    command: Sequence[str], log: Path, *, env: dict[str, str], timeout_s: float, cwd: Path,
    check: bool = True,
) -> int:  # fmt: skip
    """Run a job's program; its output to `log`; with `check`, a failure raises with the
    log's tail. The exit status."""
    with log.open("wb") as out:
        done = subprocess.run(
            list(command), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
            timeout=timeout_s, check=False,
        )  # fmt: skip
    if check and done.returncode != 0:
        tail = log.read_text(errors="replace")[-6000:]
        raise AssertionError(f"{shlex.join(command[:3])} ... exited {done.returncode}:\n{tail}")
    return done.returncode


def convert_hf_to_torch_dist(hf_dir: Path, out: Path, log: Path) -> None:
    """slime's tools/convert_hf_to_torch_dist.py under torchrun (one process), as users
    convert their student."""
    torchrun_megatron(["tools/convert_hf_to_torch_dist.py"], hf_dir, ["--save", str(out)], log)


def torchrun_megatron(
    program: Sequence[str], hf_dir: Path, extra: Sequence[str], log: Path
) -> None:
    """`program` (a script and its own arguments) under torchrun, one process, in slime's
    checkout, with the student's MODEL_ARGS, the CPU runtime's Megatron-LM settings and
    layer spec, --hf-checkpoint and `extra`."""
    command = [
        str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", "1",
        "--master-port", str(free_port()), *program, *model_args(hf_dir), *MEGATRON_FLAGS,
        "--spec", "slime_ext.cpu_runtime.spec", "layer_spec",
        "--hf-checkpoint", str(hf_dir), *extra,
    ]  # fmt: skip
    env = ray_env() | cpu_env() | {"WORLD_SIZE": "1"}
    run(command, log, env=env, timeout_s=240, cwd=slime_dir())


def save_replay(directory: Path, rollouts: Sequence[Sequence[Any]]) -> str:
    """Each rollout's flattened samples in slime's debug format, by slime's own writer;
    the `--load-debug-rollout-data` template."""
    from slime.observability.rollout_data_utils import save_debug_rollout_data

    template = str(directory / "rollout_{rollout_id}.pt")
    for rollout_id, samples in enumerate(rollouts):
        save_debug_rollout_data(template, list(samples), rollout_id=rollout_id, evaluation=False)
    return template


@contextmanager
def cpu_cluster(
    root: Path, gpus: int, env: dict[str, str] | None = None, sandbox_hosts: int = 0
) -> Iterator[RayCluster]:
    """A loopback Ray head with `gpus` fake GPUs (and CPUs beyond the cores: slime asks a
    CPU per GPU bundle and one per helper actor) and `sandbox_hosts` nodes offering the
    sandbox-host resource and no CPU (as `opd launch` starts them), their processes under
    the CPU runtime and `env`."""
    node_env = cpu_env() | (env or {})
    hosts = [{SANDBOX_RESOURCE: 1.0}] * sandbox_hosts
    with ray_cluster(
        root, hosts, head_args=(f"--num-gpus={gpus}", "--num-cpus=16"), node_env=node_env,
        node_cpus=0,
    ) as cluster:  # fmt: skip
        yield cluster


def driver_env(cluster: RayCluster) -> dict[str, str]:
    """The environment of a job's driver (slime's train.py) on `cluster`."""
    return ray_env() | cpu_env() | {"RAY_ADDRESS": cluster.gcs_address}


def train(
    cluster: RayCluster, args: Sequence[str], log: Path, *, script: str = "train.py",
    timeout_s: float = 300, check: bool = True,
) -> int:  # fmt: skip
    """slime's `script` as the job's driver on `cluster`, with `args`; its exit status
    (with `check`, a failure raises)."""
    command = [sys.executable, script, *args]
    env = driver_env(cluster)
    return run(command, log, env=env, timeout_s=timeout_s, cwd=slime_dir(), check=check)


def train_until_killed(
    cluster: RayCluster, args: Sequence[str], log: Path, stop: Callable[[], bool],
    timeout_s: float = 300,
) -> None:  # fmt: skip
    """slime's train.py on `cluster`, SIGKILLed (its whole session: a lost head node's job)
    as soon as `stop()` holds; AssertionError if it ends or times out first."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "train.py", *args], cwd=slime_dir(), env=driver_env(cluster),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    try:
        while not stop():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-4000:]
                raise AssertionError(f"train.py ended before it was stopped:\n{tail}")
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def convert_torch_dist_to_hf(
    checkpoint: Path, out: Path, origin_hf: Path, vocab: int, log: Path
) -> None:
    """slime's tools/convert_torch_dist_to_hf.py, as docs/evaluation.md tells users to
    evaluate a trained checkpoint (the padded embedding cut back to the vocabulary)."""
    command = [
        sys.executable, "tools/convert_torch_dist_to_hf.py", "--input-dir", str(checkpoint),
        "--output-dir", str(out), "--origin-hf-dir", str(origin_hf), "--vocab-size", str(vocab),
        "--force",
    ]  # fmt: skip
    run(command, log, env=ray_env() | cpu_env(), timeout_s=120, cwd=slime_dir())


def megatron_logits(
    hf_dir: Path, save_dir: Path, prompt: Sequence[int], out: Path, log: Path
) -> Any:
    """The logits on `prompt` of the latest checkpoint in `save_dir`, loaded by Megatron-LM
    into slime's model (tests/megatron_forward.py under torchrun): [len(prompt), vocab]."""
    import torch

    program = [str(ROOT / "tests/megatron_forward.py"), str(out), ",".join(map(str, prompt))]
    torchrun_megatron(program, hf_dir, ["--load", str(save_dir)], log)
    return torch.load(out)
