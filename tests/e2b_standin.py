"""A local STAND-IN for the E2B SDK's `AsyncSandbox`, faked at the SDK's public object
boundary (not at its HTTP / Connect-RPC transport, which is too deep to fake faithfully).

What is real: the SDK's own exception classes and the SDK's own functions that build
them from status codes (`api_exception_from_code`, `format_sandbox_unavailable_exception`,
envd's RPC error map), its result and info types (`CommandResult`, `CommandExitException`,
`EntryInfo`, `SandboxInfo`, `SandboxQuery`) and its instance-or-class `kill`. Commands
really run: `bash -c CMD` on this host, in a directory that stands for the sandbox's file
system, each in a process group of its own.

What is faked, and the assumptions behind it:
- The control plane (create, set_timeout, kill, list) is an in-memory `StandInCloud`: a
  sandbox lives until `kill` or until its lifetime (`timeout` at creation, reset to
  now + N by `set_timeout(N)`) passes on the cloud's clock (a `FakeClock` in tests).
  Errors come as the SDK raises them for the API's answers: 401 without a valid key,
  404 for an unknown template, 400 for a lifetime over 24 h, SandboxNotFoundException
  for set_timeout on a gone sandbox, False from kill.
- envd: a request to a gone sandbox raises SandboxNotRunningException (the proxy's 502
  "was not found"); a command's stream past its `timeout` raises TimeoutException
  (DEADLINE_EXCEEDED) and the process keeps running (assumed of envd); a command killed
  by a signal ends with exit code -1 and error "signal: killed" (Go's ProcessState, as
  assumed of envd); `commands.kill(pid)` SIGKILLs that pid only.
- Paths: absolute sandbox paths map below the stand-in's root directory; relative ones
  are relative to /home/user (the SDK's rule for the default user). Commands see host
  paths, so tests use paths relative to the working directory.
- `kill ... -1` inside a command (a VM's "every process of mine") would reach the test
  runner's processes on this host: a `kill` shell function (through BASH_ENV) records
  it instead, and when the caller exits the stand-in SIGKILLs every process group of
  that sandbox but the caller's (another command ending first leaves the request alone,
  so the caller is never killed by its own sweep). Commands not run by bash (sh
  scripts, /bin/kill) are not guarded: tests must not use them to kill -1.
- `honor_stream_timeout=False` makes streams ignore their timeout (a stuck stream);
  `fail_next(operation, exc)` makes the next call of an operation raise `exc` (create,
  set_timeout, kill, list, is_running, run, stream, make_dir, get_info, read, write).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import datetime
import inspect
import itertools
import os
import posixpath
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from connectrpc.code import Code
from e2b import (
    AuthenticationException,
    CommandExitException,
    CommandResult,
    EntryInfo,
    FileNotFoundException,
    FileType,
    InvalidArgumentException,
    SandboxInfo,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
    WriteInfo,
)
from e2b.api import api_exception_from_code
from e2b.connection_config import ApiParams
from e2b.envd.rpc import _DEFAULT_RPC_ERROR_MAP
from e2b.exceptions import format_sandbox_unavailable_exception
from e2b.sandbox.utils import class_method_variant

STANDIN_API_KEY = "e2b_standin_0000000000000000000000000000000000000000"
MAX_LIFETIME_S = 86_400
_API_PARAMS = set(ApiParams.__annotations__)
_GO_SIGNAL_NAMES = {
    signal.SIGKILL: "killed",
    signal.SIGTERM: "terminated",
    signal.SIGINT: "interrupt",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded",
}
_KILL_GUARD = """kill() {
  local arg
  for arg in "$@"; do
    if [ "$arg" = -1 ]; then
      echo "$$" >> "$E2B_STANDIN_KILL_ALL"
      return 0
    fi
  done
  builtin kill "$@"
}
export -f kill
"""


class FakeClock:
    """Seconds that pass only when told: `advance(s)`, or `sleep(s)`, which advances the
    clock by `s` at once (sleepers are not interleaved: concurrent sleeps add up)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += max(seconds, 0.0)
        await asyncio.sleep(0)


class _SandboxState:
    """One stand-in sandbox: its lifetime, metadata, file system root and processes."""

    def __init__(
        self,
        cloud: StandInCloud,
        sandbox_id: str,
        template: str,
        lifetime_s: int,
        metadata: dict[str, str],
        envs: dict[str, str],
    ) -> None:
        self.cloud = cloud
        self.sandbox_id = sandbox_id
        self.template = template
        self.metadata = metadata
        self.envs = envs
        self.started_at = datetime.datetime.now(datetime.timezone.utc)
        self.ends_at = cloud.clock() + lifetime_s
        self.killed = False
        self.root = cloud.root / sandbox_id
        (self.root / "home" / "user").mkdir(parents=True)
        (self.root / "tmp").mkdir()
        self.kill_all_file = self.root / ".standin-kill-all"
        self.process_groups: set[int] = set()
        self.drains: set[asyncio.Task[None]] = set()
        """Each command's reading of its pipes and exit status (see reap_processes)."""

    @property
    def alive(self) -> bool:
        return not self.killed and self.cloud.clock() < self.ends_at

    def require_envd(self) -> None:
        """What envd's proxy answers for a sandbox that is gone."""
        if not self.alive:
            raise format_sandbox_unavailable_exception(
                f"The sandbox {self.sandbox_id} was not found"
            )

    def host_path(self, path: str, user: str | None) -> Path:
        home = "/root" if user == "root" else "/home/user"
        normal = posixpath.normpath(posixpath.join(home, path))
        return self.root / normal.lstrip("/")

    def confined(self, host: Path) -> Path:
        """`host` with links resolved, refused when it leaves the sandbox's root."""
        resolved = host.resolve()
        if resolved != self.root and self.root not in resolved.parents:
            raise InvalidArgumentException(f"{host} leaves the stand-in sandbox's root")
        return resolved

    def take_kill_all(self, pid: int) -> bool:
        """Whether the command `pid` asked for `kill -1` (it takes effect when that
        command has exited, and spares it, as the kernel spares kill(-1)'s caller). Only
        the asker's own exit consumes its request: another command ending first must not
        act on it (it would kill the asker)."""
        if not self.kill_all_file.exists():
            return False
        askers = self.kill_all_file.read_text().split()
        if str(pid) not in askers:
            return False
        rest = [asker for asker in askers if asker != str(pid)]
        if rest:
            self.kill_all_file.write_text("".join(f"{asker}\n" for asker in rest))
        else:
            self.kill_all_file.unlink()
        return True

    def kill_processes(self, spare: int | None = None) -> None:
        for pgid in list(self.process_groups):
            if pgid == spare:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    def kill(self) -> None:
        self.killed = True
        self.kill_processes()

    async def reap_processes(self) -> None:
        """Wait for the killed processes and their pipes while the event loop that started
        them runs (asyncio cannot close them after it)."""
        await asyncio.gather(*self.drains, return_exceptions=True)
        self.drains.clear()

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            sandbox_id=self.sandbox_id,
            sandbox_domain=None,
            template_id=self.template,
            name=self.template,
            metadata=dict(self.metadata),
            started_at=self.started_at,
            end_at=self.started_at,
            state=SandboxState.RUNNING,
            cpu_count=2,
            memory_mb=512,
            envd_version="0.6.2",
        )


class StandInCloud:
    """An E2B account's sandboxes, in memory; `AsyncSandbox` is the stand-in SDK class
    bound to this account (pass it as `sdk=`)."""

    def __init__(
        self,
        root: Path,
        clock: Callable[[], float] = time.monotonic,
        api_key: str = STANDIN_API_KEY,
        templates: tuple[str, ...] = ("base",),
        page_size: int = 100,
        honor_stream_timeout: bool = True,
    ) -> None:
        self.root = root
        self.honor_stream_timeout = honor_stream_timeout
        """False: command streams ignore their `timeout` (to test a client's own deadline)."""
        self.clock = clock
        self.api_key = api_key
        self.templates = set(templates)
        self.page_size = page_size
        self.sandboxes: dict[str, _SandboxState] = {}
        self.created: list[dict[str, Any]] = []
        """Each create's arguments, with "at" (the clock then)."""
        self.set_timeouts: list[tuple[str, int, float]] = []
        """(sandbox_id, timeout, clock) of each set_timeout that reached the API."""
        self.commands: list[tuple[str, str]] = []
        """(sandbox_id, cmd) of each command started."""
        self.killed_pids: list[int] = []
        self.failures: dict[str, list[BaseException]] = {}
        self._ids = itertools.count(1)
        guard = root / ".standin-kill-guard.sh"
        guard.write_text(_KILL_GUARD)
        self.kill_guard = guard
        self.AsyncSandbox: type[StandInAsyncSandbox] = type(
            "AsyncSandbox", (StandInAsyncSandbox,), {"cloud": self}
        )

    def fail_next(self, operation: str, exc: BaseException) -> None:
        self.failures.setdefault(operation, []).append(exc)

    def maybe_fail(self, operation: str) -> None:
        pending = self.failures.get(operation)
        if pending:
            raise pending.pop(0)

    def running(self) -> list[str]:
        return [sid for sid, state in self.sandboxes.items() if state.alive]

    def state(self, sandbox_id: str) -> _SandboxState:
        return self.sandboxes[sandbox_id]

    def check_key(self, opts: dict[str, Any]) -> None:
        unknown = set(opts) - _API_PARAMS
        if unknown:
            raise TypeError(f"unexpected connection options {sorted(unknown)}")
        api_key = opts.get("api_key") or os.environ.get("E2B_API_KEY")
        if api_key is None:
            raise AuthenticationException(
                "API key is required, please visit the Team tab at https://e2b.dev/dashboard "
                "to get your API key. You can either set the environment variable `E2B_API_KEY` "
                'or you can pass it directly to the method like api_key="e2b_..."'
            )
        if api_key != self.api_key:
            raise api_exception_from_code(401, "Invalid API key")

    def close(self) -> None:
        """Kill every process of every sandbox and remove their files."""
        for state in self.sandboxes.values():
            state.kill()
        shutil.rmtree(self.root, ignore_errors=True)


class StandInAsyncSandbox:
    """`e2b.AsyncSandbox`'s public surface used by sandbox.e2b, over a StandInCloud."""

    cloud: ClassVar[StandInCloud]
    default_template = "base"

    def __init__(self, state: _SandboxState) -> None:
        self._state = state
        self.sandbox_id = state.sandbox_id
        self.commands = StandInCommands(state)
        self.files = StandInFilesystem(state)

    @classmethod
    async def create(
        cls,
        template: str | None = None,
        timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        envs: dict[str, str] | None = None,
        secure: bool | None = None,
        allow_internet_access: bool | None = None,
        mcp: Any = None,
        network: Any = None,
        iam: Any = None,
        lifecycle: Any = None,
        volume_mounts: Any = None,
        logger: Any = None,
        idempotency_key: str | None = None,
        **opts: Any,
    ) -> StandInAsyncSandbox:
        cloud = cls.cloud
        await asyncio.sleep(0)
        cloud.check_key(opts)
        template = template or cls.default_template
        lifetime_s = 300 if timeout is None else timeout
        cloud.created.append(
            {
                "template": template,
                "timeout": timeout,
                "metadata": metadata,
                "envs": envs,
                "allow_internet_access": allow_internet_access,
                "at": cloud.clock(),
                **opts,
            }
        )
        cloud.maybe_fail("create")
        if template not in cloud.templates:
            raise api_exception_from_code(404, f"template '{template}' not found")
        if lifetime_s > MAX_LIFETIME_S:
            raise api_exception_from_code(400, "Timeout cannot be greater than 24 hours")
        sandbox_id = f"standin{next(cloud._ids):04d}"
        state = _SandboxState(
            cloud, sandbox_id, template, lifetime_s, dict(metadata or {}), dict(envs or {})
        )
        cloud.sandboxes[sandbox_id] = state
        return cls(state)

    @classmethod
    def list(
        cls,
        query: SandboxQuery | None = None,
        limit: int | None = None,
        next_token: str | None = None,
        order: str | None = None,
        **opts: Any,
    ) -> StandInPaginator:
        cls.cloud.check_key(opts)
        wanted = (query.metadata if query is not None else None) or {}
        found = [
            state.info()
            for state in cls.cloud.sandboxes.values()
            if state.alive and all(state.metadata.get(k) == v for k, v in wanted.items())
        ]
        return StandInPaginator(cls.cloud, found, limit or cls.cloud.page_size)

    @classmethod
    async def _cls_kill(cls, sandbox_id: str, **opts: Any) -> bool:
        cls.cloud.check_key(opts)
        cls.cloud.maybe_fail("kill")
        state = cls.cloud.sandboxes.get(sandbox_id)
        if state is None or not state.alive:
            return False  # the API's 404
        state.kill()
        await state.reap_processes()
        return True

    @class_method_variant("_cls_kill")
    async def kill(self, **opts: Any) -> bool:
        return await type(self)._cls_kill(self.sandbox_id, **opts)

    async def set_timeout(self, timeout: int, **opts: Any) -> None:
        cloud = self.cloud
        cloud.check_key(opts)
        cloud.maybe_fail("set_timeout")
        if not self._state.alive:
            raise SandboxNotFoundException(f"Sandbox {self.sandbox_id} not found")
        if timeout > MAX_LIFETIME_S:
            raise api_exception_from_code(400, "Timeout cannot be greater than 24 hours")
        cloud.set_timeouts.append((self.sandbox_id, timeout, cloud.clock()))
        self._state.ends_at = cloud.clock() + timeout

    async def is_running(self, request_timeout: float | None = None) -> bool:
        self.cloud.maybe_fail("is_running")
        return self._state.alive


class StandInPaginator:
    def __init__(self, cloud: StandInCloud, items: list[SandboxInfo], page_size: int) -> None:
        self._cloud = cloud
        self._items = items
        self._page_size = page_size
        self.has_next = True

    async def next_items(self, **opts: Any) -> list[SandboxInfo]:
        if not self.has_next:
            raise Exception("No more items to fetch")
        self._cloud.maybe_fail("list")
        page, self._items = self._items[: self._page_size], self._items[self._page_size :]
        self.has_next = bool(self._items)
        return page


class StandInCommands:
    def __init__(self, state: _SandboxState) -> None:
        self._state = state

    async def run(
        self,
        cmd: str,
        background: bool | None = None,
        envs: dict[str, str] | None = None,
        user: str | None = None,
        cwd: str | None = None,
        on_stdout: Callable[[str], Any] | None = None,
        on_stderr: Callable[[str], Any] | None = None,
        stdin: bool | None = None,
        timeout: float | None = 60,
        request_timeout: float | None = None,
        *,
        retain_output: bool = True,
    ) -> Any:
        state = self._state
        state.require_envd()
        state.cloud.maybe_fail("run")
        state.cloud.commands.append((state.sandbox_id, cmd))
        host_cwd = state.host_path(cwd or ".", user)
        if not host_cwd.is_dir():
            raise InvalidArgumentException(f"cwd '{cwd}' does not exist")  # assumed of envd
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(state.host_path(".", user)),
            "LANG": "C.UTF-8",
            **state.envs,
            **(envs or {}),
            "BASH_ENV": str(state.cloud.kill_guard),
            "E2B_STANDIN_KILL_ALL": str(state.kill_all_file),
        }
        process = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            cmd,
            cwd=host_cwd,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        state.process_groups.add(process.pid)
        handle = StandInCommandHandle(state, process, on_stdout, on_stderr, timeout, retain_output)
        return handle if background else await handle.wait()

    async def kill(self, pid: int, request_timeout: float | None = None) -> bool:
        self._state.require_envd()
        self._state.cloud.killed_pids.append(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True


class StandInCommandHandle:
    """`AsyncCommandHandle`: pid, wait(), kill(), disconnect()."""

    def __init__(
        self,
        state: _SandboxState,
        process: asyncio.subprocess.Process,
        on_stdout: Callable[[str], Any] | None,
        on_stderr: Callable[[str], Any] | None,
        timeout: float | None,
        retain_output: bool,
    ) -> None:
        self._state = state
        self._process = process
        self.pid = process.pid
        self._callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self._chunks: dict[str, list[str] | None] = {
            name: [] if retain_output else None for name in ("stdout", "stderr")
        }
        self._timeout = timeout if state.cloud.honor_stream_timeout else None
        self._result: CommandResult[Any] | None = None
        self._exception: BaseException | None = None
        pending = state.cloud.failures.get("stream")
        self._stream_failure = pending.pop(0) if pending else None
        self._streaming = True
        # The process's pipes are read to their end whatever the stream does, so the
        # sandbox can reap it (`_SandboxState.reap_processes`).
        self._drain = asyncio.create_task(self._pump_and_wait())
        state.drains.add(self._drain)
        self._wait = asyncio.create_task(self._handle_events())

    async def _handle_events(self) -> None:
        if self._stream_failure is not None:
            self._streaming = False
            self._exception = self._stream_failure
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._drain), self._timeout or None)
        except asyncio.TimeoutError:
            self._exception = _DEFAULT_RPC_ERROR_MAP[Code.DEADLINE_EXCEEDED]("deadline exceeded")
        except Exception as exc:
            self._exception = exc
        finally:
            self._streaming = False

    async def _pump_and_wait(self) -> None:
        assert self._process.stdout is not None and self._process.stderr is not None
        await asyncio.gather(
            self._pump("stdout", self._process.stdout), self._pump("stderr", self._process.stderr)
        )
        returncode = await self._process.wait()
        state = self._state
        if state.take_kill_all(self.pid):
            state.kill_processes(spare=self.pid)
        state.process_groups.discard(self.pid)
        state.require_envd()  # the sandbox died under the command: the stream says so
        if returncode < 0:
            name = _GO_SIGNAL_NAMES.get(signal.Signals(-returncode), str(-returncode))
            exit_code, error = -1, f"signal: {name}"
        else:
            exit_code, error = returncode, (f"exit status {returncode}" if returncode else None)
        self._result = CommandResult(
            stdout=self._joined("stdout"),
            stderr=self._joined("stderr"),
            exit_code=exit_code,
            error=error,
        )

    async def _pump(self, name: str, stream: asyncio.StreamReader) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while True:
            chunk = await stream.read(64 * 1024)
            text = decoder.decode(chunk, final=not chunk)
            if text and self._streaming:
                chunks = self._chunks[name]
                if chunks is not None:
                    chunks.append(text)
                callback = self._callbacks[name]
                if callback is not None:
                    returned = callback(text)
                    if inspect.isawaitable(returned):
                        await returned
            if not chunk:
                return

    def _joined(self, name: str) -> str | None:
        chunks = self._chunks[name]
        return None if chunks is None else "".join(chunks)

    async def wait(self) -> CommandResult[Any]:
        await self._wait
        if self._exception is not None:
            raise self._exception
        assert self._result is not None
        if self._result.exit_code != 0:
            raise CommandExitException(
                stdout=self._result.stdout,
                stderr=self._result.stderr,
                exit_code=self._result.exit_code,
                error=self._result.error,
            )
        return self._result

    async def kill(self) -> bool:
        return await StandInCommands(self._state).kill(self.pid)

    async def disconnect(self) -> None:
        self._streaming = False
        self._wait.cancel()
        await asyncio.wait([self._wait])


class StandInFilesystem:
    def __init__(self, state: _SandboxState) -> None:
        self._state = state

    async def write(
        self,
        path: str,
        data: str | bytes,
        user: str | None = None,
        request_timeout: float | None = None,
        gzip: bool = False,
        use_octet_stream: bool | None = None,
        metadata: dict[str, str] | None = None,
    ) -> WriteInfo:
        state = self._state
        state.require_envd()
        state.cloud.maybe_fail("write")
        host = state.host_path(path, user)
        host.parent.mkdir(parents=True, exist_ok=True)
        host = state.confined(host)
        if host.is_dir():
            raise InvalidArgumentException(f"path '{path}' is a directory")
        host.write_bytes(data.encode() if isinstance(data, str) else bytes(data))
        return WriteInfo(name=host.name, type=FileType.FILE, path=path)

    async def read(
        self,
        path: str,
        format: str = "text",
        user: str | None = None,
        request_timeout: float | None = None,
        gzip: bool = False,
    ) -> str | bytearray:
        state = self._state
        state.require_envd()
        state.cloud.maybe_fail("read")
        host = state.host_path(path, user)
        if not host.exists():
            raise FileNotFoundException(f"path '{path}' does not exist")
        host = state.confined(host)
        if host.is_dir():
            raise InvalidArgumentException(f"path '{path}' is a directory")
        data = host.read_bytes()
        return bytearray(data) if format == "bytes" else data.decode(errors="replace")

    async def make_dir(
        self, path: str, user: str | None = None, request_timeout: float | None = None
    ) -> bool:
        state = self._state
        state.require_envd()
        state.cloud.maybe_fail("make_dir")
        host = state.host_path(path, user)
        if host.exists() or host.is_symlink():
            return False
        host.mkdir(parents=True)
        state.confined(host)
        return True

    async def get_info(
        self, path: str, user: str | None = None, request_timeout: float | None = None
    ) -> EntryInfo:
        state = self._state
        state.require_envd()
        state.cloud.maybe_fail("get_info")
        host = state.host_path(path, user)
        try:
            info = host.lstat()
        except FileNotFoundError:
            raise FileNotFoundException(f"path '{path}' does not exist") from None
        if stat.S_ISLNK(info.st_mode):
            kind: FileType | None = FileType.SYMLINK
        elif stat.S_ISDIR(info.st_mode):
            kind = FileType.DIR
        elif stat.S_ISREG(info.st_mode):
            kind = FileType.FILE
        else:
            kind = None  # the SDK maps envd's other kinds (fifos, devices) to None
        return EntryInfo(
            name=host.name,
            type=kind,
            path=path,
            size=info.st_size,
            mode=info.st_mode,
            permissions=stat.filemode(info.st_mode)[1:],
            owner="user",
            group="user",
            modified_time=datetime.datetime.fromtimestamp(info.st_mtime, datetime.timezone.utc),
            symlink_target=os.readlink(host) if kind == FileType.SYMLINK else None,
        )


def standin_cloud(clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> StandInCloud:
    """A StandInCloud in a fresh temporary directory (close() removes it)."""
    return StandInCloud(Path(tempfile.mkdtemp(prefix="e2b-standin-")), clock, **kwargs)
