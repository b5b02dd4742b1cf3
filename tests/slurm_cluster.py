"""Test-only: a real Slurm cluster of `nodes` nodes on this one host, for tests that
`sbatch` what `opd launch --sbatch` writes.

Slurm 22.05 as Debian 12 builds it (MULTIPLE_SLURMD): one munged on its own socket and key,
one slurmctld, one `slurmd -N nodeK` per node; node K answers at 127.0.B.(11+K) on its own
port, with `gpus_per_node` fake GPUs (character devices) as gres, 4 CPUs, one partition.
Ports and the address block B are drawn at random (and checked free) so that clusters of
concurrent test runs stay apart.

- `slurm_available(proctrack)`: None when a cluster can start here, else why not.
- `require_slurm(proctrack)`: skip with that reason (fail under CI, which must run them).
- `slurm_cluster(directory, proctrack)`: the running cluster (all nodes idle), torn down on
  exit: jobs cancelled, daemons stopped by pid, then any process still carrying this
  cluster's SLURM_CONF in its environment (a leaked step child) killed and listed in
  `SlurmCluster.killed_at_exit`. The daemons also die with the thread that started them.

Without slurmdbd there is no sacct: `wait_job` polls `scontrol show job` (finished jobs stay
there for MinJobAge, 10 minutes here) and falls back to the jobcomp/filetxt log.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from tests.ports import free_ports

Proctrack = Literal["linuxproc", "cgroup"]

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
HOW_TO_INSTALL = "install Slurm and munge as root: apt-get install -y slurm-wlm munge"
# states a job leaves no more (a completing job shows COMPLETING until its steps are gone)
FINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class SlurmClusterError(RuntimeError):
    """The cluster did not start, or a Slurm command failed; the message says what."""


class SlurmJobTimeout(SlurmClusterError):
    """A job did not reach a final state in time."""


def slurm_available(proctrack: Proctrack = "linuxproc") -> str | None:
    """None when `slurm_cluster(..., proctrack)` can run here, else the reason it cannot."""
    missing = [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]
    if missing:
        return f"Slurm not installed (no {', '.join(missing)}): {HOW_TO_INSTALL}"
    if os.geteuid() != 0:
        return "slurmd must run as root (it starts job steps as their user)"
    help_run = subprocess.run(["slurmd", "-h"], capture_output=True, text=True)
    usage = help_run.stdout + help_run.stderr
    if "-N node" not in usage:
        return "this slurmd is built without MULTIPLE_SLURMD (no `slurmd -N`): one node per host"
    with tempfile.TemporaryDirectory() as probe:
        try:
            _make_gpu_device(Path(probe) / "gpu0")
        except OSError as error:
            return f"cannot create the fake GPUs' character devices (mknod: {error})"
    if proctrack == "cgroup":
        return _cgroup_v1_unavailable()
    return None


def _cgroup_v1_unavailable() -> str | None:
    freezer = CGROUP_ROOT / "freezer"
    if not (freezer / "cgroup.procs").exists():
        return (
            f"proctrack/cgroup: no cgroup v1 freezer hierarchy at {freezer}: this fixture runs "
            "Slurm's cgroup/v1 plugin (cgroup/v2 is untested: on a hybrid v1+v2 host Slurm "
            "22.05 refuses it, 'Hybrid mode is not supported')"
        )
    if not os.access(freezer, os.W_OK):
        return f"proctrack/cgroup: {freezer} is not writable (a container without cgroup rights)"
    return None


def require_slurm(proctrack: Proctrack = "linuxproc") -> None:
    """Skip the calling test when Slurm cannot run here; fail instead under CI."""
    reason = slurm_available(proctrack)
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True)
class QueuedJob:
    """One line of `squeue`."""

    job_id: int
    state: str
    nodes: str
    reason: str
    name: str


@dataclass
class SlurmCluster:
    """A started cluster; `env` goes into every client's environment."""

    directory: Path
    proctrack: Proctrack
    conf: Path
    node_ports: dict[str, int]
    node_addresses: dict[str, str]
    killed_at_exit: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def node_names(self) -> list[str]:
        return list(self.node_addresses)

    def node_address(self, name: str) -> str:
        return self.node_addresses[name]

    def client(
        self, *args: str, check: bool = True, timeout_s: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        result = subprocess.run(
            args, env=os.environ | self.env, capture_output=True, text=True, timeout=timeout_s
        )
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
            )
        return result

    def sbatch(
        self, script: Path, extra_env: dict[str, str] | None = None, options: Sequence[str] = ()
    ) -> int:
        """Submit `script` (run from its folder, with this environment plus `extra_env`, and
        sbatch's `options` before it); its job id."""
        result = subprocess.run(
            ["sbatch", "--parsable", *options, str(script)],
            env=os.environ | self.env | (extra_env or {}),
            cwd=script.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode != 0:
            raise SlurmClusterError(f"sbatch {script} exited {result.returncode}: {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str] | None:
        """`scontrol show job` as key/value pairs; None once Slurm has forgotten the job."""
        result = self.client("scontrol", "show", "job", "--oneliner", str(job_id), check=False)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise SlurmClusterError(f"scontrol show job {job_id}: {result.stderr.strip()}")
        return _key_values(result.stdout)

    def job_state(self, job_id: int) -> str:
        """The job's state now (COMPLETING until its steps are cleaned up)."""
        job = self.job(job_id)
        if job is not None:
            return job["JobState"]
        for line in reversed(self._jobcomp_lines()):
            fields = _key_values(line)
            if fields.get("JobId") == str(job_id):
                return fields["JobState"]
        raise SlurmClusterError(f"job {job_id} is unknown to this cluster")

    def wait_job(self, job_id: int, timeout_s: float) -> str:
        """The job's final state (COMPLETED, FAILED, CANCELLED, TIMEOUT, ...), once reached."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.job_state(job_id)
            if state in FINAL_STATES:
                return state
            if time.monotonic() > deadline:
                raise SlurmJobTimeout(
                    f"job {job_id} still {state} after {timeout_s:g} s; queue: {self.squeue()}"
                )
            time.sleep(0.2)

    def squeue(self) -> list[QueuedJob]:
        """The jobs Slurm still lists (pending, running, completing); a heterogeneous job's
        components (squeue's "ID+K") each under the job's id."""
        out = self.client("squeue", "--noheader", "--format=%i|%T|%N|%r|%j").stdout
        jobs = []
        for line in out.splitlines():
            job_id, state, nodes, reason, name = line.split("|", 4)
            jobs.append(QueuedJob(int(job_id.split("+")[0]), state, nodes, reason, name))
        return jobs

    def wait_queue_empty(self, timeout_s: float) -> list[QueuedJob]:
        """Poll until squeue lists nothing (a finished job's steps and components may
        still be completing); what it still lists at the deadline."""
        deadline = time.monotonic() + timeout_s
        while (jobs := self.squeue()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return jobs

    def scancel(self, job_id: int) -> None:
        self.client("scancel", str(job_id))

    def processes_left(self, patterns: Iterable[str], *, host_wide: bool = False) -> list[str]:
        """'pid command line' of processes whose command line contains one of `patterns`:
        those started by this cluster (its SLURM_CONF in their environment: daemons, step
        tasks and what they spawn), or every process on the host with `host_wide`."""
        patterns = list(patterns)
        marker = None if host_wide else self._env_marker()
        return [
            f"{pid} {command}"
            for pid, command in _processes(marker)
            if any(pattern in command for pattern in patterns)
        ]

    def _env_marker(self) -> bytes:
        return f"SLURM_CONF={self.conf}".encode()

    def _jobcomp_lines(self) -> list[str]:
        path = self.directory / "log" / "jobcomp.log"
        return path.read_text().splitlines() if path.exists() else []


@contextmanager
def slurm_cluster(
    directory: Path, proctrack: Proctrack, nodes: int = 7, gpus_per_node: int = 4
) -> Iterator[SlurmCluster]:
    """A running cluster whose configuration, state and logs live in `directory`; on exit
    every job is cancelled and every process it started is gone."""
    reason = slurm_available(proctrack)
    if reason is not None:
        raise SlurmClusterError(reason)
    directory.mkdir(parents=True, exist_ok=True)
    # Unix socket paths (munge's, slurmstepd's in the spool) must stay under 108 bytes
    runtime = Path(tempfile.mkdtemp(prefix="opd-slurm-"))
    cluster = _configure(directory, runtime, proctrack, nodes, gpus_per_node)
    daemons: list[_Daemon] = []
    try:
        _start(cluster, runtime, daemons)
        yield cluster
    finally:
        _stop(cluster, daemons)
        shutil.rmtree(runtime, ignore_errors=True)


@dataclass
class _Daemon:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


def _configure(
    directory: Path, runtime: Path, proctrack: Proctrack, nodes: int, gpus_per_node: int
) -> SlurmCluster:
    log, state, devices = directory / "log", directory / "state", directory / "dev"
    spools = [runtime / "spool" / f"node{index}" for index in range(nodes)]
    for folder in (log, state, devices, runtime / "munge", *spools):
        folder.mkdir(parents=True, exist_ok=True)
    for folder in (runtime, runtime / "munge"):  # munged: its socket reachable by all users
        folder.chmod(0o755)
    key = runtime / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    for index in range(gpus_per_node):
        if not (devices / f"gpu{index}").exists():
            _make_gpu_device(devices / f"gpu{index}")

    draw = random.Random()
    controller_port, *node_ports = free_ports(1 + nodes)
    block = draw.randrange(1, 255)
    names = [f"node{index}" for index in range(nodes)]
    conf = directory / "slurm.conf"
    lines = [
        f"ClusterName=opd{block}",
        f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
        f"SlurmctldPort={controller_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={runtime / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={state}",
        f"SlurmdSpoolDir={runtime / 'spool' / '%n'}",
        f"SlurmctldPidFile={directory / 'slurmctld.pid'}",
        f"SlurmdPidFile={directory / 'slurmd.%n.pid'}",
        f"SlurmctldLogFile={log / 'slurmctld.log'}",
        f"SlurmdLogFile={log / 'slurmd.%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"ProctrackType=proctrack/{proctrack}",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "GresTypes=gpu",
        "SlurmdParameters=config_overrides",  # 4 CPUs a node on a 2-CPU host
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={log / 'jobcomp.log'}",
        "MinJobAge=600",  # finished jobs stay in `scontrol show job`
        # a heterogeneous job (the launch's: training nodes and sandbox hosts) is started by
        # the backfill scheduler only, every bf_interval (default 30 s: half a minute idle
        # per submission)
        "SchedulerParameters=batch_sched_delay=0,bf_interval=1",
        "KillWait=2",  # SIGTERM to SIGKILL on cancel; the default 30 s only slows tests
        # with proctrack/cgroup, steps live in /sys/fs/cgroup/freezer/slurm_nodeK/uid_U/job_J:
        # job ids from a random start keep concurrent clusters' cgroups apart
        f"FirstJobId={draw.randrange(1_000, 60_000_000)}",
    ]
    for name, port, index in zip(names, node_ports, range(nodes), strict=True):
        lines.append(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.{block}.{11 + index}"
            f" Port={port} CPUs=4 Gres=gpu:{gpus_per_node} State=UNKNOWN"
        )
    lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    conf.write_text("\n".join(lines) + "\n")
    gpu_files = f"gpu[0-{gpus_per_node - 1}]" if gpus_per_node > 1 else "gpu0"
    (directory / "gres.conf").write_text(
        f"AutoDetect=off\nNodeName=node[0-{nodes - 1}] Name=gpu File={devices / gpu_files}\n"
    )
    if proctrack == "cgroup":
        (directory / "cgroup.conf").write_text(
            f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={CGROUP_ROOT}\n"
            "ConstrainCores=no\nConstrainDevices=no\nConstrainRAMSpace=no\n"
        )
    return SlurmCluster(
        directory=directory,
        proctrack=proctrack,
        conf=conf,
        node_ports=dict(zip(names, node_ports, strict=True)),
        node_addresses={name: f"127.0.{block}.{11 + index}" for index, name in enumerate(names)},
    )


def _make_gpu_device(path: Path) -> None:
    """gres.conf's File= must be a character device (a regular file is rejected): /dev/null's."""
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))


def _start(cluster: SlurmCluster, runtime: Path, daemons: list[_Daemon]) -> None:
    munge = runtime / "munge"
    env = os.environ | cluster.env
    log = cluster.directory / "log"

    def launch(name: str, *args: str, log_name: str) -> _Daemon:
        output = log / f"{log_name}.stderr"
        with output.open("wb") as sink:
            process = subprocess.Popen(
                [name, *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        daemon = _Daemon(log_name, process, log / f"{log_name}.log")
        daemons.append(daemon)
        return daemon

    launch(
        "munged",
        "--foreground",
        f"--socket={munge / 'munge.socket'}",
        f"--key-file={munge / 'munge.key'}",
        f"--pid-file={munge / 'munged.pid'}",
        f"--seed-file={munge / 'munged.seed'}",
        log_name="munged",
    )
    _wait_for(lambda: (munge / "munge.socket").exists(), "munged's socket", daemons)
    # -c: a fresh controller even where `directory` holds an earlier cluster's state
    launch("slurmctld", "-D", "-c", "-f", str(cluster.conf), log_name="slurmctld")
    for name in cluster.node_names:
        launch("slurmd", "-D", "-N", name, "-f", str(cluster.conf), log_name=f"slurmd.{name}")

    def all_idle() -> bool:
        try:  # sinfo retries for ~10 s while no controller answers
            result = cluster.client(
                "sinfo", "--noheader", "--Node", "--format=%N %t", check=False, timeout_s=2
            )
        except subprocess.TimeoutExpired:
            return False
        states = dict(line.split() for line in result.stdout.splitlines())
        return all(states.get(name) == "idle" for name in cluster.node_names)

    _wait_for(all_idle, "every node idle in sinfo", daemons)


def _die_with_parent() -> None:
    """In a daemon before exec: SIGKILL it when the test process dies (killed outright,
    no teardown), so that no cluster outlives its test run."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait_for(ready: Callable[[], bool], what: str, daemons: list[_Daemon]) -> None:
    """Until `ready()`; a daemon that exits or START_TIMEOUT_S passing is an error that
    shows the daemons' log tails (the exited ones', else all)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        exited = [daemon for daemon in daemons if daemon.process.poll() is not None]
        if exited:
            causes = ", ".join(f"{d.name} exited {d.process.returncode}" for d in exited)
            raise SlurmClusterError(f"waiting for {what}: {causes}\n{_log_tails(exited, 20)}")
        if ready():
            return
        if time.monotonic() > deadline:
            raise SlurmClusterError(
                f"waiting for {what}: timed out after {START_TIMEOUT_S:g} s\n"
                + _log_tails(daemons, 6)
            )
        time.sleep(0.2)


def _log_tails(daemons: list[_Daemon], lines: int) -> str:
    """The last `lines` of each daemon's log file (its stderr where it wrote none)."""
    tails = []
    for daemon in daemons:
        stderr = daemon.log.with_suffix(".stderr")
        path = daemon.log if daemon.log.exists() and daemon.log.stat().st_size else stderr
        if path.exists():
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {path}\n" + "\n".join(tail))
    return "\n".join(tails)


def _stop(cluster: SlurmCluster, daemons: list[_Daemon]) -> None:
    """Cancel the jobs, stop the daemons, kill what is left; each stage runs even when the
    one before fails or is interrupted (a test's timeout)."""
    job_ids: set[int] = set()
    try:
        _cancel_jobs(cluster, daemons, job_ids)
    finally:
        try:
            # slurmds first (they would try to re-register), munged last
            for names in (("slurmd",), ("slurmctld",), ("munged",)):
                _terminate([d.process for d in daemons if d.name.split(".")[0] in names])
        finally:
            _sweep(cluster)
            if cluster.proctrack == "cgroup":
                job_ids.update(int(_key_values(line)["JobId"]) for line in cluster._jobcomp_lines())
                _remove_job_cgroups(cluster, job_ids)


def _cancel_jobs(cluster: SlurmCluster, daemons: list[_Daemon], job_ids: set[int]) -> None:
    """scancel every job and wait until none is listed (or STOP_TIMEOUT_S passes)."""
    if not any(d.name == "slurmctld" and d.process.poll() is None for d in daemons):
        return
    try:
        job_ids.update(job.job_id for job in cluster.squeue())
        if job_ids:
            cluster.client("scancel", *map(str, sorted(job_ids)), check=False)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while cluster.squeue() and time.monotonic() < deadline:
            time.sleep(0.2)
    except (SlurmClusterError, subprocess.TimeoutExpired):
        pass  # a failing controller: the daemons and the sweep still go


def _terminate(processes: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL whatever still runs after `grace_s`; reaped either way."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _sweep(cluster: SlurmCluster) -> None:
    """SIGKILL what still carries this cluster's SLURM_CONF: slurmstepds and step tasks
    outlive a stopped slurmd, and a detached step child outlives its step (linuxproc)."""
    marker = cluster._env_marker()
    for _ in range(10):
        left = dict(_processes(marker))
        if not left:
            return
        for pid, command in left.items():
            entry = f"{pid} {command}"
            if entry not in cluster.killed_at_exit:
                cluster.killed_at_exit.append(entry)
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def _remove_job_cgroups(cluster: SlurmCluster, job_ids: set[int]) -> None:
    """The emptied step and job cgroups of this cluster's jobs that a killed slurmstepd
    left (the slurm_nodeK and uid folders stay: a concurrent cluster may use them)."""
    for name in cluster.node_names:
        node_root = CGROUP_ROOT / "freezer" / f"slurm_{name}"
        for job_id in job_ids:
            for job in node_root.glob(f"uid_*/job_{job_id}"):
                for step in job.glob("step_*"):
                    _rmdir(step)
                _rmdir(job)


def _rmdir(path: Path) -> None:
    with suppress(OSError):  # not empty: a process still in it
        path.rmdir()


def _processes(marker: bytes | None) -> Iterator[tuple[int, str]]:
    """(pid, command line) of live processes, only those whose environment holds `marker`
    when given; never this process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes()
            if not command:
                continue  # a kernel thread or a zombie
            if marker is not None and marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue  # gone meanwhile
        yield int(entry.name), command.replace(b"\0", b" ").decode(errors="replace").strip()


def _key_values(text: str) -> dict[str, str]:
    """`Key=Value Key=Value` as scontrol and jobcomp/filetxt print them."""
    pairs = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            pairs[key] = value
    return pairs
