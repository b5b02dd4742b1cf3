"""Local images for the Docker sandbox tests, built without a registry and cached by tag.

The base is what docker/README.md documents for offline hosts: a Debian root made by
debootstrap (minbase + python3-minimal), trimmed and imported. The test image is
docker/sandbox-tir.Dockerfile built on it without extra packages, tagged with a hash of
the Dockerfile so an edited Dockerfile is rebuilt. Both are kept for later sessions.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import docker.errors
import pytest
import requests

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "sandbox-tir.Dockerfile"
BASE_IMAGE = "opd-sandbox-base:bookworm"
TEST_REPOSITORY = "opd-sandbox-tir"
MIRROR = os.environ.get("OPD_DEBIAN_MIRROR", "http://deb.debian.org/debian")
_TRIM = ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man")


@functools.cache
def daemon_problem() -> str | None:
    """Why no Docker daemon can be used here, or None when one answers."""
    try:
        docker.from_env(timeout=10).close()  # asks the daemon for its API version
    except (docker.errors.DockerException, requests.exceptions.RequestException) as exc:
        return f"no Docker daemon answers ({exc}); .ci/run installs and starts one"
    return None


def _has_image(client: docker.DockerClient, tag: str) -> bool:
    try:
        client.images.get(tag)
    except docker.errors.ImageNotFound:
        return False
    return True


def _build_base(client: docker.DockerClient) -> None:
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None or os.geteuid() != 0:
        pytest.skip(
            f"the test base image {BASE_IMAGE} is missing and building it needs root and "
            "debootstrap (apt-get install debootstrap); or build it as docker/README.md shows"
        )
    work = Path(tempfile.mkdtemp(prefix="opd-sandbox-rootfs-"))
    try:
        root = work / "root"
        command = [debootstrap, "--variant=minbase", "--include=python3-minimal", "bookworm"]
        made = subprocess.run([*command, root, MIRROR], capture_output=True, text=True)
        if made.returncode != 0:
            log = (made.stdout + made.stderr)[-3000:]
            raise RuntimeError(f"debootstrap failed ({MIRROR}):\n{log}")
        for trimmed in _TRIM:  # the image needs neither package caches nor docs
            for entry in (root / trimmed).glob("*"):
                if entry.is_symlink() or not entry.is_dir():
                    entry.unlink()
                elif entry.name != "partial":
                    shutil.rmtree(entry)
        tarball = work / "root.tar"
        subprocess.run(["tar", "-C", root, "-cf", tarball, "."], check=True)
        repository, tag = BASE_IMAGE.split(":")
        client.api.import_image_from_file(str(tarball), repository=repository, tag=tag)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def sandbox_test_image() -> str:
    """The tag of a python-capable image built from docker/sandbox-tir.Dockerfile; builds
    the base and the image when they are missing (about a minute, once per host)."""
    digest = hashlib.sha256(DOCKERFILE.read_bytes()).hexdigest()[:12]
    tag = f"{TEST_REPOSITORY}:test-{digest}"
    client = docker.from_env(timeout=600)
    try:
        if _has_image(client, tag):
            return tag
        started = time.monotonic()
        if not _has_image(client, BASE_IMAGE):
            _build_base(client)
        client.images.build(
            path=str(DOCKERFILE.parent),
            dockerfile=DOCKERFILE.name,
            tag=tag,
            buildargs={"BASE": BASE_IMAGE, "PACKAGES": ""},
            rm=True,
            forcerm=True,
        )
        print(f"built {tag} in {time.monotonic() - started:.1f} s")
        return tag
    finally:
        client.close()
