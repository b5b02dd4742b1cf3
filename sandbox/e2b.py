"""E2BSandbox: one E2B cloud sandbox (a Firecracker microVM) per sandbox, through the E2B
SDK's `AsyncSandbox`.

Lifetime: E2B kills a sandbox when its timeout (its LIFETIME, 300 s unless told) runs out.
A sandbox is created with `trajectory_timeout_s + grading_timeout_s`, so one leaked by a
crash costs at most that; before every command or file transfer, when the lifetime left
would not cover the operation's timeout plus `lifetime_margin_s` (the model's next turn),
it is extended with `set_timeout` (by at least `extension_s`, to spare API calls).

Commands run as `bash -l -c CMD` (the SDK's form) as `user`, in the working directory.
The SDK's command timeout is the deadline: its TimeoutException after `timeout_s` is a
result with timed_out=True, exit code 137, limit_hit "wall_time" (a backstop deadline of
our own covers a stream that never ends). At the deadline, or when the output passes its
cap, the command is SIGKILLed, and then (`sweep_on_kill`, when `user` is not root) every
process of that user (`kill -KILL -1` as the user: background processes of this or
earlier commands too, as in DockerSandbox). `CommandExitException` (a non-zero exit) is
an ordinary result. Output is taken through the SDK's callbacks into head + tail buffers,
never whole.

Infrastructure errors become SandboxErrors: an unknown template or a refused request at
creation a SandboxStartError; a refused API key E2BAuthError; the account's rate or
concurrency limit (HTTP 429) or E2B without capacity (503) E2BRateLimitError; a sandbox
that was killed, ran out of lifetime or cannot be reached SandboxDiedError.

Account limits: creations are spaced to `max_creations_per_s` and at most
`max_concurrent` sandboxes live at once, counted by an `E2BRateLimiter`. The limits are
the account's, so every sandbox of one API key must share one limiter: build sandboxes
with `e2b_sandbox_factory(config)` (or pass the same `limiter`); a sandbox built alone
gets a private one.

Every sandbox carries the metadata `opd.sandbox=1` and `opd.owner=<owner>` (DockerSandbox's
labels), so `reap` can kill what a crashed run left behind.

Limits of this backend, stated plainly:
- The `e2b` package is imported on first use (it costs about 0.4 s).
- A creation cancelled while its request is in flight may still create a sandbox; it
  dies at the end of its lifetime, or `reap` kills it.
- File paths follow the other backends' rules (inside the working directory, no `..`);
  the last component is refused when it is a symlink or not a regular file, parents are
  not walked: transfers run as `user` in a VM of the sandbox's own, so a link reaches
  nothing that user could not reach anyway.
- Output byte counts are of the SDK's decoded text re-encoded as UTF-8 (invalid bytes
  count as the three bytes of U+FFFD).
- The sweep reaches only processes of `user`: one running as another user (through sudo)
  survives a deadline kill, and with `user` root (or sweep_on_kill off) only the
  command's own process is killed; its children live until close() kills the VM.
- Whether envd ends a process when its stream's deadline passes is not documented; the
  command is killed here either way. envd reports a death by signal as exit code -1
  with "signal: NAME" (read here as 128 + N).
- Hostile input follows DockerSandbox's rules, checked here before it reaches the SDK
  (which would fail on it as if the sandbox had): a command, cwd or environment no
  process can be given is exit code 126; a path envd cannot name a SandboxFileError;
  `timeout_s` not positive and finite a ValueError, and one so long that E2B refuses
  the lifetime it needs a SandboxResourceError.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import posixpath
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr

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
from sandbox.docker import remote_path_parts, unpassable_remotely
from sandbox.jail import limit_from_exit
from sandbox.local import _cannot_execute
from sandbox.output import HeadTailBuffer

logger = logging.getLogger(__name__)

SANDBOX_LABEL = "opd.sandbox"
OWNER_LABEL = "opd.owner"
"""The same ownership labels as sandbox.docker's, as E2B metadata."""
# Kills every process the command user may signal, except this shell (kill -1 skips the
# caller); envd runs as root and survives.
_SWEEP = "kill -KILL -1 2>/dev/null; exit 0"
_DEADLINE_ROUNDING_S = 0.001
# How envd (Go's os.ProcessState) names the signal that ended a process whose exit code
# it reports as -1.
_GO_SIGNAL_NAMES = {
    "killed": signal.SIGKILL,
    "terminated": signal.SIGTERM,
    "interrupt": signal.SIGINT,
    "aborted": signal.SIGABRT,
    "segmentation fault": signal.SIGSEGV,
    "bus error": signal.SIGBUS,
    "floating point exception": signal.SIGFPE,
    "hangup": signal.SIGHUP,
    "broken pipe": signal.SIGPIPE,
    "quit": signal.SIGQUIT,
    "CPU time limit exceeded": signal.SIGXCPU,
    "file size limit exceeded": signal.SIGXFSZ,
}


class E2BAuthError(SandboxUnavailableError):
    """E2B has no API key to use, or refused it: set E2B_API_KEY or `api_key`."""


class E2BRateLimitError(SandboxResourceError):
    """E2B refused a request for the account's rate or concurrency limit (HTTP 429), or
    for lack of capacity (503); retry later."""


class E2BSandboxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    template: str = "base"
    """E2B template name or ID (e.g. one built from a SWE-bench image)."""
    api_key: SecretStr | None = None
    """E2B API key; None: the E2B_API_KEY environment variable."""
    domain: str | None = None
    """E2B domain; None: E2B_DOMAIN, else e2b.app."""
    workdir: str = Field(default="/home/user", pattern=r"^/")
    """Where commands start and where relative file paths point (created if missing)."""
    user: str = "user"
    """User commands and file transfers run as ("user" or "root" in E2B's templates)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every command (set at creation)."""
    allow_internet_access: bool = False
    """Outbound network; off by default, like DockerSandbox's network_mode "none"."""
    owner: str = "default"
    """Value of the opd.owner metadata: which run owns the sandbox, for `reap`."""
    labels: dict[str, str] = Field(default_factory=dict)
    """More metadata on the sandbox."""
    trajectory_timeout_s: int = Field(default=2400, ge=1)
    """The trajectory's deadline: with grading_timeout_s, the lifetime at creation."""
    grading_timeout_s: int = Field(default=900, ge=0)
    """Time to grade after the trajectory, in the same sandbox or after it."""
    lifetime_margin_s: int = Field(default=300, ge=0)
    """Lifetime kept beyond each operation's timeout: covers the model's next turn."""
    extension_s: int = Field(default=600, ge=1)
    """Least lifetime a `set_timeout` grants, so extensions stay rare."""
    max_creations_per_s: float = Field(default=5.0, gt=0)
    """Account limit on sandbox creations (E2B Pro: 5/s)."""
    max_concurrent: int = Field(default=100, ge=1)
    """Account limit on sandboxes alive at once (E2B Pro: 100 by default)."""
    slot_timeout_s: float = Field(default=600.0, gt=0)
    """How long start() waits for a concurrency slot before SandboxResourceError."""
    request_timeout_s: float = Field(default=60.0, gt=0)
    """Timeout of each API or envd request (not of commands)."""
    output_head_kb: int = Field(default=64, ge=0)
    """Kept from the start of each output stream."""
    output_tail_kb: int = Field(default=64, ge=0)
    """Kept from the end of each output stream."""
    max_output_mb: float = Field(default=32.0, gt=0)
    """Output (stdout + stderr) after which a command is killed as a flood."""
    max_read_file_mb: float = Field(default=64.0, gt=0)
    """Largest file `read_file` returns."""
    kill_grace_s: float = Field(default=5.0, gt=0)
    """How long a killed command's stream may take to end."""
    sweep_on_kill: bool = True
    """At a deadline or an output flood, SIGKILL every process of `user` too (background
    processes of this and earlier commands); off for templates that run services as
    `user`, which would die with them."""

    @property
    def lifetime_s(self) -> int:
        return self.trajectory_timeout_s + self.grading_timeout_s

    def api_params(self) -> dict[str, Any]:
        """The SDK's connection options (api_key, domain, request_timeout) that are set."""
        params: dict[str, Any] = {"request_timeout": self.request_timeout_s}
        if self.api_key is not None:
            params["api_key"] = self.api_key.get_secret_value()
        if self.domain is not None:
            params["domain"] = self.domain
        return params


Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[Any]]


class E2BRateLimiter:
    """An account's limits: creations spaced `1 / max_creations_per_s` apart, and at most
    `max_concurrent` sandboxes holding a slot (from start to close)."""

    def __init__(
        self,
        max_creations_per_s: float,
        max_concurrent: int,
        clock: Clock = time.monotonic,
        sleep: Sleep = asyncio.sleep,
    ) -> None:
        if max_creations_per_s <= 0 or max_concurrent < 1:
            raise ValueError("max_creations_per_s must be > 0 and max_concurrent >= 1")
        self.interval_s = 1.0 / max_creations_per_s
        self.max_concurrent = max_concurrent
        self.clock = clock
        self.sleep = sleep
        self._next_creation_at = -math.inf
        self._slots = asyncio.Semaphore(max_concurrent)

    @classmethod
    def from_config(
        cls, config: E2BSandboxConfig, clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep
    ) -> E2BRateLimiter:
        return cls(config.max_creations_per_s, config.max_concurrent, clock, sleep)

    async def creation_turn(self) -> None:
        """Wait for this creation's turn (reserved on entry: callers go in order)."""
        now = self.clock()
        turn = max(now, self._next_creation_at)
        self._next_creation_at = turn + self.interval_s
        if turn > now:
            await self.sleep(turn - now)

    async def acquire_slot(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._slots.acquire(), timeout_s)
        except asyncio.TimeoutError:
            raise SandboxResourceError(
                f"all {self.max_concurrent} E2B sandbox slots stayed taken for {timeout_s:g} "
                "s: close sandboxes, or raise max_concurrent if the account allows more"
            ) from None

    def release_slot(self) -> None:
        self._slots.release()


def e2b_sandbox_factory(
    config: E2BSandboxConfig | None = None,
    sdk: Any = None,
    templates: Mapping[str, str] | None = None,
) -> Callable[[str | None], E2BSandbox]:
    """New (unstarted) sandboxes of one account, sharing one rate limiter; a harness's
    `sandbox_factory(image)`: image None runs `config.template`, a task's Docker image runs
    the E2B template built from it (`templates`: image -> template name or ID)."""
    config = config or E2BSandboxConfig()
    limiter = E2BRateLimiter.from_config(config)
    known = dict(templates or {})

    def new_sandbox(image: str | None) -> E2BSandbox:
        if image is None:
            return E2BSandbox(config, limiter=limiter, sdk=sdk)
        if image not in known:
            raise SandboxUnavailableError(
                f"no E2B template for image {image!r}: build one from it (`e2b template "
                "build`) and map it in e2b_sandbox_factory(templates={image: template})"
            )
        task_config = config.model_copy(update={"template": known[image]})
        return E2BSandbox(task_config, limiter=limiter, sdk=sdk)

    return new_sandbox


def _default_sdk() -> Any:
    from e2b import AsyncSandbox

    return AsyncSandbox


def infrastructure_error(action: str, exc: BaseException, starting: bool = False) -> SandboxError:
    """The SandboxError for an exception the E2B SDK raised while doing `action`;
    `starting`: during creation, where anything not more specific is a start error."""
    from e2b.exceptions import (
        AuthenticationException,
        InvalidArgumentException,
        NotFoundException,
        RateLimitException,
        SandboxException,
        SandboxNotRunningException,
        SandboxUnreachableException,
        ServiceBusyException,
        TimeoutException,
    )

    if isinstance(exc, SandboxError):
        return exc
    if isinstance(exc, AuthenticationException):
        return E2BAuthError(
            f"cannot {action}: E2B refused the credentials ({exc}); set E2B_API_KEY or "
            "E2BSandboxConfig.api_key"
        )
    if isinstance(exc, RateLimitException | ServiceBusyException):
        return E2BRateLimitError(
            f"cannot {action}: E2B refused the request ({exc}); lower max_creations_per_s "
            "or max_concurrent to the account's limits, or retry later"
        )
    if isinstance(exc, SandboxNotRunningException):
        return SandboxDiedError(
            f"cannot {action}: the E2B sandbox was killed or ran out of lifetime: {exc}"
        )
    if isinstance(exc, SandboxUnreachableException):
        return SandboxDiedError(f"cannot {action}: the E2B sandbox cannot be reached: {exc}")
    status = getattr(exc, "status_code", None)
    if starting:
        if isinstance(exc, NotFoundException) or status == 404:
            return SandboxStartError(
                f"cannot {action}: E2B found no such template or resource ({exc}); build "
                "the template first (`e2b template build`) or fix E2BSandboxConfig.template"
            )
        if isinstance(exc, InvalidArgumentException) or status == 400:
            return SandboxStartError(f"cannot {action}: E2B refused the arguments: {exc}")
        if isinstance(exc, TimeoutException):
            return SandboxStartError(f"cannot {action}: E2B did not answer in time: {exc}")
        return SandboxStartError(f"cannot {action}: {type(exc).__name__}: {exc}")
    if isinstance(exc, NotFoundException):
        return SandboxDiedError(f"cannot {action}: the E2B sandbox is gone: {exc}")
    if isinstance(exc, TimeoutException):
        return SandboxDiedError(f"cannot {action}: E2B did not answer in time: {exc}")
    if isinstance(exc, SandboxException):
        return SandboxDiedError(f"cannot {action}: {exc}")
    return SandboxDiedError(f"cannot {action}: {type(exc).__name__}: {exc}")


def _exit_status(exit_code: int, error: str | None) -> int:
    """Shell convention for envd's exit code: -1 with "signal: NAME" is 128 + N."""
    if exit_code >= 0:
        return exit_code
    name = (error or "").strip().removeprefix("signal: ")
    signum = _GO_SIGNAL_NAMES.get(name)
    return 128 + int(signum) if signum is not None else 255


async def reap(
    labels: Mapping[str, str] | None = None,
    config: E2BSandboxConfig | None = None,
    sdk: Any = None,
) -> int:
    """Kill every E2B sandbox (running or paused) of the account whose metadata holds
    opd.sandbox=1 and all of `labels` (e.g. {"opd.owner": run_id}); returns how many."""
    from e2b import SandboxQuery

    sdk = sdk or _default_sdk()
    params = (config or E2BSandboxConfig()).api_params()
    query = SandboxQuery(metadata={SANDBOX_LABEL: "1", **(labels or {})})
    try:
        paginator = sdk.list(query=query, **params)
        sandbox_ids: list[str] = []
        while paginator.has_next:
            sandbox_ids += [info.sandbox_id for info in await paginator.next_items()]
    except Exception as exc:
        raise infrastructure_error("list E2B sandboxes", exc) from exc
    killed = 0
    for sandbox_id in sandbox_ids:
        try:
            killed += bool(await sdk.kill(sandbox_id, **params))
        except Exception as exc:
            logger.warning("reap: E2B sandbox %s not killed: %s", sandbox_id, exc)
    return killed


class E2BSandbox(StartsAndCloses):
    """An E2B cloud sandbox; commands run with `bash -l -c` in the working directory."""

    def __init__(
        self,
        config: E2BSandboxConfig | None = None,
        limiter: E2BRateLimiter | None = None,
        sdk: Any = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """`limiter`: the account's (see `e2b_sandbox_factory`); `sdk`: the class whose
        `create`/`list`/`kill` are called, by default `e2b.AsyncSandbox` (tests pass a
        stand-in); `clock`: seconds, for lifetime accounting."""
        self.config = config or E2BSandboxConfig()
        self._limiter = limiter or E2BRateLimiter.from_config(self.config, clock=clock)
        self._sdk = sdk
        self._clock = clock
        self._sandbox: Any = None
        self._expires_at = -math.inf
        self._holds_slot = False
        self._start_lock = asyncio.Lock()
        self._closed = False

    @property
    def labels(self) -> dict[str, str]:
        return {SANDBOX_LABEL: "1", OWNER_LABEL: self.config.owner, **self.config.labels}

    @property
    def sandbox_id(self) -> str:
        return str(self._started().sandbox_id)

    @property
    def expires_at(self) -> float:
        """When the sandbox's lifetime ends, on `clock`, as far as this side knows (the
        time before the request that set it: never later than E2B's own)."""
        return self._expires_at

    def _started(self) -> Any:
        if self._closed:
            raise SandboxClosedError("the sandbox is closed")
        if self._sandbox is None:
            raise SandboxStartError("the sandbox is not started: await start() first")
        return self._sandbox

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        async with self._start_lock:
            if self._closed:
                raise SandboxClosedError("the sandbox is closed")
            if self._sandbox is not None:
                return
            await self._limiter.acquire_slot(self.config.slot_timeout_s)
            self._holds_slot = True
            try:
                await self._create()
                await self._prepare_workdir()
            except BaseException as exc:
                await asyncio.shield(self._release())
                if isinstance(exc, Exception) and not isinstance(exc, SandboxError):
                    raise infrastructure_error("create an E2B sandbox", exc, True) from exc
                raise

    async def _create(self) -> None:
        cfg = self.config
        self._sdk = self._sdk or _default_sdk()
        await self._limiter.creation_turn()
        asked_at = self._clock()
        self._sandbox = await self._sdk.create(
            template=cfg.template,
            timeout=cfg.lifetime_s,
            metadata=self.labels,
            envs={**STEADY_PYTHON_ENV, **cfg.env},
            allow_internet_access=cfg.allow_internet_access,
            **cfg.api_params(),
        )
        self._expires_at = asked_at + cfg.lifetime_s

    async def _prepare_workdir(self) -> None:
        """Create the working directory (as `user`) when the template has none."""
        await self._sandbox.files.make_dir(
            self.config.workdir,
            user=self.config.user,
            request_timeout=self.config.request_timeout_s,
        )

    async def _release(self) -> None:
        """Kill the sandbox (failures logged: `reap` finds it) and free its slot."""
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None:
                await sandbox.kill(**self.config.api_params())
        except Exception as exc:
            logger.warning(
                "E2B sandbox %s left behind (reap(%r) kills it): %s",
                getattr(sandbox, "sandbox_id", "?"),
                {OWNER_LABEL: self.config.owner},
                exc,
            )
        finally:
            if self._holds_slot:
                self._holds_slot = False
                self._limiter.release_slot()

    async def is_alive(self) -> bool:
        if self._closed or self._sandbox is None or self._clock() >= self._expires_at:
            return False
        try:
            return bool(await self._sandbox.is_running(self.config.request_timeout_s))
        except Exception:
            return False

    async def close(self) -> None:
        if self._closed:
            return
        async with self._start_lock:
            self._closed = True
            await self._release()

    async def keep_alive(self, busy_s: float) -> None:
        """Extend the lifetime when what is left would not cover `busy_s` plus the
        margin; the new lifetime counts from now."""
        sandbox = self._started()
        cfg = self.config
        needed_s = busy_s + cfg.lifetime_margin_s
        now = self._clock()
        if self._expires_at - now >= needed_s:
            return
        if now >= self._expires_at:
            raise SandboxDiedError(
                f"the E2B sandbox {sandbox.sandbox_id} ran out of lifetime "
                f"({cfg.lifetime_s} s at creation, extended while in use)"
            )
        lifetime_s = max(math.ceil(needed_s), cfg.extension_s)
        try:
            await sandbox.set_timeout(lifetime_s, **cfg.api_params())
        except Exception as exc:
            if getattr(exc, "status_code", None) == 400:
                raise SandboxResourceError(
                    f"E2B refused to keep the sandbox alive {lifetime_s} s more ({exc}): "
                    "lower timeout_s to what the account's plan allows (at most 24 h)"
                ) from exc
            raise self._infrastructure_error("extend the sandbox's lifetime", exc) from exc
        self._expires_at = now + lifetime_s

    # -- commands --------------------------------------------------------------------------

    async def exec(
        self,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run `cmd` as `user` in the working directory (or `cwd`, relative to it)."""
        if not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
        await self.start()
        command = cmd
        if cwd is not None:
            # cd inside the command (the shell starts in the working directory; same line:
            # bash's line numbers stay), so a missing directory is the command's failure; a
            # lone "-" would be cd's previous directory.
            target = "./-" if cwd == "-" else cwd
            command = f"cd -- {shlex.quote(target)} || exit 1; {cmd}"
        problem = unpassable_remotely(cmd, cwd, env) or unpassable_remotely(command, None, None)
        if problem is not None:
            return _cannot_execute(problem, time.monotonic())
        await self.keep_alive(timeout_s)
        sandbox, cfg = self._started(), self.config
        output = _Output(cfg)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            handle = await sandbox.commands.run(
                command,
                background=True,
                envs=env,
                user=cfg.user,
                cwd=cfg.workdir,
                on_stdout=output.on_stdout,
                on_stderr=output.on_stderr,
                timeout=timeout_s,
                request_timeout=cfg.request_timeout_s,
                retain_output=False,
            )
        except Exception as exc:
            raise self._infrastructure_error("start a command", exc) from exc
        waiter: asyncio.Future[Any] = asyncio.ensure_future(handle.wait())
        try:
            killed_for = await self._await_command(handle, waiter, output, timeout_s)
        except asyncio.CancelledError:
            await asyncio.shield(self._kill_quietly(handle, waiter))
            raise
        ended = loop.time()
        exit_code, killed_for = await self._exit_code(
            handle, waiter, killed_for, ended - started, timeout_s
        )
        if killed_for is not None:
            exit_code = 137
        stderr = output.stderr.text()
        return ExecResult(
            exit_code=exit_code,
            stdout=output.stdout.text(),
            stderr=stderr,
            stdout_truncated=output.stdout.truncated,
            stderr_truncated=output.stderr.truncated,
            stdout_bytes=output.stdout.total_bytes,
            stderr_bytes=output.stderr.total_bytes,
            timed_out=killed_for == "wall_time",
            limit_hit=killed_for or limit_from_exit(exit_code, stderr),
            duration_s=ended - started,
        )

    async def _await_command(
        self, handle: Any, waiter: asyncio.Future[Any], output: _Output, timeout_s: float
    ) -> LimitName | None:
        """Wait for the command to end. The SDK ends it at `timeout_s` (its stream
        deadline); a kill grace later, or when the output passes its cap, it is killed
        here. Returns the limit it was killed for."""
        flooded: asyncio.Future[Any] = asyncio.ensure_future(output.flooded.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, flooded},
                timeout=timeout_s + self.config.kill_grace_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            flooded.cancel()
        if waiter in done:
            return None
        killed_for: LimitName = "output" if output.flooded.is_set() else "wall_time"
        await self._kill(handle, waiter)
        return killed_for

    async def _kill(self, handle: Any, waiter: asyncio.Future[Any]) -> None:
        """SIGKILL the command (and the user's other processes), then let its stream end
        or drop it."""
        try:
            await handle.kill()
            if self.config.sweep_on_kill and self.config.user != "root":
                await self._started().commands.run(
                    _SWEEP, user=self.config.user, timeout=self.config.kill_grace_s
                )
        except Exception as exc:
            raise self._infrastructure_error("kill a command", exc) from exc
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.config.kill_grace_s)
        except asyncio.TimeoutError:
            await handle.disconnect()
        except Exception:
            pass  # how the killed command's stream ended does not matter

    async def _kill_quietly(self, handle: Any, waiter: asyncio.Future[Any]) -> None:
        with contextlib.suppress(Exception):
            await self._kill(handle, waiter)
        waiter.cancel()

    async def _exit_code(
        self,
        handle: Any,
        waiter: asyncio.Future[Any],
        killed_for: LimitName | None,
        elapsed_s: float,
        timeout_s: float,
    ) -> tuple[int, LimitName | None]:
        """The command's exit status from how `handle.wait()` ended, and the limit it
        was killed for (the SDK's own deadline counts as wall_time)."""
        from e2b import CommandExitException
        from e2b.exceptions import (
            SandboxNotRunningException,
            SandboxUnreachableException,
            TimeoutException,
        )

        if killed_for is not None:
            await self._require_alive()
            return 137, killed_for
        try:
            result = waiter.result()
        except CommandExitException as exc:
            return _exit_status(exc.exit_code, exc.error), None
        except (SandboxNotRunningException, SandboxUnreachableException) as exc:
            raise self._infrastructure_error("run a command", exc) from exc
        except TimeoutException as exc:
            # The SDK rounds the deadline to whole milliseconds.
            if elapsed_s < timeout_s - _DEADLINE_ROUNDING_S:  # a request timeout, not ours
                raise self._infrastructure_error("run a command", exc) from exc
            await self._kill(handle, waiter)  # the stream ended, the command may not have
            await self._require_alive()
            return 137, "wall_time"
        except Exception as exc:
            raise self._infrastructure_error("run a command", exc) from exc
        return _exit_status(result.exit_code, result.error), None

    async def _require_alive(self) -> None:
        """A killed command's result stands only if the sandbox itself still runs."""
        if not await self.is_alive():
            sandbox = self._started()  # SandboxClosedError when close() came meanwhile
            raise SandboxDiedError(f"the E2B sandbox {sandbox.sandbox_id} stopped")

    def _infrastructure_error(self, action: str, exc: BaseException) -> SandboxError:
        """`infrastructure_error`, except that a call close() cut short is closed, not
        dead."""
        if self._closed:
            return SandboxClosedError(f"cannot {action}: the sandbox was closed meanwhile")
        return infrastructure_error(action, exc)

    # -- files -----------------------------------------------------------------------------

    async def write_file(self, path: str, data: bytes) -> None:
        await self.start()
        full = self._full_path(path)
        await self.keep_alive(self.config.request_timeout_s)
        info = await self._stat(path, full, "write")
        if info is not None:
            self._check_regular(path, info)
        try:
            await self._started().files.write(
                full,
                bytes(data),
                user=self.config.user,
                request_timeout=self.config.request_timeout_s,
            )
        except Exception as exc:
            raise self._file_error("write", path, exc) from exc

    async def read_file(self, path: str) -> bytes:
        await self.start()
        full = self._full_path(path)
        await self.keep_alive(self.config.request_timeout_s)
        info = await self._stat(path, full, "read")
        if info is None:
            raise SandboxFileError(f"cannot read {path!r}: No such file or directory")
        self._check_regular(path, info)
        max_bytes = int(self.config.max_read_file_mb * 1024 * 1024)
        if info.size > max_bytes:
            raise SandboxFileError(f"{path!r} is {info.size:,} bytes, over the {max_bytes:,} limit")
        try:
            data = await self._started().files.read(
                full,
                format="bytes",
                user=self.config.user,
                request_timeout=self.config.request_timeout_s,
            )
        except Exception as exc:
            raise self._file_error("read", path, exc) from exc
        if len(data) > max_bytes:
            raise SandboxFileError(f"{path!r} grew past the {max_bytes:,} byte limit while read")
        return bytes(data)

    def _full_path(self, path: str) -> str:
        """`path` inside the working directory (DockerSandbox's rules)."""
        return posixpath.join(self.config.workdir, *remote_path_parts(self.config.workdir, path))

    async def _stat(self, path: str, full: str, action: str) -> Any:
        """envd's lstat of `full`, None when it does not exist."""
        from e2b import FileNotFoundException

        try:
            return await self._started().files.get_info(
                full, user=self.config.user, request_timeout=self.config.request_timeout_s
            )
        except FileNotFoundException:
            return None
        except Exception as exc:
            raise self._file_error(action, path, exc) from exc

    @staticmethod
    def _check_regular(path: str, info: Any) -> None:
        from e2b import FileType

        if info.type == FileType.SYMLINK:
            raise SandboxFileError(f"cannot access {path!r}: it is a symlink")
        if info.type != FileType.FILE:
            raise SandboxFileError(f"{path!r} is not a regular file")

    def _file_error(self, action: str, path: str, exc: Exception) -> SandboxError:
        """Refusals about the file itself are SandboxFileErrors; the rest infrastructure."""
        from e2b import FileNotFoundException, InvalidArgumentException, NotEnoughSpaceException

        if isinstance(exc, FileNotFoundException):
            return SandboxFileError(f"cannot {action} {path!r}: No such file or directory")
        if isinstance(exc, InvalidArgumentException | NotEnoughSpaceException):
            return SandboxFileError(f"cannot {action} {path!r}: {exc}")
        return self._infrastructure_error(f"{action} {path!r}", exc)


class _Output:
    """A command's stdout and stderr as the SDK hands them over (decoded text), kept as
    head + tail; `flooded` is set once both together pass the cap."""

    def __init__(self, config: E2BSandboxConfig) -> None:
        head, tail = config.output_head_kb * 1024, config.output_tail_kb * 1024
        self.stdout = HeadTailBuffer(head, tail)
        self.stderr = HeadTailBuffer(head, tail)
        self.max_bytes = int(config.max_output_mb * 1024 * 1024)
        self.flooded = asyncio.Event()

    def _feed(self, buffer: HeadTailBuffer, text: str) -> None:
        buffer.feed(text.encode("utf-8", errors="replace"))
        if self.stdout.total_bytes + self.stderr.total_bytes > self.max_bytes:
            self.flooded.set()

    def on_stdout(self, text: str) -> None:
        self._feed(self.stdout, text)

    def on_stderr(self, text: str) -> None:
        self._feed(self.stderr, text)
