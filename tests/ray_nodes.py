"""A real multi-node Ray cluster on this one host (REFERENCE.md, "Slurm and Ray on one
host"): one `ray start --block` per node on its own loopback address (127.0.0.2+), temp
dir and port block, each in a session of its own so a test can kill a whole node (its
raylet, agents and workers) at once. Nothing is left behind: every node's processes are
killed by session and by temp dir at the end (`ray stop` would stop every Ray here)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.ports import ray_port_block

RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class RayNode:
    address: str
    """Its node IP (a loopback address)."""
    temp_dir: Path
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL the node's whole session: raylet, agents, workers (a machine lost)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        _kill_matching(str(self.temp_dir))


@dataclass
class RayCluster:
    gcs_address: str
    """host:port of the head's GCS (ray.init(address=...))."""
    nodes: list[RayNode] = field(default_factory=list)

    @property
    def head(self) -> RayNode:
        return self.nodes[0]


def ray_env() -> dict[str, str]:
    """This environment for Ray's nodes and drivers: token auth on when this machine has a
    token (Ray turns it on when ~/.ray/auth_token exists), no inherited cluster address."""
    # nor the W&B service of this process (wandb puts its address in os.environ): a job's
    # processes connecting to it collide with this process's runs ("run ID is in use")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "WANDB_SERVICE")}
    token = Path.home() / ".ray/auth_token"
    if token.exists():
        env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    return env


def _kill_matching(text: str) -> None:
    subprocess.run(["pkill", "-KILL", "-f", text], check=False, capture_output=True)


def _port_args(base: int) -> list[str]:
    return [
        f"--node-manager-port={base}",
        f"--object-manager-port={base + 1}",
        f"--metrics-export-port={base + 2}",
        f"--dashboard-agent-listen-port={base + 3}",
        f"--dashboard-agent-grpc-port={base + 4}",
        f"--runtime-env-agent-port={base + 5}",
        f"--min-worker-port={base + 10}",
        f"--max-worker-port={base + 99}",
    ]


def _start(args: list[str], node: str, temp: Path, env: dict[str, str]) -> RayNode:
    log = temp.parent / f"{temp.name}.log"
    handle = log.open("wb")
    process = subprocess.Popen(
        [RAY, "start", "--block", "--disable-usage-stats", f"--temp-dir={temp}", *args],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    handle.close()
    return RayNode(node, temp, process, log)


def _alive_nodes(gcs_address: str, env: dict[str, str]) -> int:
    """How many nodes the GCS counts alive; 0 while it does not answer (a probe that hangs
    on a GCS still starting under load is given up after 60 s, and the wait goes on to
    its deadline, where the cluster is formed again)."""
    probe = (
        "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe, gcs_address],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return 0
    lines = done.stdout.strip().splitlines()
    return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else 0


@contextlib.contextmanager
def ray_cluster(
    root: Path,
    resources: list[dict[str, float]],
    *,
    ready_timeout_s: float = 120.0,
    attempts: int = 2,
    head_args: tuple[str, ...] = ("--num-cpus=1",),
    node_env: dict[str, str] | None = None,
    node_cpus: int = 1,
) -> Iterator[RayCluster]:
    """A head (no resources but `head_args`: 1 CPU by default) and one worker node per
    entry of `resources` (its custom resources), all alive before it yields; every node's
    processes (its workers too) get `node_env` on top of this environment; a cluster that
    does not form (a port taken meanwhile, a node that died starting) is killed and formed
    again on other ports, `attempts` times. The nodes' temp dirs are under `root`, or under
    a short directory of their own (removed at the end) where `root` is too long for Ray's
    socket paths (107 bytes)."""
    env = (
        ray_env()
        | {
            "RAY_health_check_period_ms": "500",  # a killed node is seen dead in seconds
            "RAY_health_check_failure_threshold": "3",
            "RAY_health_check_initial_delay_ms": "500",
        }
        | (node_env or {})
    )
    given = root
    if len(str(root)) + len(_SOCKET_TAIL) > 107:  # e.g. under pytest-xdist's popen-gwN/
        root = Path(tempfile.mkdtemp(prefix="opd-ray-"))
    try:
        for attempt in range(attempts):
            cluster = RayCluster("")
            try:
                _form(
                    cluster, root / f"a{attempt}", resources, env, ready_timeout_s, head_args,
                    node_cpus,
                )  # fmt: skip
                break
            except RuntimeError:
                _kill_all(cluster, root / f"a{attempt}")
                if attempt + 1 == attempts:
                    raise
        yield cluster
    finally:
        _kill_all(cluster, root)
        if root != given:
            shutil.rmtree(root, ignore_errors=True)


_SOCKET_TAIL = "/a0/n0/session_2026-12-07_02-18-06_301446_4194304/sockets/plasma_store"
"""The longest path Ray puts under a node's temp dir in `root`: a Unix socket's, which
holds at most 107 bytes."""


def _kill_all(cluster: RayCluster, root: Path) -> None:
    for node in reversed(cluster.nodes):
        node.kill()
    _kill_matching(str(root))


def _form(
    cluster: RayCluster,
    root: Path,
    resources: list[dict[str, float]],
    env: dict[str, str],
    ready_timeout_s: float,
    head_args: tuple[str, ...] = ("--num-cpus=1",),
    node_cpus: int = 1,
) -> None:
    """Start the head, wait for it, then the other nodes (`node_cpus` CPUs each);
    RuntimeError with every node's log when they are not all alive within
    `ready_timeout_s`."""
    root.mkdir(parents=True, exist_ok=True)
    base = ray_port_block()
    gcs_port = base + 999
    cluster.gcs_address = f"127.0.0.2:{gcs_port}"
    head_args = [
        "--head",
        "--node-ip-address=127.0.0.2",
        f"--port={gcs_port}",
        *head_args,
        "--include-dashboard=false",
        f"--ray-client-server-port={base + 998}",
        *_port_args(base),
    ]
    deadline = time.monotonic() + ready_timeout_s
    cluster.nodes.append(_start(head_args, "127.0.0.2", root / "n0", env))
    _wait_alive(cluster, 1, env, deadline)
    for index, extra in enumerate(resources, start=1):
        address = f"127.0.0.{2 + index}"
        args = [
            f"--address={cluster.gcs_address}",
            f"--node-ip-address={address}",
            f"--num-cpus={node_cpus}",
            f"--resources={json.dumps(extra)}",
            *_port_args(base + 100 * index),
        ]
        cluster.nodes.append(_start(args, address, root / f"n{index}", env))
    _wait_alive(cluster, len(cluster.nodes), env, deadline)


def _wait_alive(cluster: RayCluster, count: int, env: dict[str, str], deadline: float) -> None:
    while _alive_nodes(cluster.gcs_address, env) < count:
        dead = [node for node in cluster.nodes if node.process.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {n.address} ({'exited' if n in dead else 'running'}):\n"
                f"{n.log.read_text(errors='replace')[-2000:]}"
                for n in cluster.nodes
            )
            raise RuntimeError(f"the Ray cluster did not form:\n{logs}")
        time.sleep(1.0)
