"""Fleet: sandboxes for many concurrent trajectories, placed over a set of hosts.

A host (`SandboxHost`) runs sandboxes of one backend (local or Docker) up to a cap, keeps
a warm pool per image, knows the images it holds (pulls or builds ahead of need, removes
the least recently used under a disk budget) and reaps what a crashed run left behind.
The fleet places each new sandbox on a healthy host with a free slot (one with a warm
sandbox for the image first, then one holding the image, then the least loaded) and
hands out a `FleetSandbox`, which implements the `Sandbox` protocol by calling the host.

Failure rules (DESIGN.md invariant 5):
- a failed start is retried on another host, with backoff: nothing of the trajectory ran;
- a command, a file transfer or a liveness check is never retried: its effects are
  unknown, so the SandboxError goes to the caller, which ends the trajectory with status
  sandbox_error and the reason; the sandbox is not used again after it died;
- every call to a host has a deadline (a command's: its timeout plus a margin); past it
  the call raises FleetDeadlineError and is abandoned, so a paused container, a hung
  daemon or a stopped host cannot hold a trajectory; a start that finishes late is closed;
- each host has a circuit breaker: after `breaker_failures` infrastructure failures in a
  row no new sandbox goes there for `breaker_cooldown_s`, then one start may probe it.

On one machine hosts run in this process (`InProcessHost`); across machines each host is
a Ray actor on its node (`sandbox.fleet_ray.RayHost`).

Limits, stated plainly:
- Leftovers are reaped by the host that made them (containers by label, local sandboxes
  by their uid range), when it opens or shuts down; a host that cannot be reached (its
  daemon down, its actor dead on another node) keeps them until a host with its name and
  owner opens there again.
- A daemon may itself hang on a container: with cgroup v1, a `docker pause` that lands
  while runc is starting an exec leaves `runc init` frozen and the container locked in
  the daemon (even unpause hangs) until its freezer cgroup is thawed by hand. Deadlines
  still hold; reaping cannot remove that container.
- The disk budget counts docker's per-image size, shared layers once per image.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import os
import random
import secrets
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar

import docker.errors
import requests
from docker.utils import parse_repository_tag
from pydantic import BaseModel, ConfigDict, Field

from sandbox import leases
from sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxResourceError,
    SandboxStartError,
    SandboxUnavailableError,
    StartsAndCloses,
)
from sandbox.docker import OWNER_LABEL, DockerSandbox, DockerSandboxConfig, docker_client, reap
from sandbox.local import LocalSandbox, LocalSandboxConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")
HOST_LABEL = "opd.fleet.host"
"""Label of every container a fleet host starts: the host's name."""
SANDBOX_ID_LABEL = "opd.fleet.sandbox"
"""Label of every container a fleet host starts: the fleet's id of the sandbox."""
LOCAL_IMAGE = "local"
"""The one "image" of a local host (its warm-pool key)."""
_DOCKER_FAILURES = (docker.errors.DockerException, requests.exceptions.RequestException)


class FleetDeadlineError(SandboxDiedError):
    """A host did not answer a call within its deadline; the call was abandoned."""


# -- wire format between the fleet and its hosts --------------------------------------------


class ImageBuild(BaseModel):
    """How a host builds an image it lacks (instead of pulling it)."""

    model_config = ConfigDict(extra="forbid")

    context: Path
    """Build context directory on the host."""
    dockerfile: str = "Dockerfile"
    """Dockerfile path inside the context."""
    buildargs: dict[str, str] = Field(default_factory=dict)


class HostConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Unique in the fleet; labels the host's containers (opd.fleet.host)."""
    backend: Literal["local", "docker"] = "local"
    local: LocalSandboxConfig = Field(default_factory=LocalSandboxConfig)
    """Sandboxes of the local backend (they run no images)."""
    docker: DockerSandboxConfig = Field(default_factory=DockerSandboxConfig)
    """Sandboxes of the docker backend: `image` is the default image; the host sets
    `owner` and adds its labels."""
    max_sandboxes: int = Field(default=16, ge=1)
    """Handed-out plus warm sandboxes at once (a warm refill in flight may add one)."""
    warm_per_image: int = Field(default=0, ge=0)
    """Started sandboxes kept ready for each image asked for; 0: every start is cold."""
    warm_starts_at_once: int = Field(default=4, ge=1)
    """Warm sandboxes a refill starts at a time (they compete with running commands)."""
    builds: dict[str, ImageBuild] = Field(default_factory=dict)
    """Images this host builds when missing; others are pulled."""
    image_disk_budget_gb: float | None = Field(default=None, gt=0)
    """While the images this host pulled or built take more than this (docker's per-image
    size, shared layers counted in each), the least recently used one not in use is
    removed; None: never. Images it found present are never removed."""


class HostStatus(BaseModel):
    """What the fleet places by: a host's capacity, warm pool and images."""

    name: str
    backend: Literal["local", "docker"]
    default_image: str | None
    max_sandboxes: int
    handed_out: int
    warm: dict[str, int]
    """Warm sandboxes per image."""
    images: list[str]
    """Image tags present on the host (docker)."""
    counters: dict[str, int]
    """starts, warm_hits, warm_dead, warm_failures, image_pulls, image_builds,
    images_removed, reaped."""

    def image_key(self, image: str | None) -> str | None:
        """The image a sandbox for `image` runs here; None: this host cannot run it."""
        if self.backend == "local":
            return LOCAL_IMAGE if image is None else None
        return image or self.default_image


class Created(BaseModel):
    sandbox_id: str
    image: str
    """The image it runs (LOCAL_IMAGE on a local host)."""
    warm: bool
    """Taken from the warm pool (checked alive first) rather than started for the call."""


class SandboxHost(Protocol):
    """Where a fleet's sandboxes run: this process, or a Ray actor on some node. Sandboxes
    are named by id, so the same calls cross a process boundary."""

    @property
    def name(self) -> str: ...

    async def open(self) -> HostStatus:
        """Reap what an earlier run of the same owner left here, then report."""
        ...

    async def status(self) -> HostStatus: ...

    async def prepare(self, images: list[str | None]) -> None:
        """Fetch the images now and fill their warm pools (None: the default image)."""

    async def create(self, image: str | None) -> Created:
        """A started sandbox: a live warm one, else a new one; SandboxStartError et al."""
        ...

    async def exec(
        self,
        sandbox_id: str,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult: ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def is_alive(self, sandbox_id: str) -> bool: ...

    async def close_sandbox(self, sandbox_id: str) -> None: ...

    async def shutdown(self) -> int:
        """Close every sandbox, reap by label; returns how many leftovers were reaped."""
        ...


# -- a host in this process -----------------------------------------------------------------


class InProcessHost:
    """Sandboxes of one backend started by this process: cap, warm pool, images, reaping."""

    def __init__(self, config: HostConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        """Value of the opd.owner label of its containers: the run's id."""
        self.counters: Counter[str] = Counter()
        self._handed_out: dict[str, tuple[str, Sandbox]] = {}
        """Sandbox id -> (image, sandbox)."""
        self._warm: dict[str, list[tuple[str, Sandbox]]] = {}
        """Image -> [(sandbox id, sandbox)], oldest first."""
        self._starting_handout = 0
        self._starting_warm = 0
        self._refills: dict[str, asyncio.Task[None]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._client: docker.DockerClient | None = None
        self._client_lock = asyncio.Lock()
        self._image_locks: dict[str, asyncio.Lock] = {}
        self._last_use: dict[str, float] = {}
        self._fetched: set[str] = set()
        """Images this host pulled or built: the only ones it may remove."""
        self._closed = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def _labels(self) -> dict[str, str]:
        return {OWNER_LABEL: self.owner, HOST_LABEL: self.name}

    async def open(self) -> HostStatus:
        self.counters["reaped"] += await self._reap()
        return await self.status()

    async def status(self) -> HostStatus:
        images: list[str] = []
        if self.config.backend == "docker":
            client = await self._docker()
            try:
                images = await asyncio.to_thread(_image_tags, client)
            except _DOCKER_FAILURES as exc:
                message = f"host {self.name}: cannot list images: {exc}"
                raise SandboxUnavailableError(message) from exc
        return HostStatus(
            name=self.name,
            backend=self.config.backend,
            default_image=self.config.docker.image if self.config.backend == "docker" else None,
            max_sandboxes=self.config.max_sandboxes,
            handed_out=len(self._handed_out),
            warm={image: len(pool) for image, pool in self._warm.items() if pool},
            images=images,
            counters=dict(self.counters),
        )

    async def prepare(self, images: list[str | None]) -> None:
        for image in images:
            key = self._image_key(image)
            if self.config.backend == "docker":
                await self._ensure_image(key)
            self._refill(key)
            if refill := self._refills.get(key):
                await asyncio.shield(refill)

    async def create(self, image: str | None) -> Created:
        self._check_open()
        key = self._image_key(image)
        pool = self._warm.setdefault(key, [])
        while pool:
            sandbox_id, sandbox = pool.pop(0)
            try:
                alive = await sandbox.is_alive()
            except BaseException:
                self._in_background(_close_quietly(sandbox))
                raise
            if alive:
                self._handed_out[sandbox_id] = (key, sandbox)
                self.counters["warm_hits"] += 1
                self._refill(key)
                return Created(sandbox_id=sandbox_id, image=key, warm=True)
            self.counters["warm_dead"] += 1
            self._in_background(_close_quietly(sandbox))
        if len(self._handed_out) + self._starting_handout >= self.config.max_sandboxes:
            raise SandboxResourceError(
                f"host {self.name} is at its cap of {self.config.max_sandboxes} sandboxes"
            )
        self._starting_handout += 1
        try:
            sandbox_id, sandbox = await self._start(key)
        finally:
            self._starting_handout -= 1
        if self._closed:  # shut down while it started
            await _close_quietly(sandbox)
            self._check_open()
        self._handed_out[sandbox_id] = (key, sandbox)
        self._trim_warm(keep=key)
        self._refill(key)
        return Created(sandbox_id=sandbox_id, image=key, warm=False)

    async def exec(
        self,
        sandbox_id: str,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        return await self._get(sandbox_id).exec(cmd, timeout_s, cwd, env)

    async def write_file(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._get(sandbox_id).write_file(path, data)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._get(sandbox_id).read_file(path)

    async def is_alive(self, sandbox_id: str) -> bool:
        entry = self._handed_out.get(sandbox_id)
        return entry is not None and await entry[1].is_alive()

    async def close_sandbox(self, sandbox_id: str) -> None:
        entry = self._handed_out.pop(sandbox_id, None)
        if entry is not None:
            await entry[1].close()

    async def shutdown(self) -> int:
        self._closed = True
        for task in (*self._refills.values(), *self._background):
            task.cancel()
        await asyncio.gather(*self._refills.values(), *self._background, return_exceptions=True)
        sandboxes = [sandbox for _, sandbox in self._handed_out.values()]
        sandboxes += [sandbox for pool in self._warm.values() for _, sandbox in pool]
        self._handed_out.clear()
        self._warm.clear()
        await asyncio.gather(*(_close_quietly(sandbox) for sandbox in sandboxes))
        try:
            reaped = await self._reap()
        finally:
            if self._client is not None:
                self._client.close()
                self._client = None
        self.counters["reaped"] += reaped
        return reaped

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosedError(f"host {self.name} is shut down")

    def _get(self, sandbox_id: str) -> Sandbox:
        entry = self._handed_out.get(sandbox_id)
        if entry is None:
            raise SandboxClosedError(
                f"host {self.name} holds no sandbox {sandbox_id} (closed, or started elsewhere)"
            )
        return entry[1]

    def _image_key(self, image: str | None) -> str:
        if self.config.backend == "docker":
            return image or self.config.docker.image
        if image is not None:
            raise SandboxUnavailableError(
                f"host {self.name} runs local sandboxes; it cannot run the image {image}"
            )
        return LOCAL_IMAGE

    async def _start(self, image: str) -> tuple[str, Sandbox]:
        sandbox_id = f"{self.name}-{secrets.token_hex(6)}"
        sandbox: Sandbox
        if self.config.backend == "local":
            sandbox = LocalSandbox(self.config.local)
        else:
            client = await self._docker()
            await self._ensure_image(image)
            base = self.config.docker
            labels = {**base.labels, HOST_LABEL: self.name, SANDBOX_ID_LABEL: sandbox_id}
            update = {"image": image, "owner": self.owner, "labels": labels}
            sandbox = DockerSandbox(base.model_copy(update=update), client)
        try:
            await sandbox.start()
        except BaseException:
            await _close_quietly(sandbox)
            raise
        self.counters["starts"] += 1
        self._last_use[image] = time.time()
        return sandbox_id, sandbox

    async def _docker(self) -> docker.DockerClient:
        """The host's one client, made on first use (making it asks the daemon)."""
        async with self._client_lock:
            if self._client is None:
                cfg = self.config.docker
                concurrency = self.config.max_sandboxes + 2
                try:
                    self._client = await asyncio.to_thread(
                        docker_client, concurrency, cfg.docker_url, cfg.api_timeout_s
                    )
                except _DOCKER_FAILURES as exc:
                    where = cfg.docker_url or "DOCKER_HOST or the local socket"
                    raise SandboxUnavailableError(
                        f"host {self.name}: no Docker daemon answers at {where}: {exc}"
                    ) from exc
            return self._client

    async def _ensure_image(self, image: str) -> None:
        """Pull or build `image` unless present, then keep the fetched ones under budget."""
        client = await self._docker()
        async with self._image_locks.setdefault(image, asyncio.Lock()):
            try:
                present = await asyncio.to_thread(_has_image, client, image)
                if not present:
                    build = self.config.builds.get(image)
                    await asyncio.to_thread(_fetch_image, client, image, build)
                    self.counters["image_builds" if build else "image_pulls"] += 1
                    self._fetched.add(image)
                self._last_use[image] = time.time()
                if not present and self.config.image_disk_budget_gb is not None:
                    in_use = {image, *(used for used, _ in self._handed_out.values())}
                    in_use |= {used for used, pool in self._warm.items() if pool}
                    removed = await asyncio.to_thread(self._collect_images, client, in_use)
                    self.counters["images_removed"] += removed
            except _DOCKER_FAILURES as exc:
                raise SandboxStartError(f"host {self.name}: cannot fetch {image}: {exc}") from exc

    def _collect_images(self, client: docker.DockerClient, in_use: set[str]) -> int:
        """Remove fetched images not in `in_use`, least recently used first, until under
        the budget."""
        assert self.config.image_disk_budget_gb is not None
        budget = self.config.image_disk_budget_gb * 1e9
        sizes: dict[str, int] = {}
        for image in list(self._fetched):
            try:
                sizes[image] = int(client.images.get(image).attrs.get("Size") or 0)
            except docker.errors.ImageNotFound:
                self._fetched.discard(image)
        total, removed = sum(sizes.values()), 0
        for image in sorted(sizes, key=lambda tag: self._last_use.get(tag, 0.0)):
            if total <= budget:
                break
            if image in in_use:
                continue
            try:
                client.images.remove(image)
            except docker.errors.APIError as exc:  # a container of someone else uses it
                logger.info("host %s keeps image %s: %s", self.name, image, exc)
                continue
            self._fetched.discard(image)
            total -= sizes[image]
            removed += 1
        return removed

    def _refill(self, image: str) -> None:
        """Top up the warm pool of `image` in the background."""
        if self.config.warm_per_image == 0 or self._closed or image in self._refills:
            return
        task = asyncio.create_task(self._keep_warm(image))
        self._refills[image] = task
        task.add_done_callback(lambda _: self._refills.pop(image, None))

    async def _keep_warm(self, image: str) -> None:
        """Start the missing warm sandboxes, a few at a time; stop at the cap or at a
        failure (the next hand-out tries again)."""
        pool = self._warm.setdefault(image, [])
        while not self._closed:
            missing = self.config.warm_per_image - len(pool)
            free = self.config.max_sandboxes - self._load()
            count = min(missing, free, self.config.warm_starts_at_once)
            if count <= 0:
                return
            self._starting_warm += count
            try:
                results = await asyncio.gather(
                    *(self._start(image) for _ in range(count)), return_exceptions=True
                )
            finally:
                self._starting_warm -= count
            for result in results:
                if isinstance(result, BaseException):
                    self.counters["warm_failures"] += 1
                    logger.warning(
                        "host %s: a warm start of %s failed: %s", self.name, image, result
                    )
                else:
                    pool.append(result)
            if any(isinstance(result, BaseException) for result in results):
                return

    def _load(self) -> int:
        warm = sum(len(pool) for pool in self._warm.values())
        return len(self._handed_out) + warm + self._starting_handout + self._starting_warm

    def _trim_warm(self, keep: str) -> None:
        """Close warm sandboxes (other images' first) while the host is over its cap."""
        pools = sorted(self._warm.items(), key=lambda item: item[0] == keep)
        for _, pool in pools:
            while pool and self._load() > self.config.max_sandboxes:
                _, sandbox = pool.pop(0)
                self._in_background(_close_quietly(sandbox))

    def _in_background(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _reap(self) -> int:
        if self.config.backend == "local":
            return await reap_local(self.config.local)
        client = await self._docker()
        try:
            return await asyncio.to_thread(reap, self._labels, client)
        except _DOCKER_FAILURES as exc:
            raise SandboxUnavailableError(f"host {self.name}: cannot reap: {exc}") from exc


async def _close_quietly(sandbox: Sandbox) -> None:
    try:
        await sandbox.close()
    except Exception as exc:  # closing is best effort; reaping finds what is left
        logger.warning("closing a sandbox failed (reaping removes its leftovers): %s", exc)


def _image_tags(client: docker.DockerClient) -> list[str]:
    return sorted(tag for image in client.images.list() for tag in image.tags)


def _has_image(client: docker.DockerClient, image: str) -> bool:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


def _fetch_image(client: docker.DockerClient, image: str, build: ImageBuild | None) -> None:
    if build is not None:
        client.images.build(
            path=str(build.context),
            dockerfile=build.dockerfile,
            tag=image,
            buildargs=build.buildargs,
            rm=True,
            forcerm=True,
        )
        return
    repository, tag = parse_repository_tag(image)
    client.images.pull(repository, tag=tag or "latest")


async def reap_local(config: LocalSandboxConfig) -> int:
    """Kill the processes and remove the working directories that dead holders left in
    `config`'s uid range (a live sandbox holds its uid's lock and is skipped). Root only:
    otherwise sandboxes run as this user and cannot be told apart. Returns uids reaped."""
    root = config.root_dir or leases.default_root_dir()
    if os.geteuid() != 0 or not (root / "locks").is_dir():
        return 0
    first, end = config.uid_base, config.uid_base + config.uid_count
    reaped = 0
    for uid in sorted(await asyncio.to_thread(_leftover_uids, root, first, end)):
        lock_fd = os.open(root / "locks" / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            await leases.kill_uid_processes(uid)
            try:
                await asyncio.to_thread(leases.remove_tree, root / f"work-{uid}")
            except OSError as exc:  # the next holder of the uid retries
                logger.warning("cannot remove the working directory of uid %d: %s", uid, exc)
            reaped += 1
        finally:
            os.close(lock_fd)
    return reaped


def _leftover_uids(root: Path, first: int, end: int) -> set[int]:
    """Uids in [first, end) that run a process or own a working directory under `root`."""
    uids = {
        int(entry.name[5:])
        for entry in os.scandir(root)
        if entry.name.startswith("work-") and entry.name[5:].isdigit()
    }
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/status") as status:
                uid_line = next(line for line in status if line.startswith("Uid:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        uids.add(int(uid_line.split()[1]))
    return {uid for uid in uids if first <= uid < end}


# -- the fleet ------------------------------------------------------------------------------


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


class CircuitBreaker:
    """Closed: new sandboxes may go to the host. `failures_to_open` infrastructure
    failures in a row open it; after `cooldown_s` one start may probe (half open): its
    success closes the breaker, its failure opens it again."""

    def __init__(self, failures_to_open: int, cooldown_s: float) -> None:
        self.failures_to_open = failures_to_open
        self.cooldown_s = cooldown_s
        self.state: Literal["closed", "open", "half_open"] = "closed"
        self.failures = 0
        self.opened_at = 0.0
        self.opens = 0

    def accepts(self, now: float) -> bool:
        if self.state == "open":
            return now >= self.reopens_at
        return self.state == "closed"

    @property
    def reopens_at(self) -> float:
        return self.opened_at + self.cooldown_s

    def placed(self) -> None:
        """A start goes to the host (the probe, when the breaker was open)."""
        if self.state == "open":
            self.state = "half_open"

    def succeeded(self) -> None:
        self.state, self.failures = "closed", 0

    def failed(self, now: float) -> None:
        self.failures += 1
        if self.state != "closed" or self.failures >= self.failures_to_open:
            self.trip(now)

    def undecided(self) -> None:
        """A probe ended without a verdict (its caller gave up first): another may go."""
        if self.state == "half_open":
            self.state = "open"

    def trip(self, now: float) -> None:
        """Open now (a failure while open restarts the cooldown)."""
        if self.state != "open":
            self.opens += 1
        self.state, self.opened_at = "open", now


class _Samples:
    """A latency histogram: count and mean of all, quantiles of the latest `keep`."""

    def __init__(self, keep: int = 10_000) -> None:
        self.latest: deque[float] = deque(maxlen=keep)
        self.count = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.latest.append(value)
        self.count += 1
        self.total += value

    def summary(self) -> dict[str, float]:
        if not self.count:
            return {"count": 0}
        ordered = sorted(self.latest)

        def quantile(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        return {
            "count": self.count,
            "mean": self.total / self.count,
            "p50": quantile(0.5),
            "p90": quantile(0.9),
            "p99": quantile(0.99),
            "max": ordered[-1],
        }


class _Host:
    """The fleet's view of one host: breaker, slots in use, last status."""

    def __init__(self, host: SandboxHost, breaker: CircuitBreaker) -> None:
        self.host = host
        self.name = host.name
        self.breaker = breaker
        self.status: HostStatus | None = None
        """None until the host answered once: then it may take one sandbox at a time."""
        self.active = 0
        """Handed-out sandboxes plus starts in flight."""
        self.status_call: asyncio.Future[HostStatus] | None = None

    @property
    def cap(self) -> int:
        return 1 if self.status is None else self.status.max_sandboxes

    def image_key(self, image: str | None) -> str | None:
        """Its image for `image` ("" when unknown yet), None when it cannot run it."""
        return "" if self.status is None else self.status.image_key(image)

    def rank(self, image: str | None) -> tuple[bool, bool, float]:
        """Placement preference: a warm sandbox, the image present, a light load."""
        key = self.image_key(image)
        warm = self.status is not None and bool(key) and self.status.warm.get(key or "", 0) > 0
        holds = self.status is not None and (
            self.status.backend == "local" or key in self.status.images
        )
        return warm, holds, -self.active / self.cap


class Fleet:
    """Places sandboxes on hosts; see the module docstring. Use as `async with`."""

    def __init__(self, hosts: Sequence[SandboxHost], config: FleetConfig | None = None) -> None:
        self.config = config or FleetConfig()
        names = [host.name for host in hosts]
        if not hosts or len(set(names)) != len(names):
            raise ValueError(f"a fleet needs hosts with distinct names, got {names}")
        cfg = self.config
        self._hosts = {
            host.name: _Host(host, CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown_s))
            for host in hosts
        }
        self._changed = asyncio.Condition()
        self._handles: set[FleetSandbox] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._unreaped: list[str] = []
        self._opened = self._closed = False
        self.creation_s = _Samples()
        """From `acquire` called to a started sandbox, waits and retries included."""
        self.exec_latency_s = _Samples()
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

    async def _open_host(self, host: _Host) -> None:
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

    async def _shutdown_host(self, host: _Host) -> None:
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

    async def _start(self, image: str | None) -> tuple[_Host, Created, int]:
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

    def _note_created(self, host: _Host, created: Created) -> None:
        if created.warm:
            self.events["warm_hits"] += 1
        if host.status is not None:
            warm = host.status.warm
            if created.warm and warm.get(created.image):
                warm[created.image] -= 1
            if host.status.backend == "docker" and created.image not in host.status.images:
                host.status.images.append(created.image)

    async def _place(self, image: str | None, tried: list[str], deadline: float) -> _Host:
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

    async def _release(self, host: _Host) -> None:
        host.active -= 1
        async with self._changed:
            self._changed.notify_all()

    async def _close_on(self, host: _Host, sandbox_id: str) -> None:
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

    def _close_late(self, host: _Host, created: Created) -> None:
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
        host: _Host,
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

    def _failed(self, host: _Host, kind: str) -> None:
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

        async def one(host: _Host) -> None:
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

    async def _refresh_host(self, host: _Host) -> None:
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
        self._host: _Host | None = None
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

    async def _placed(self) -> tuple[_Host, str]:
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

    async def _forward(self, host: _Host, call: Awaitable[T], deadline_s: float, action: str) -> T:
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
