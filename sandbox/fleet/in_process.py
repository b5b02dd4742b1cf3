"""`InProcessHost`: a host whose sandboxes this process starts (cap, warm pool per image,
the images it holds, reaping), and `reap_local`, which reaps local sandboxes' leftovers by
uid."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path

import docker.errors

from sandbox import leases
from sandbox.base import (
    ExecResult,
    Sandbox,
    SandboxClosedError,
    SandboxResourceError,
    SandboxStartError,
    SandboxUnavailableError,
)
from sandbox.docker import DOCKER_FAILURES, OWNER_LABEL, DockerSandbox, docker_client, reap
from sandbox.fleet.hosts import (
    HOST_LABEL,
    LOCAL_IMAGE,
    SANDBOX_ID_LABEL,
    Created,
    HostConfig,
    HostStatus,
)
from sandbox.fleet.images import fetch_image, has_image, image_tags
from sandbox.local import LocalSandbox, LocalSandboxConfig

logger = logging.getLogger(__name__)


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
                images = await asyncio.to_thread(image_tags, client)
            except DOCKER_FAILURES as exc:
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
                except DOCKER_FAILURES as exc:
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
                present = await asyncio.to_thread(has_image, client, image)
                if not present:
                    build = self.config.builds.get(image)
                    await asyncio.to_thread(fetch_image, client, image, build)
                    self.counters["image_builds" if build else "image_pulls"] += 1
                    self._fetched.add(image)
                self._last_use[image] = time.time()
                if not present and self.config.image_disk_budget_gb is not None:
                    in_use = {image, *(used for used, _ in self._handed_out.values())}
                    in_use |= {used for used, pool in self._warm.items() if pool}
                    removed = await asyncio.to_thread(self._collect_images, client, in_use)
                    self.counters["images_removed"] += removed
            except DOCKER_FAILURES as exc:
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
        except DOCKER_FAILURES as exc:
            raise SandboxUnavailableError(f"host {self.name}: cannot reap: {exc}") from exc


async def _close_quietly(sandbox: Sandbox) -> None:
    try:
        await sandbox.close()
    except Exception as exc:  # closing is best effort; reaping finds what is left
        logger.warning("closing a sandbox failed (reaping removes its leftovers): %s", exc)


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
