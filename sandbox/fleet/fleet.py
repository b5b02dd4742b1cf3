"""`Fleet` places sandboxes on hosts and bounds every call to them; `FleetSandbox` is a
sandbox it hands out. The placement and failure rules are in the package docstring
(`sandbox.fleet`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from sandbox.base import (
    ExecResult,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxResourceError,
    SandboxUnavailableError,
    StartsAndCloses,
)
from sandbox.fleet.breaker import CircuitBreaker
from sandbox.fleet.hosts import Created, SandboxHost
from sandbox.fleet.metrics import LatencySamples
from sandbox.fleet.placement import FleetHost

logger = logging.getLogger(__name__)

T = TypeVar("T")


class FleetDeadlineError(SandboxDiedError):
    """A host did not answer a call within its deadline; the call was abandoned."""


class FleetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    owner: str = Field(default_factory=lambda: f"fleet-{secrets.token_hex(4)}")
    """opd.owner label of every container: set it to the run's id, so a restarted run
    reaps what its predecessor left (hosts reap their owner's leftovers when opened)."""
    start_attempts: int = Field(default=4, ge=1)
    """Starts tried for one sandbox, each on another host where one is free."""
    backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the second start; doubles with each attempt (times 0.5-1 jitter)."""
    backoff_max_s: float = Field(default=10.0, ge=0)
    acquire_timeout_s: float = Field(default=600.0, gt=0)
    """Longest `acquire` takes, waits for a free slot included."""
    start_deadline_s: float = Field(default=120.0, gt=0)
    """One start on a host that holds the image (or a warm hand-out)."""
    pull_deadline_s: float = Field(default=1800.0, gt=0)
    """One start on a host that must pull or build the image first."""
    exec_margin_s: float = Field(default=30.0, gt=0)
    """A command's deadline is its timeout plus this (the kill, output, transport)."""
    call_deadline_s: float = Field(default=60.0, gt=0)
    """Files, liveness, closing a sandbox, a host's status."""
    shutdown_deadline_s: float = Field(default=120.0, gt=0)
    """Opening (reaping) and shutting down one host."""
    breaker_failures: int = Field(default=3, ge=1)
    """Infrastructure failures in a row that open a host's circuit breaker."""
    breaker_cooldown_s: float = Field(default=30.0, ge=0)
    """How long an open breaker keeps new sandboxes off its host before a probe."""
    status_interval_s: float = Field(default=10.0, gt=0)
    """How often host status (images, warm pools, counters) is refreshed."""
    blocking_threads: int | None = Field(default=256, ge=1)
    """Threads of the event loop's default executor, installed by `open`: docker calls
    block one each (up to the client's api_timeout_s when a daemon hangs); None keeps
    the loop's own (min(32, cores + 4))."""


class Fleet:
    """Places sandboxes on hosts; see the package docstring. Use as `async with`."""

    def __init__(self, hosts: Sequence[SandboxHost], config: FleetConfig | None = None) -> None:
        self.config = config or FleetConfig()
        names = [host.name for host in hosts]
        if not hosts or len(set(names)) != len(names):
            raise ValueError(f"a fleet needs hosts with distinct names, got {names}")
        cfg = self.config
        self._hosts = {
            host.name: FleetHost(host, CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s))
            for host in hosts
        }
        self._changed = asyncio.Condition()
        self._handles: set[FleetSandbox] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._unreaped: list[str] = []
        self._opened = self._closed = False
        self.creation_s = LatencySamples()
        """From `acquire` called to a started sandbox, waits and retries included."""
        self.exec_latency_s = LatencySamples()
        self.failures_by_kind: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        """acquired, warm_hits, retries, late_starts_closed."""

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        """Open every host (each reaps its leftovers); a host that fails starts with its
        breaker open. Installs the default executor (`blocking_threads`)."""
        if self._opened:
            return
        self._opened = True
        if self.config.blocking_threads is not None:
            executor = ThreadPoolExecutor(self.config.blocking_threads, "opd-fleet")
            asyncio.get_running_loop().set_default_executor(executor)
        await asyncio.gather(*(self._open_host(host) for host in self._hosts.values()))
        self._refresher = asyncio.create_task(self._refresh_forever())

    async def _open_host(self, host: FleetHost) -> None:
        try:
            deadline = self.config.shutdown_deadline_s
            host.status = await self._call(host, host.host.open(), deadline, "open", cancel=False)
        except SandboxError as exc:
            logger.warning("fleet: host %s did not open (breaker open): %s", host.name, exc)
            host.breaker.trip(time.monotonic())

    async def close(self) -> None:
        """Close every sandbox still handed out, shut every host down (closing and reaping
        by label); hosts that cannot be reached are listed in metrics()["unreaped_hosts"]."""
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
        await asyncio.gather(*(handle.close() for handle in list(self._handles)))
        await self.refresh()
        await asyncio.gather(*(self._shutdown_host(host) for host in self._hosts.values()))
        pending = [
            *self._background,
            *(h.status_call for h in self._hosts.values() if h.status_call),
        ]
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        for task in pending:
            task.cancel()

    async def _shutdown_host(self, host: FleetHost) -> None:
        try:
            deadline = self.config.shutdown_deadline_s
            await self._call(host, host.host.shutdown(), deadline, "shut down", cancel=False)
        except SandboxError as exc:
            logger.warning("fleet: host %s not shut down; its leftovers remain: %s", host.name, exc)
            self._unreaped.append(host.name)

    async def __aenter__(self) -> Fleet:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- sandboxes -------------------------------------------------------------------------

    def sandbox(self, image: str | None = None) -> FleetSandbox:
        """A sandbox for `image`, placed when started (a harness's `sandbox_factory`)."""
        return FleetSandbox(self, image)

    async def acquire(self, image: str | None = None) -> FleetSandbox:
        """A started sandbox for `image` (None: a host's default; local hosts run only
        None). Start failures are retried on other hosts with backoff; raises the
        SandboxError of the last attempt's kind when every attempt failed."""
        sandbox = self.sandbox(image)
        await sandbox.start()
        return sandbox

    async def _start(self, image: str | None) -> tuple[FleetHost, Created, int]:
        """Place and start one sandbox: its host (a slot reserved), what the host made,
        and the attempts it took."""
        if not self._opened or self._closed:
            raise SandboxClosedError("the fleet is not open")
        cfg = self.config
        started = time.monotonic()
        deadline = started + cfg.acquire_timeout_s
        tried: list[str] = []
        errors: list[SandboxError] = []
        for attempt in range(cfg.start_attempts):
            if attempt:
                self.events["retries"] += 1
                backoff = min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(min(backoff * random.uniform(0.5, 1.0), _left(deadline)))
            host = await self._place(image, tried, deadline)
            fetch = host.status is not None and not host.rank(image)[1]
            full = cfg.pull_deadline_s if fetch else cfg.start_deadline_s
            limit = min(full, _left(deadline))
            try:
                created = await self._call(
                    host,
                    host.host.create(image),
                    max(limit, 0.001),
                    "start a sandbox",
                    cancel=False,
                    on_late=functools.partial(self._close_late, host),
                    blame_deadline=limit >= full,
                )
            except SandboxError as exc:
                await self._release(host)
                tried.append(host.name)
                errors.append(exc)
                if _left(deadline) <= 0:
                    break
                continue
            except BaseException:
                await self._release(host)
                raise
            self.creation_s.add(time.monotonic() - started)
            self.events["acquired"] += 1
            self._note_created(host, created)
            return host, created, attempt + 1
        summary = "; ".join(f"{type(e).__name__}: {e}" for e in errors[-3:])
        last = errors[-1]
        raise type(last)(
            f"no sandbox for image {image or 'default'} after {len(errors)} attempts on "
            f"{', '.join(tried)}: {summary}"
        ) from last

    def _note_created(self, host: FleetHost, created: Created) -> None:
        if created.warm:
            self.events["warm_hits"] += 1
        if host.status is not None:
            warm = host.status.warm
            if created.warm and warm.get(created.image):
                warm[created.image] -= 1
            if host.status.backend == "docker" and created.image not in host.status.images:
                host.status.images.append(created.image)

    async def _place(self, image: str | None, tried: list[str], deadline: float) -> FleetHost:
        """Reserve a slot on the best host for `image`, waiting for one while none is free
        (hosts already tried this acquire come last)."""
        async with self._changed:
            while True:
                now = time.monotonic()
                able = [h for h in self._hosts.values() if h.image_key(image) is not None]
                if not able:
                    raise SandboxUnavailableError(f"no host of the fleet can run image {image}")
                free = [h for h in able if h.active < h.cap and h.breaker.accepts(now)]
                fresh = [h for h in free if h.name not in tried] or free
                if fresh:
                    best = max(fresh, key=lambda h: (*h.rank(image), random.random()))
                    best.breaker.placed()
                    best.active += 1
                    return best
                if now >= deadline:
                    if any(h.breaker.accepts(now) for h in able):
                        raise SandboxResourceError(
                            f"every host able to run image {image or 'default'} stayed at "
                            f"its cap for {self.config.acquire_timeout_s:.0f} s"
                        )
                    raise SandboxUnavailableError(
                        f"no healthy host for image {image or 'default'}: circuit breakers "
                        f"open on {', '.join(h.name for h in able)}"
                    )
                reopen = [h.breaker.reopens_at for h in able if h.breaker.state == "open"]
                wake = min([deadline, *reopen])
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(wake - now, 0.0) + 0.01)

    async def _release(self, host: FleetHost) -> None:
        host.active -= 1
        async with self._changed:
            self._changed.notify_all()

    async def _close_on(self, host: FleetHost, sandbox_id: str) -> None:
        """Close a handed-out sandbox on its host (bounded) and free its slot."""
        try:
            close = host.host.close_sandbox(sandbox_id)
            deadline_s = self.config.call_deadline_s
            await self._call(host, close, deadline_s, "close a sandbox", cancel=False)
        except SandboxError as exc:
            logger.warning(
                "fleet: sandbox %s on %s not closed (reaping removes it): %s",
                sandbox_id,
                host.name,
                exc,
            )
        finally:
            await self._release(host)

    def _close_late(self, host: FleetHost, created: Created) -> None:
        """A start abandoned at its deadline finished after all: close what it made."""
        self.events["late_starts_closed"] += 1
        close = self._call(
            host,
            host.host.close_sandbox(created.sandbox_id),
            self.config.call_deadline_s,
            "close a late sandbox",
            cancel=False,
        )
        self._keep(asyncio.ensure_future(close))

    async def _call(
        self,
        host: FleetHost,
        call: Awaitable[T],
        deadline_s: float,
        action: str,
        *,
        cancel: bool,
        on_late: Callable[[T], None] | None = None,
        blame_deadline: bool = True,
    ) -> T:
        """`call` on `host` within `deadline_s`. Past it (or when the caller is cancelled)
        the call is abandoned: cancelled when `cancel` (a command: the host kills it),
        else left to finish, `on_late` receiving a result that arrives after all.
        Infrastructure failures (not file refusals) count against the host's breaker, and
        so does the deadline when `blame_deadline` (not when the caller cut it short)."""
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=deadline_s)
        except asyncio.CancelledError:
            self._abandon(task, cancel, on_late)
            host.breaker.undecided()
            raise
        if not done:
            self._abandon(task, cancel, on_late)
            if blame_deadline:
                self._failed(host, FleetDeadlineError.__name__)
            else:
                self.failures_by_kind[FleetDeadlineError.__name__] += 1
                host.breaker.undecided()
            raise FleetDeadlineError(
                f"host {host.name} did not {action} within {deadline_s:.1f} s; the call was "
                "abandoned and its effects are unknown"
            )
        try:
            result = task.result()
        except (SandboxFileError, SandboxClosedError) as exc:
            self.failures_by_kind[type(exc).__name__] += 1
            raise
        except SandboxError as exc:
            self._failed(host, type(exc).__name__)
            raise
        except BaseException:
            host.breaker.undecided()
            raise
        host.breaker.succeeded()
        return result

    def _failed(self, host: FleetHost, kind: str) -> None:
        self.failures_by_kind[kind] += 1
        host.breaker.failed(time.monotonic())

    def _abandon(
        self, task: asyncio.Future[T], cancel: bool, on_late: Callable[[T], None] | None
    ) -> None:
        if cancel:
            task.cancel()

        def finished(done: asyncio.Future[T]) -> None:
            if done.cancelled() or done.exception() is not None:
                return
            if on_late is not None:
                on_late(done.result())

        task.add_done_callback(finished)
        self._keep(task)

    def _keep(self, task: asyncio.Future[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- images, status, metrics -----------------------------------------------------------

    async def prefetch(self, images: Sequence[str | None]) -> None:
        """Have every healthy host able to run them fetch `images` and fill their warm
        pools now (None: a host's default image); failures are logged and counted."""

        async def one(host: FleetHost) -> None:
            wanted = [image for image in images if host.image_key(image) is not None]
            if not wanted or not host.breaker.accepts(time.monotonic()):
                return
            try:
                await self._call(
                    host,
                    host.host.prepare(wanted),
                    self.config.pull_deadline_s,
                    "prefetch",
                    cancel=False,
                )
            except SandboxError as exc:
                logger.warning("fleet: host %s could not prefetch %s: %s", host.name, wanted, exc)

        await asyncio.gather(*(one(host) for host in self._hosts.values()))
        await self.refresh()

    async def refresh(self) -> None:
        """Ask every host for its status now (bounded; a host that does not answer keeps
        its last one)."""
        await asyncio.gather(*(self._refresh_host(host) for host in self._hosts.values()))

    async def _refresh_host(self, host: FleetHost) -> None:
        if host.status_call is None or host.status_call.done():
            host.status_call = asyncio.ensure_future(host.host.status())
            host.status_call.add_done_callback(_retrieve)
        done, _ = await asyncio.wait({host.status_call}, timeout=self.config.call_deadline_s)
        if done and not host.status_call.cancelled() and host.status_call.exception() is None:
            host.status = host.status_call.result()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            await self.refresh()

    def metrics(self) -> dict[str, Any]:
        """Counters and latency summaries; host counters are as of the last refresh."""
        host_counters: Counter[str] = Counter()
        hosts: dict[str, dict[str, Any]] = {}
        for host in self._hosts.values():
            status = host.status
            if status is not None:
                host_counters.update(status.counters)
            hosts[host.name] = {
                "breaker": host.breaker.state,
                "breaker_opens": host.breaker.opens,
                "active": host.active,
                "warm": dict(status.warm) if status else {},
            }
        return {
            "creation_s": self.creation_s.summary(),
            "exec_latency_s": self.exec_latency_s.summary(),
            "failures_by_kind": dict(self.failures_by_kind),
            "acquired": self.events["acquired"],
            "warm_hits": self.events["warm_hits"],
            "retries": self.events["retries"],
            "late_starts_closed": self.events["late_starts_closed"],
            "breaker_opens": sum(host.breaker.opens for host in self._hosts.values()),
            "starts": host_counters["starts"],
            "image_pulls": host_counters["image_pulls"],
            "image_builds": host_counters["image_builds"],
            "images_removed": host_counters["images_removed"],
            "warm_dead": host_counters["warm_dead"],
            "reaped": host_counters["reaped"],
            "unreaped_hosts": list(self._unreaped),
            "hosts": hosts,
        }


class FleetSandbox(StartsAndCloses):
    """A sandbox on one of the fleet's hosts (`Sandbox`); `start()` places it on one (as
    `Fleet.acquire` does at once). No call is retried: after an infrastructure failure
    or a missed deadline the sandbox refuses further calls with SandboxDiedError."""

    def __init__(self, fleet: Fleet, image: str | None = None) -> None:
        self._fleet = fleet
        self.requested_image = image
        self._host: FleetHost | None = None
        self.host_name: str | None = None
        self.sandbox_id: str | None = None
        self.image: str | None = None
        """The image it runs, once started (LOCAL_IMAGE on a local host)."""
        self.warm = False
        """Taken from a warm pool."""
        self.start_attempts = 0
        """Starts it took (1: the first host started it)."""
        self._start_lock = asyncio.Lock()
        self._failure: str | None = None
        self._closed = False

    async def start(self) -> None:
        async with self._start_lock:
            self._check_usable()
            if self._host is not None:
                return
            host, created, attempts = await self._fleet._start(self.requested_image)
            if self._closed:  # closed by another task while it started
                await self._fleet._close_on(host, created.sandbox_id)
                raise SandboxClosedError("the sandbox was closed while it started")
            self._host, self.host_name, self.sandbox_id = host, host.name, created.sandbox_id
            self.image, self.warm, self.start_attempts = created.image, created.warm, attempts
            self._fleet._handles.add(self)

    async def _placed(self) -> tuple[FleetHost, str]:
        await self.start()
        assert self._host is not None and self.sandbox_id is not None
        return self._host, self.sandbox_id

    async def exec(
        self,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        host, sandbox_id = await self._placed()
        deadline_s = timeout_s + self._fleet.config.exec_margin_s
        started = time.monotonic()
        call = host.host.exec(sandbox_id, cmd, timeout_s, cwd, env)
        result = await self._forward(host, call, deadline_s, "finish a command")
        self._fleet.exec_latency_s.add(time.monotonic() - started)
        return result

    async def write_file(self, path: str, data: bytes) -> None:
        host, sandbox_id = await self._placed()
        call = host.host.write_file(sandbox_id, path, data)
        await self._forward(host, call, self._fleet.config.call_deadline_s, "write a file")

    async def read_file(self, path: str) -> bytes:
        host, sandbox_id = await self._placed()
        call = host.host.read_file(sandbox_id, path)
        return await self._forward(host, call, self._fleet.config.call_deadline_s, "read a file")

    async def is_alive(self) -> bool:
        if self._closed or self._failure is not None or self._host is None:
            return False
        assert self.sandbox_id is not None
        call = self._host.host.is_alive(self.sandbox_id)
        deadline_s = self._fleet.config.call_deadline_s
        try:
            return await self._forward(self._host, call, deadline_s, "check a sandbox")
        except SandboxError:
            return False

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._host is not None and self.sandbox_id is not None:
            self._fleet._handles.discard(self)
            await self._fleet._close_on(self._host, self.sandbox_id)

    async def _forward(
        self, host: FleetHost, call: Awaitable[T], deadline_s: float, action: str
    ) -> T:
        try:
            self._check_usable()
        except SandboxError:
            if asyncio.iscoroutine(call):
                call.close()  # never started
            raise
        try:
            return await self._fleet._call(host, call, deadline_s, action, cancel=True)
        except SandboxDiedError as exc:
            self._failure = f"{type(exc).__name__}: {exc}"
            raise

    def _check_usable(self) -> None:
        if self._closed:
            raise SandboxClosedError("the sandbox is closed")
        if self._failure is not None:
            raise SandboxDiedError(
                f"the sandbox failed earlier and is not used again: {self._failure}"
            )

    def __repr__(self) -> str:
        return f"FleetSandbox({self.sandbox_id} on {self.host_name})"


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a background future's exception as seen (its caller already gave up)."""
    if not future.cancelled():
        future.exception()
