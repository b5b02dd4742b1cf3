"""The docker images a host holds: listing them, whether one is present, pulling or
building one (blocking calls: a host runs them in a thread)."""

from __future__ import annotations

import docker.errors
from docker.utils import parse_repository_tag

from sandbox.fleet.hosts import ImageBuild


def image_tags(client: docker.DockerClient) -> list[str]:
    return sorted(tag for image in client.images.list() for tag in image.tags)


def has_image(client: docker.DockerClient, image: str) -> bool:
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    return True


def fetch_image(client: docker.DockerClient, image: str, build: ImageBuild | None) -> None:
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
