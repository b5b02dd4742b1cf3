"""DockerSandbox: one hardened container per sandbox, commands run in it with `docker exec`.

The container is started once (its main process, run by docker's init, only sleeps) and
every command is an exec in it. By default the container has no network, no
capabilities, no privilege gain (no-new-privileges), no swap (memory + swap = memory), a
process cap, a CPU quota, a read-only root file system, a size-capped memory-backed /tmp
and a size-capped memory-backed working directory (a volume, so the archive API reaches
it). Commands run as the image's user (the TIR image's is uid 1000) unless `user` says
otherwise. Every container and volume carries the labels `opd.sandbox=1` and
`opd.owner=<owner>`, so `reap` can remove what a crashed run left behind.

Deadlines: docker's exec API has no timeout, so the output is read on a thread of its own
while the event loop keeps the clock; at the deadline (or when output passes its cap) a
second exec, as the same user, SIGKILLs every process in the container except its init
and the sleeping main process: the command, its children, those that left its process
group, and any background process of an earlier command. The result says timed_out,
exit code 137.

Limits of this backend, stated plainly:
- The kernel is shared with the host; isolation is docker's (namespaces, cgroups, the
  default seccomp profile), not a VM's.
- After a command exits, docker keeps its output open up to 2 s for background processes
  that still hold it; those processes keep running (until a deadline kill or close()).
- File transfer goes through the daemon, which resolves paths inside the container's root
  as root. Each component is checked (no symlinks, regular files only) before the
  transfer; a process running at that moment could still swap one in between, which
  exposes only the container's own files (the root is read-only by default).
- `limit_hit="memory"` is read from the daemon's OOM events for the container during the
  command (commands sharing a container share the attribution).
- Output counts only when its stream ends between frames after docker recorded the
  command's exit; a connection error, an end inside a frame, or an end while the command
  runs on (past a 0.5 s grace) is a SandboxDiedError. When docker notices a cut
  connection first (the command wrote to it), it records exit 126, which cannot be told
  from the command's own `exit 126`.
- Hostile input is the caller's or the command's failure, never the sandbox's: a command,
  cwd or environment no process can be given (a NUL byte, text that is not UTF-8, an
  empty or `=`-holding variable name, more than the kernel takes as arguments) is exit
  code 126 without an exec; a path the daemon cannot name or resolve is a
  SandboxFileError; `timeout_s` not positive and finite is a ValueError.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import math
import posixpath
import re
import secrets
import struct
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import docker.errors
import requests
from docker.types import Ulimit
from pydantic import BaseModel, ConfigDict, Field

from sandbox.base import (
    STEADY_PYTHON_ENV,
    ExecResult,
    LimitName,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxResourceError,
    SandboxStartError,
    SandboxUnavailableError,
    StartsAndCloses,
)
from sandbox.files import PATH_MAX
from sandbox.files import _components as workdir_components
from sandbox.jail import limit_from_exit
from sandbox.local import _cannot_execute, _unpassable
from sandbox.output import HeadTailBuffer

logger = logging.getLogger(__name__)

DEFAULT_IMAGE = "opd-sandbox-tir:latest"
SANDBOX_LABEL = "opd.sandbox"
OWNER_LABEL = "opd.owner"
BUILD_HINT = (
    "build it with `DOCKER_BUILDKIT=0 docker build -f docker/sandbox-tir.Dockerfile "
    f"-t {DEFAULT_IMAGE} docker/` (docker/README.md shows a base that needs no registry)"
)
# File-type bits of Go's os.FileMode, which the daemon's path stat reports.
_GO_MODE_DIR = 1 << 31
_GO_MODE_SYMLINK = 1 << 27
_GO_MODE_OTHER_TYPES = sum(1 << bit for bit in (26, 25, 24, 21, 19))  # devices, fifo, socket
_GO_MODE_NOT_REGULAR = _GO_MODE_DIR | _GO_MODE_SYMLINK | _GO_MODE_OTHER_TYPES
_NUMERIC_USER = re.compile(r"^(\d+):(\d+)$")
# docker's multiplexed output: each frame is a stream id (1 stdout, 2 stderr, 3 the
# daemon's own error), three padding bytes and the payload's length, then the payload.
_FRAME_HEADER = struct.Struct(">BxxxL")
_STDOUT, _STDERR, _DAEMON_ERROR = 1, 2, 3
_READ_BYTES = 64 * 1024
# moby records an exec's exit before it closes its output: output that ended while the
# command still runs was cut. The grace is for a daemon that records the exit late.
_EXIT_RECORD_GRACE_S = 0.5
DOCKER_FAILURES = (docker.errors.DockerException, requests.exceptions.RequestException)
"""What a call to the daemon raises when it fails (the SDK's errors and its HTTP client's)."""
MAX_ARG_STRLEN = 32 * 4096
"""Linux's limit on one argument or environment string, its terminating NUL included."""
NAME_MAX = 255
"""Linux's limit on one component of a path, in bytes."""
# What runc prints when execve refuses the arguments and environment as too long: an OCI
# error (exit 126), or the container's init's own line once it started (exit 1; runc 1.1).
_ARGUMENTS_TOO_LONG = re.compile(
    r"OCI runtime exec failed: .*argument list too long|^exec [^\n]*: argument list too long\n?$"
)

# Kills every process this user ($2) may signal except init (pid 1), the main process ($1)
# and itself. kill -1 is atomic against forks; the loop catches what it cannot reach (a
# root user must spare the main process, which runs as root too). Builtins only (a full
# pids cgroup refuses forks, but an exec still joins it), but for the pause between passes
# after the 20th: a killed process needs CPU time to go, scarce on a loaded machine (100
# passes without one failed in CI); a sleep that cannot fork fails at once, and the loop
# goes on as before. At most 20 + 280 passes, about 15 s.
_SWEEP = """
[ "$2" = 0 ] || kill -KILL -1 2>/dev/null
i=0
while [ "$i" -lt 300 ]; do
  left=
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case "$p" in 1|"$1"|"$$") continue ;; esac
    read -r _ _ state _ 2>/dev/null < "$d/stat" || continue
    [ "$state" = Z ] && continue
    kill -KILL "$p" 2>/dev/null && left=1
  done
  [ -z "$left" ] && exit 0
  i=$((i + 1))
  [ "$i" -gt 20 ] && sleep 0.05
done
exit 1
"""
# Who runs commands (numeric ids for tar headers), and the pid of the main process.
PROBE_KEEPER_S = 10.0
"""How long the probe waits for the container's init to have started its keeper process."""
_PROBE = """
id -u && id -g || exit 1
command -v "$0" >/dev/null || { echo "the image has no shell $0" >&2; exit 1; }
for d in /proc/[0-9]*; do
  read -r pid _ _ ppid _ 2>/dev/null < "$d/stat" && [ "$ppid" = 1 ] && echo "$pid"
done
exit 0
"""


class DockerSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: str = DEFAULT_IMAGE
    """Image to run; the default is built from docker/sandbox-tir.Dockerfile."""
    user: str | None = None
    """User commands run as ("name", "uid", "uid:gid"); None: the image's USER (root when
    it has none). The working directory is owned by it when the user is "uid:gid"."""
    workdir: str = Field(default="/work", pattern=r"^/")
    """Where commands start and where relative file paths point (absolute)."""
    workdir_size_mb: int | None = Field(default=512, ge=1)
    """Size of the fresh, memory-backed working directory; None keeps the image's own
    directory in the container's writable layer (needs read_only=False to write)."""
    tmp_size_mb: int = Field(default=64, ge=1)
    """Size of the memory-backed /tmp."""
    read_only: bool = True
    """Read-only root file system (only the working directory and /tmp are writable)."""
    network_mode: str = "none"
    """Docker network mode; "none" gives the container no network at all."""
    memory_mb: int = Field(default=2048, ge=16)
    """Memory of the whole container, tmpfs contents included; no swap beyond it."""
    max_processes: int = Field(default=256, ge=8)
    """Processes and threads in the container at once (pids cgroup)."""
    cpus: float = Field(default=1.0, gt=0)
    """CPU quota in cores."""
    open_files: int = Field(default=1024, ge=16)
    """Descriptors per process (RLIMIT_NOFILE)."""
    shell: str = "/bin/bash"
    """Runs each command as `shell -c CMD`."""
    env: dict[str, str] = Field(default_factory=dict)
    """Added to the container's environment (which holds nothing of the host's)."""
    owner: str = "default"
    """Value of the opd.owner label: which run owns the container, for `reap`."""
    labels: dict[str, str] = Field(default_factory=dict)
    """More labels on the container and its volume."""
    output_head_kb: int = Field(default=64, ge=0)
    """Kept from the start of each output stream."""
    output_tail_kb: int = Field(default=64, ge=0)
    """Kept from the end of each output stream."""
    max_output_mb: float = Field(default=32.0, gt=0)
    """Output (stdout + stderr) after which a command is killed as a flood."""
    max_read_file_mb: float = Field(default=64.0, gt=0)
    """Largest file `read_file` returns."""
    kill_grace_s: float = Field(default=5.0, gt=0)
    """How long the output may take to end after the processes were killed."""
    docker_url: str | None = None
    """Docker daemon URL (unix:// or tcp://); None: DOCKER_HOST or the local socket."""
    api_timeout_s: int = Field(default=60, ge=1)
    """HTTP timeout of each Docker API call (not of commands)."""


def docker_client(
    concurrency: int = 1, base_url: str | None = None, timeout_s: int = 60
) -> docker.DockerClient:
    """A client whose connection pool fits `concurrency` sandboxes sharing it: a running
    command's output holds one connection, a kill or file transfer another."""
    pool = 2 * concurrency + 1
    if base_url is None:
        return docker.from_env(timeout=timeout_s, max_pool_size=pool)
    return docker.DockerClient(base_url=base_url, timeout=timeout_s, max_pool_size=pool)


def unpassable_remotely(cmd: str, cwd: str | None, env: dict[str, str] | None) -> str | None:
    """Why `cmd`, `cwd` or `env` cannot reach a process in a container or VM, or None: the
    local sandbox's reasons, and more, since the API carries UTF-8 text (a surrogate
    escape's byte is lost on the way), runc refuses an empty variable name, and the
    kernel any one string of MAX_ARG_STRLEN or more."""
    if (problem := _unpassable(cmd, cwd, env)) is not None:
        return problem
    if env is not None and "" in env:
        return "an environment variable has an empty name"
    texts = [("the command", cmd), ("cwd", cwd or "")]
    texts += [("an environment variable", f"{name}={value}") for name, value in (env or {}).items()]
    for what, text in texts:
        try:
            size = len(text.encode())
        except UnicodeEncodeError as exc:
            return f"{what} is not UTF-8 text ({exc.reason})"
        if size >= MAX_ARG_STRLEN:
            return f"{what} is longer than the kernel takes as one string ({size:,} bytes)"
    return None


def remote_path_parts(workdir: str, path: str) -> list[str]:
    """`path` as components below `workdir` (the local sandbox's rules), refusing what an
    API that carries UTF-8 text cannot name and what no Linux file system takes."""
    parts = workdir_components(Path(workdir), path)
    try:
        full = posixpath.join(workdir, *parts).encode()
    except UnicodeEncodeError as exc:
        raise SandboxFileError(f"path {path!r} is not UTF-8 text ({exc.reason})") from None
    if len(full) >= PATH_MAX:
        raise SandboxFileError(f"path {path[:64]!r}... is longer than {PATH_MAX - 1} bytes")
    if any(len(part.encode()) > NAME_MAX for part in parts):
        raise SandboxFileError(f"path {path[:64]!r}... has a name over {NAME_MAX} bytes")
    return parts


def reap(labels: Mapping[str, str] | None = None, client: docker.DockerClient | None = None) -> int:
    """Remove every sandbox container (running or not) and volume carrying opd.sandbox=1
    and all of `labels` (e.g. {"opd.owner": run_id}); returns how many containers."""
    own_client = client is None
    client = client or docker_client()
    wanted = [f"{SANDBOX_LABEL}=1", *(f"{k}={v}" for k, v in (labels or {}).items())]
    selector: dict[str, str | list[str] | bool] = {"label": wanted}
    removed = 0
    try:
        for container in client.containers.list(all=True, filters=selector):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True, v=True)
                removed += 1
        for volume in client.volumes.list(filters=selector):
            try:
                volume.remove(force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as exc:  # in use by a container created meanwhile
                logger.warning("reap: volume %s not removed: %s", volume.name, exc)
    finally:
        if own_client:
            client.close()
    return removed


class _OutputReader(threading.Thread):
    """Reads one exec's output on a thread of its own (docker-py blocks) into head + tail
    buffers, and tells the event loop when the output ends or passes its cap.

    The output ends complete only at a frame boundary; a connection error or an end inside
    a frame fails `done` (docker-py's own iterator takes both for a normal end)."""

    def __init__(
        self,
        api: docker.APIClient,
        exec_id: str,
        head_bytes: int,
        tail_bytes: int,
        max_bytes: int,
    ) -> None:
        super().__init__(name=f"docker-exec-{exec_id[:12]}", daemon=True)
        self.api = api
        self.exec_id = exec_id
        self.stdout = HeadTailBuffer(head_bytes, tail_bytes)
        self.stderr = HeadTailBuffer(head_bytes, tail_bytes)
        self.max_bytes = max_bytes
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.flooded = asyncio.Event()
        self._lock = threading.Lock()
        self._stream: Any = None
        self._cancelled = False

    def run(self) -> None:
        try:
            stream = self.api.exec_start(self.exec_id, stream=True, demux=True)
            with self._lock:
                self._stream = stream
                if self._cancelled:
                    stream.close()
            self._read_frames(_buffered_output(stream))
        except BaseException as exc:
            # After cancel() the closed connection's error is ours, not the daemon's.
            self._tell(self._finish, None if self._cancelled else exc)
        else:
            self._tell(self._finish, None)

    def _read_frames(self, source: BinaryIO) -> None:
        flood_told = False
        while header := source.read(_FRAME_HEADER.size):
            if len(header) < _FRAME_HEADER.size:
                raise SandboxDiedError("the output stream ended inside a frame header")
            stream_id, left = _FRAME_HEADER.unpack(header)
            daemon_error = b""  # kept short: it becomes a message
            while left > 0:
                chunk = source.read(min(left, _READ_BYTES))
                if not chunk:
                    raise SandboxDiedError(f"the output stream ended {left} bytes into a frame")
                left -= len(chunk)
                if stream_id == _STDOUT:
                    self.stdout.feed(chunk)
                elif stream_id == _STDERR:
                    self.stderr.feed(chunk)
                elif stream_id == _DAEMON_ERROR:
                    daemon_error = (daemon_error + chunk)[:1024]
                else:
                    raise SandboxDiedError(f"unknown stream {stream_id} in the output")
            if stream_id == _DAEMON_ERROR:
                text = daemon_error.decode(errors="replace").strip()
                raise SandboxDiedError(f"docker reported in the output stream: {text}")
            total = self.stdout.total_bytes + self.stderr.total_bytes
            if total > self.max_bytes and not flood_told:
                flood_told = True
                self._tell(self.flooded.set)

    def _finish(self, exc: BaseException | None) -> None:
        if self.done.done():
            return
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)

    def _tell(self, callback: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            self.loop.call_soon_threadsafe(callback, *args)

    def cancel(self) -> None:
        """Stop reading: closes the connection, which ends the thread."""
        with self._lock:
            self._cancelled = True
            if self._stream is not None:
                self._stream.close()


def _buffered_output(stream: Any) -> BinaryIO:
    """The buffered reader over an exec's upgraded connection (docker-py's CancellableStream
    -> requests -> urllib3 -> http.client), to read the output from. docker-py reads the
    socket beneath it and loses what http.client buffered with the response headers: all of
    a quick command's output when the client reads late (docker/docker-py#2042)."""
    try:
        reader: BinaryIO = stream._response.raw._fp.fp
        sock = reader.raw._sock  # type: ignore[attr-defined]
    except AttributeError as exc:
        raise SandboxUnavailableError(
            f"cannot read a command's output over this connection ({exc}): docker_url must "
            "be a unix:// or tcp:// address"
        ) from exc
    sock.settimeout(None)  # the event loop keeps the deadline; cancel() closes the socket
    return reader


class DockerSandbox(StartsAndCloses):
    """A hardened container; commands run with `shell -c` in the working directory."""

    def __init__(
        self, config: DockerSandboxConfig | None = None, client: docker.DockerClient | None = None
    ) -> None:
        """`client`: a shared client (see `docker_client`), closed by its owner; without
        one the sandbox opens and closes its own."""
        self.config = config or DockerSandboxConfig()
        self._client = client
        self._own_client = client is None
        self._container_id: str | None = None
        self._volume: str | None = None
        self._user = ""
        self._uid = self._gid = 0
        self._keeper_pid = 0
        self._start_lock = asyncio.Lock()
        self._closed = False

    @property
    def labels(self) -> dict[str, str]:
        return {SANDBOX_LABEL: "1", OWNER_LABEL: self.config.owner, **self.config.labels}

    @property
    def container_id(self) -> str:
        if self._closed:
            raise SandboxClosedError("the sandbox is closed")
        if self._container_id is None:
            raise SandboxStartError("the sandbox is not started: await start() first")
        return self._container_id

    @property
    def _api(self) -> docker.APIClient:
        if self._client is None:  # an own client exists from start() to close()
            if self._closed:
                raise SandboxClosedError("the sandbox is closed")
            raise SandboxStartError("the sandbox is not started: await start() first")
        return self._client.api

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise SandboxClosedError("the sandbox is closed")
            if self._container_id is not None:
                return
            starting = asyncio.ensure_future(asyncio.to_thread(self._start))
            try:
                await asyncio.shield(starting)
            except BaseException:
                await asyncio.shield(self._undo_start(starting))
                raise

    async def _undo_start(self, starting: asyncio.Future[None]) -> None:
        """Remove what a failed or cancelled start created; the thread runs on after a
        cancellation, so it is waited for first."""
        with contextlib.suppress(BaseException):
            await starting
        await asyncio.to_thread(self._remove)

    def _start(self) -> None:
        cfg = self.config
        if self._client is None:
            try:
                self._client = docker_client(1, cfg.docker_url, cfg.api_timeout_s)
            except DOCKER_FAILURES as exc:
                where = cfg.docker_url or "DOCKER_HOST or the local socket"
                raise SandboxUnavailableError(
                    f"no Docker daemon answers at {where}: {exc}; start dockerd (.ci/run "
                    "shows how) or set docker_url"
                ) from exc
        try:
            image = self._client.images.get(cfg.image)
        except docker.errors.ImageNotFound as exc:
            hint = BUILD_HINT if cfg.image == DEFAULT_IMAGE else "pull or build it first"
            message = f"the sandbox image {cfg.image} is not present: {hint}"
            raise SandboxStartError(message) from exc
        except DOCKER_FAILURES as exc:
            raise SandboxStartError(f"cannot inspect the image {cfg.image}: {exc}") from exc
        image_user = (image.attrs.get("Config") or {}).get("User")
        self._user = cfg.user if cfg.user is not None else image_user or "0"
        name = f"opd-sandbox-{secrets.token_hex(6)}"
        mounts: dict[str, dict[str, str]] = {}
        try:
            if cfg.workdir_size_mb is not None:
                self._volume = self._create_workdir_volume(f"{name}-work")
                mounts[self._volume] = {"bind": cfg.workdir, "mode": "rw"}
            container = self._client.containers.create(
                str(image.id),
                ["sleep", "infinity"],
                name=name,
                # The sleeper's uid differs from the commands', which have no CAP_KILL: no
                # command (not even `kill -9 -1` as root) can end the sandbox.
                user="65534:65534" if self._user in ("0", "0:0", "root") else "0:0",
                working_dir=cfg.workdir,
                environment={"HOME": cfg.workdir, "TMPDIR": "/tmp", **STEADY_PYTHON_ENV, **cfg.env},
                labels=self.labels,
                volumes=mounts,
                tmpfs={"/tmp": f"rw,nosuid,nodev,size={cfg.tmp_size_mb}m,mode=1777"},
                read_only=cfg.read_only,
                network_mode=cfg.network_mode,
                mem_limit=f"{cfg.memory_mb}m",
                memswap_limit=f"{cfg.memory_mb}m",
                pids_limit=cfg.max_processes,
                nano_cpus=int(cfg.cpus * 1e9),
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                init=True,
                ulimits=[
                    Ulimit(name="nofile", soft=cfg.open_files, hard=cfg.open_files),
                    Ulimit(name="core", soft=0, hard=0),
                ],
            )
            self._container_id = container.id  # removed by _remove if it fails to start
            container.start()
        except DOCKER_FAILURES as exc:
            raise SandboxStartError(f"cannot start a container from {cfg.image}: {exc}") from exc
        self._probe()

    def _create_workdir_volume(self, name: str) -> str:
        assert self._client is not None and self.config.workdir_size_mb is not None
        options = f"size={self.config.workdir_size_mb}m"
        if owner := _NUMERIC_USER.match(self._user):
            options += f",uid={owner[1]},gid={owner[2]},mode=0755"
        self._client.volumes.create(
            name=name,
            driver="local",
            driver_opts={"type": "tmpfs", "device": "tmpfs", "o": options},
            labels=self.labels,
        )
        return name

    def _probe(self) -> None:
        """Learn the user's ids and the main process; refuse an image that cannot run
        commands as configured."""
        deadline = time.monotonic() + PROBE_KEEPER_S
        while True:
            try:
                exit_code, out = self._run_quick(["/bin/sh", "-c", _PROBE, self.config.shell])
            except DOCKER_FAILURES as exc:
                raise SandboxStartError(
                    f"cannot run a command in the new container: {exc}"
                ) from exc
            lines = out.decode(errors="replace").split()
            # the ids, but no keeper yet: under load the init may not have started it
            waiting = exit_code == 0 and len(lines) == 2 and all(x.isdigit() for x in lines)
            if not waiting or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if exit_code != 0 or len(lines) < 3 or not all(x.isdigit() for x in lines[:3]):
            raise SandboxStartError(
                f"the image {self.config.image} cannot run commands as user "
                f"{self._user!r} with {self.config.shell}: {out.decode(errors='replace')}"
            )
        self._uid, self._gid, self._keeper_pid = (int(x) for x in lines[:3])

    def _run_quick(self, argv: list[str]) -> tuple[int, bytes]:
        """A short helper command as the sandbox user, output merged."""
        exec_id = self._api.exec_create(self.container_id, argv, user=self._user)["Id"]
        output = self._api.exec_start(exec_id)
        exit_code = self._api.exec_inspect(exec_id)["ExitCode"]
        return (-1 if exit_code is None else exit_code), output

    async def is_alive(self) -> bool:
        if self._closed or self._container_id is None:
            return False
        try:
            return await asyncio.to_thread(self._running)
        except SandboxError:
            return False

    def _running(self) -> bool:
        try:
            state = self._api.inspect_container(self.container_id)["State"]
        except docker.errors.NotFound:
            return False
        except DOCKER_FAILURES as exc:
            raise SandboxDiedError(f"the Docker daemon did not answer: {exc}") from exc
        return bool(state.get("Running")) and not state.get("Paused")

    def _require_running(self) -> None:
        """The daemon copies files in and out of a stopped container too; a sandbox whose
        commands cannot run is dead for files as well."""
        if not self._running():
            raise SandboxDiedError(f"the container {self._container_id} is gone or stopped")

    async def close(self) -> None:
        if self._closed:
            return
        async with self._start_lock:
            self._closed = True
            await asyncio.to_thread(self._remove)

    def _remove(self) -> None:
        """Remove the container and its volume; failures are logged (`reap` finds them)."""
        if self._client is None:
            return
        try:
            if self._container_id is not None:
                with contextlib.suppress(docker.errors.NotFound):
                    self._api.remove_container(self._container_id, force=True, v=True)
            if self._volume is not None:
                with contextlib.suppress(docker.errors.NotFound):
                    self._api.remove_volume(self._volume, force=True)
        except DOCKER_FAILURES as exc:
            logger.warning(
                "sandbox container %s left behind (reap(%r) removes it): %s",
                self._container_id,
                {OWNER_LABEL: self.config.owner},
                exc,
            )
        finally:
            self._container_id = self._volume = None
            if self._own_client:
                self._client.close()
                self._client = None

    # -- commands --------------------------------------------------------------------------

    async def exec(
        self,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run `cmd` with the shell in the working directory (or `cwd`, relative to it)."""
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
        await self.start()
        started = time.monotonic()
        if (problem := unpassable_remotely(cmd, cwd, env)) is not None:
            return _cannot_execute(problem, started)
        argv = [self.config.shell, "-c", cmd]
        if cwd is not None:
            # cd inside the command, so a missing directory is the command's failure; a
            # lone "-" would be cd's previous directory.
            cd_then_run = 'cd -- "$2" || exit 1; exec "$1" -c "$3"'
            target = "./-" if cwd == "-" else cwd
            argv = ["/bin/sh", "-c", cd_then_run, "sh", self.config.shell, target, cmd]
        exec_id = await asyncio.to_thread(
            self._call, "start a command", self._create_exec, argv, env
        )
        cfg = self.config
        reader = _OutputReader(
            self._api,
            exec_id,
            cfg.output_head_kb * 1024,
            cfg.output_tail_kb * 1024,
            int(cfg.max_output_mb * 1024 * 1024),
        )
        reader.start()
        try:
            killed_for = await self._await_output(
                exec_id, reader, timeout_s - (time.monotonic() - started)
            )
        except asyncio.CancelledError:
            reader.cancel()
            await asyncio.shield(asyncio.to_thread(self._sweep_quietly))
            raise
        ended = time.monotonic()
        exit_code = await asyncio.to_thread(
            self._call, "inspect a command", self._exit_code, exec_id
        )
        return await self._result(reader, exit_code, killed_for, started, ended)

    async def _await_output(
        self, exec_id: str, reader: _OutputReader, timeout_s: float
    ) -> LimitName | None:
        """Wait for the output to end; at the deadline, or when the output passes its cap,
        kill the command (and everything else the user runs). Returns the limit it was
        killed for."""
        flooded: asyncio.Future[Any] = asyncio.ensure_future(reader.flooded.wait())
        try:
            done, _ = await asyncio.wait(
                {reader.done, flooded},
                timeout=max(timeout_s, 0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            flooded.cancel()
        killed_for: LimitName | None = None
        if reader.done not in done:
            if flooded in done:
                killed_for = "output"
            elif await asyncio.to_thread(
                self._call, "inspect a command", self._exec_running, exec_id
            ):
                killed_for = "wall_time"
            # else it exited in time; docker holds its output open a moment longer for
            # background processes that still write to it.
            if killed_for is not None:
                await asyncio.to_thread(self._call, "kill a command", self._sweep)
            try:
                await asyncio.wait_for(asyncio.shield(reader.done), self.config.kill_grace_s)
            except asyncio.TimeoutError:
                reader.cancel()
                if killed_for is not None:
                    raise SandboxDiedError(
                        f"the command's output did not end {self.config.kill_grace_s} s after "
                        "its processes were killed"
                    ) from None
        await self._reraise(reader.done)
        return killed_for

    def _exec_running(self, exec_id: str) -> bool:
        return bool(self._api.exec_inspect(exec_id).get("Running"))

    def _create_exec(self, argv: list[str], env: dict[str, str] | None) -> str:
        created = self._api.exec_create(
            self.container_id, argv, user=self._user, environment=env, workdir=self.config.workdir
        )
        return str(created["Id"])

    async def _reraise(self, done: asyncio.Future[None]) -> None:
        """The reader thread's failure (docker's, or the connection's) as a SandboxError."""
        try:
            await done
        except Exception as exc:
            raise await asyncio.to_thread(self._infrastructure_error, "read output", exc) from exc

    def _sweep(self) -> None:
        argv = ["/bin/sh", "-c", _SWEEP, "sweep", str(self._keeper_pid), str(self._uid)]
        exit_code, output = self._run_quick(argv)
        if exit_code != 0:
            raise SandboxDiedError(
                f"could not kill the sandbox's processes (exit {exit_code}): {output!r}"
            )

    def _sweep_quietly(self) -> None:
        with contextlib.suppress(*DOCKER_FAILURES, SandboxError):
            self._sweep()

    def _exit_code(self, exec_id: str) -> int | None:
        """The command's exit code once docker records it; None when docker still reports
        it running after a short grace."""
        deadline = time.monotonic() + _EXIT_RECORD_GRACE_S
        while True:
            info = self._api.exec_inspect(exec_id)
            if not info.get("Running") or time.monotonic() > deadline:
                code = info.get("ExitCode")
                return None if code is None else int(code)
            time.sleep(0.02)

    async def _result(
        self,
        reader: _OutputReader,
        exit_code: int | None,
        killed_for: LimitName | None,
        started: float,
        ended: float,
    ) -> ExecResult:
        stdout, stderr = reader.stdout.text(), reader.stderr.text()
        if exit_code is None and killed_for is not None:
            exit_code = 137
        if exit_code is None or exit_code >= 128:
            if not await asyncio.to_thread(self._running):
                raise SandboxDiedError(f"the container {self._container_id} stopped")
            if exit_code is None:
                raise SandboxDiedError(
                    "the command's output ended while docker still reported it running: the "
                    "connection to the daemon was cut and the output is incomplete"
                )
        if exit_code in (1, 126) and _ARGUMENTS_TOO_LONG.search(stdout + stderr):
            return _cannot_execute(
                "the command and its environment are longer than the kernel takes", started
            )
        if exit_code in (126, 127) and "OCI runtime exec failed" in stdout + stderr:
            message = f"docker could not run the command: {(stdout + stderr).strip()}"
            if "resource temporarily unavailable" in message.lower():
                raise SandboxResourceError(message)
            raise SandboxDiedError(message)
        limit = killed_for or limit_from_exit(exit_code, stderr)
        if limit is None and exit_code == 137:
            limit = await asyncio.to_thread(self._call, "read events", self._oom_since, started)
        return ExecResult(
            exit_code=exit_code,
            stdout=stdout,
            stderr=stderr,
            stdout_truncated=reader.stdout.truncated,
            stderr_truncated=reader.stderr.truncated,
            stdout_bytes=reader.stdout.total_bytes,
            stderr_bytes=reader.stderr.total_bytes,
            timed_out=killed_for == "wall_time",
            limit_hit=limit,
            duration_s=ended - started,
        )

    def _oom_since(self, started_monotonic: float) -> LimitName | None:
        """The memory limit, when the kernel's OOM killer acted in the container during the
        command. The daemon counts whole seconds and the event may trail the exit a little:
        the query waits for the next second to begin."""
        now = time.time()
        events = self._api.events(
            since=int(now - (time.monotonic() - started_monotonic)) - 1,
            until=int(now) + 1,
            filters={"container": self.container_id, "event": "oom"},
            decode=True,
        )
        return "memory" if any(True for _ in events) else None

    def _call(self, action: str, function: Any, *args: Any) -> Any:
        """`function(*args)` with docker's failures turned into SandboxErrors."""
        try:
            return function(*args)
        except DOCKER_FAILURES as exc:
            raise self._infrastructure_error(action, exc) from exc

    def _infrastructure_error(self, action: str, exc: BaseException) -> SandboxError:
        if isinstance(exc, requests.exceptions.ConnectionError):
            return SandboxDiedError(f"cannot {action}: the Docker daemon is unreachable: {exc}")
        with contextlib.suppress(SandboxError):
            if not self._running():
                return SandboxDiedError(f"cannot {action}: the container is gone or stopped")
        return SandboxDiedError(f"cannot {action}: {exc}")

    # -- files -----------------------------------------------------------------------------

    async def write_file(self, path: str, data: bytes) -> None:
        await self.start()
        parts = remote_path_parts(self.config.workdir, path)
        await asyncio.to_thread(self._call, "write a file", self._write, path, parts, data)

    def _write(self, path: str, parts: list[str], data: bytes) -> None:
        self._require_running()
        missing = self._check_parents(path, parts, create=True)
        final = None if missing else self._stat(posixpath.join(self.config.workdir, *parts))
        if final is not None and final["mode"] & _GO_MODE_NOT_REGULAR:
            kind = "a symlink" if final["mode"] & _GO_MODE_SYMLINK else "not a regular file"
            raise SandboxFileError(f"cannot write {path!r}: it is {kind}")
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            for depth in range(len(parts) - missing, len(parts)):
                tar.addfile(self._tar_entry("/".join(parts[:depth]), tarfile.DIRTYPE, 0o755))
            member = self._tar_entry("/".join(parts), tarfile.REGTYPE, 0o644)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
        try:
            self._api.put_archive(self.container_id, self.config.workdir, archive.getvalue())
        except docker.errors.APIError as exc:
            if self._running():
                raise SandboxFileError(f"cannot write {path!r}: {exc.explanation}") from exc
            raise

    def _tar_entry(self, name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        entry = tarfile.TarInfo(name)
        entry.type, entry.mode, entry.mtime = kind, mode, int(time.time())
        entry.uid, entry.gid = self._uid, self._gid
        return entry

    async def read_file(self, path: str) -> bytes:
        await self.start()
        parts = remote_path_parts(self.config.workdir, path)
        data: bytes = await asyncio.to_thread(self._call, "read a file", self._read, path, parts)
        return data

    def _read(self, path: str, parts: list[str]) -> bytes:
        self._require_running()
        self._check_parents(path, parts, create=False)
        full = posixpath.join(self.config.workdir, *parts)
        info = self._stat(full)
        max_bytes = int(self.config.max_read_file_mb * 1024 * 1024)
        if info is None:
            raise SandboxFileError(f"cannot read {path!r}: No such file or directory")
        if info["mode"] & _GO_MODE_SYMLINK:
            raise SandboxFileError(f"cannot read {path!r}: a component is a symlink")
        if info["mode"] & _GO_MODE_NOT_REGULAR:
            raise SandboxFileError(f"{path!r} is not a regular file")
        if info["size"] > max_bytes:
            raise SandboxFileError(
                f"{path!r} is {info['size']:,} bytes, over the {max_bytes:,} limit"
            )
        chunks, received = [], 0
        try:
            stream, _ = self._api.get_archive(self.container_id, full)
        except docker.errors.NotFound as exc:  # removed since the stat
            raise SandboxFileError(f"cannot read {path!r}: No such file or directory") from exc
        for chunk in stream:
            chunks.append(chunk)
            received += len(chunk)
            if received > max_bytes + 64 * 1024:  # tar headers and padding are small
                raise SandboxFileError(
                    f"{path!r} grew past the {max_bytes:,} byte limit while read"
                )
        return file_from_archive(b"".join(chunks), path, max_bytes)

    def _check_parents(self, path: str, parts: list[str], create: bool) -> int:
        """Refuse a parent that is a symlink or not a directory; returns how many of the
        deepest parents are missing (an error unless `create`)."""
        for depth in range(1, len(parts)):
            info = self._stat(posixpath.join(self.config.workdir, *parts[:depth]))
            if info is None:
                if create:
                    return len(parts) - depth
                raise SandboxFileError(f"cannot read {path!r}: No such file or directory")
            if info["mode"] & _GO_MODE_SYMLINK:
                raise SandboxFileError(f"cannot access {path!r}: a component is a symlink")
            if not info["mode"] & _GO_MODE_DIR:
                raise SandboxFileError(f"cannot access {path!r}: a component is not a directory")
        return 0

    def _stat(self, container_path: str) -> dict[str, Any] | None:
        """The daemon's lstat of a path in the container (HEAD of the archive endpoint),
        None when it does not exist."""
        api = self._api
        url = f"{api.base_url}/v{api.api_version}/containers/{self.container_id}/archive"
        response = api.head(url, params={"path": container_path}, timeout=api.timeout)
        if response.status_code == 404:  # callers checked that the container runs
            return None
        if not response.ok and self._running():
            # A HEAD answer has no message; the daemon's log says why (e.g. over 255
            # components, which its scoped path resolution refuses).
            raise SandboxFileError(
                f"the Docker daemon cannot resolve {container_path!r} (HTTP {response.status_code})"
            )
        response.raise_for_status()
        try:
            header = response.headers["X-Docker-Container-Path-Stat"]
            stat: dict[str, Any] = json.loads(base64.b64decode(header))
            stat["mode"], stat["size"] = int(stat["mode"]), int(stat["size"])
        except (KeyError, TypeError, ValueError) as exc:  # binascii and JSON errors included
            raise SandboxDiedError(
                f"the Docker daemon's stat of {container_path!r} is malformed: {exc!r}"
            ) from exc
        return stat


def file_from_archive(archive: bytes, path: str, max_bytes: int) -> bytes:
    """The one regular file in `archive`, the daemon's tar of `path`. A stream cut short
    (the file shrank or was replaced while the daemon copied it) or otherwise malformed is
    a SandboxFileError."""
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
            member = tar.next()
            if member is None or not member.isreg():
                raise SandboxFileError(f"{path!r} is not a regular file")
            if member.size > max_bytes:
                raise SandboxFileError(
                    f"{path!r} grew past the {max_bytes:,} byte limit while read"
                )
            extracted = tar.extractfile(member)
            assert extracted is not None
            return extracted.read()
    except (tarfile.TarError, EOFError) as exc:
        raise SandboxFileError(
            f"cannot read {path!r}: it changed while it was read ({exc})"
        ) from exc
