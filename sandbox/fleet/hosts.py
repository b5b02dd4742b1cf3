"""What passes between the fleet and its hosts: a host's settings (`HostConfig`), its
status (`HostStatus`), what a start returns (`Created`), the `SandboxHost` protocol, and
the labels of the containers a host starts."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from sandbox.base import ExecResult
from sandbox.docker import DockerSandboxConfig
from sandbox.local import LocalSandboxConfig

HOST_LABEL = "opd.fleet.host"
"""Label of every container a fleet host starts: the host's name."""
SANDBOX_ID_LABEL = "opd.fleet.sandbox"
"""Label of every container a fleet host starts: the fleet's id of the sandbox."""
LOCAL_IMAGE = "local"
"""The one "image" of a local host (its warm-pool key)."""


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
