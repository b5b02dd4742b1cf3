"""Local images for the Docker sandbox tests, built without a registry and cached by tag.

The base is what docker/README.md documents for offline hosts: a Debian root made by
debootstrap (minbase + python3-minimal), trimmed and imported. The test image is
docker/sandbox-tir.Dockerfile built on it without extra packages, tagged with a hash of
the Dockerfile so an edited Dockerfile is rebuilt; the SWE base image
(`swe_base_test_image`) likewise, with git and pytest. The SWE-bench-style image
(`swebench_style_test_image`) adds git and python3-venv from the Debian mirror and a
conda-like environment on the same base. All are kept for later sessions.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import docker.errors
import pytest
import requests
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.host_load import host_lock

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "sandbox-tir.Dockerfile"
SWE_BASE_DOCKERFILE = REPO / "docker" / "sandbox-swe-base.Dockerfile"
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
    return _dockerfile_image(DOCKERFILE, TEST_REPOSITORY, packages="")


def _dockerfile_image(dockerfile: Path, repository: str, packages: str) -> str:
    """`dockerfile` built on the test base with `packages` from the Debian mirror (none:
    no mirror needed), tagged `repository`:test-<hash of the Dockerfile> and kept."""
    digest = hashlib.sha256(dockerfile.read_bytes()).hexdigest()[:12]

    def build(client: docker.DockerClient, tag: str) -> None:
        if packages and (problem := mirror_problem()) is not None:
            pytest.skip(problem)
        client.images.build(
            path=str(dockerfile.parent),
            dockerfile=dockerfile.name,
            tag=tag,
            buildargs={"BASE": BASE_IMAGE, "PACKAGES": packages},
            rm=True,
            forcerm=True,
        )

    return _built_on_base(f"{repository}:test-{digest}", build)


def _built_on_base(tag: str, build: Callable[[docker.DockerClient, str], None]) -> str:
    """`tag`, built by `build` on the test base (itself built first when missing) unless
    this host has it already."""
    client = docker.from_env(timeout=600)
    try:
        if _has_image(client, tag):
            return tag
        # one build per host at a time, across test processes (pytest-xdist workers, two
        # sessions): another may be building it now
        with host_lock("docker-images"):
            return _build_on_base(client, tag, build)
    finally:
        client.close()


def _build_on_base(
    client: docker.DockerClient, tag: str, build: Callable[[docker.DockerClient, str], None]
) -> str:
    """`_built_on_base`'s work, under the build lock: `tag` may have been built meanwhile."""
    if _has_image(client, tag):
        return tag
    started = time.monotonic()
    if not _has_image(client, BASE_IMAGE):
        _build_base(client)
    build(client, tag)
    print(f"built {tag} in {time.monotonic() - started:.1f} s")
    return tag


def swe_base_test_image() -> str:
    """opd-sandbox-swe-base (docker/sandbox-swe-base.Dockerfile) built on the test base
    with the few packages a SWE task needs here (git, python3-venv, python3-pytest from
    the Debian mirror), tagged by a hash of the Dockerfile and kept, like the TIR image."""
    return _dockerfile_image(
        SWE_BASE_DOCKERFILE, "opd-sandbox-swe-base", packages="git python3-venv python3-pytest"
    )


# -- a SWE-bench-style task image ----------------------------------------------------------

SWEBENCH_STYLE_REPOSITORY = "opd-swebench-style"
SWEBENCH_STYLE_PACKAGE = "minirepo"
"""The repository's package: importable only inside its environment."""
_TESTBED_PYTHON = "/opt/miniconda3/envs/testbed/bin/python"
_TESTBED_PYTEST_DISTRIBUTIONS = ("pytest",)
"""Installed into the testbed env from this interpreter's own files (with their
dependencies), so the build needs no package index."""
_SWEBENCH_STYLE_DOCKERFILE = """\
ARG BASE
FROM ${BASE}
# hadolint ignore=DL3008
RUN set -eu; \\
    apt-get update; \\
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends git python3-venv; \\
    rm -rf /var/lib/apt/lists/*
COPY miniconda3/ /opt/miniconda3/
COPY testbed/ /testbed/
COPY site-packages/ /tmp/site-packages/
COPY bin/ /tmp/bin/
# The testbed env: a venv at the conda env's path, holding pytest and the repository
# (installed as `pip install -e` does, by a .pth naming its src directory).
RUN set -eu; \\
    ln -s /usr/bin/python3 /opt/miniconda3/bin/python; \\
    env=/opt/miniconda3/envs/testbed; \\
    python3 -m venv --without-pip "$env"; \\
    site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \\
    cp -a /tmp/site-packages/. "$site/"; \\
    rm -rf /tmp/site-packages; \\
    echo /testbed/src > "$site/{package}.pth"; \\
    cp -a /tmp/bin/. "$env/bin/"; \\
    rm -rf /tmp/bin; \\
    cd /testbed; \\
    git init -q; \\
    git add -A; \\
    git -c user.name=opd -c user.email=opd@localhost commit -qm base; \\
    echo "source /opt/miniconda3/etc/profile.d/conda.sh && conda activate testbed" > /root/.bashrc
ENV PATH=/opt/miniconda3/bin:$PATH
WORKDIR /testbed
CMD ["sleep", "infinity"]
""".replace("{package}", SWEBENCH_STYLE_PACKAGE)
_CONDA_SH = """\
# A stand-in for conda's shell function: `conda activate [ENV]` puts the env first on PATH.
# Safe under `set -u`, as swebench's eval scripts run it.
conda() {
    if [ "${1:-}" != activate ]; then
        echo "conda: this image's stand-in knows only 'conda activate [ENV]'" >&2
        return 2
    fi
    _opd_env=${2:-base}
    _opd_prefix=/opt/miniconda3
    if [ "$_opd_env" != base ]; then _opd_prefix=/opt/miniconda3/envs/$_opd_env; fi
    if [ ! -d "$_opd_prefix" ]; then
        echo "EnvironmentNameNotFound: Could not find conda environment: $_opd_env" >&2
        return 1
    fi
    export PATH="$_opd_prefix/bin:$PATH" CONDA_PREFIX="$_opd_prefix"
    export CONDA_DEFAULT_ENV="$_opd_env"
}
"""
_SWEBENCH_STYLE_FILES = {
    "miniconda3/etc/profile.d/conda.sh": _CONDA_SH,
    # As conda's: sourcing it defines `conda` and activates base (or the env named).
    "miniconda3/bin/activate": '. /opt/miniconda3/etc/profile.d/conda.sh && conda activate "$@"\n',
    f"testbed/src/{SWEBENCH_STYLE_PACKAGE}/__init__.py": "def add(a, b):\n    return a + b\n",
    f"testbed/tests/test_{SWEBENCH_STYLE_PACKAGE}.py": (
        f"from {SWEBENCH_STYLE_PACKAGE} import add\n\n\n"
        "def test_add():\n    assert add(2, 3) == 5\n\n\n"
        "def test_add_strings():\n    assert add('a', 'b') == 'ab'\n"
    ),
}


def mirror_problem() -> str | None:
    """Why the Debian mirror cannot be used, or None when it answers."""
    try:
        requests.head(f"{MIRROR}/dists/bookworm/Release", timeout=5).raise_for_status()
    except requests.exceptions.RequestException as exc:
        return f"the Debian mirror {MIRROR} does not answer ({exc})"
    return None


def _distribution_closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """`names` and what they require (markers evaluated for this interpreter)."""
    found: dict[str, metadata.Distribution] = {}
    pending = list(names)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found:
            continue
        found[name] = metadata.distribution(name)
        for text in found[name].requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return [found[name] for name in sorted(found)]


def _copy_distributions(distributions: list[metadata.Distribution], site: Path) -> None:
    """The distributions' files under site-packages (not scripts, not bytecode)."""
    for distribution in distributions:
        for file in distribution.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(Path(str(distribution.locate_file(file))), target)


def _console_scripts(distributions: list[metadata.Distribution], python: str) -> dict[str, str]:
    """name -> the script pip would install for each console entry point."""
    return {
        entry.name: (
            f"#!{python}\nimport sys\nfrom {entry.module} import {entry.attr}\n"
            f"sys.exit({entry.attr}())\n"
        )
        for distribution in distributions
        for entry in distribution.entry_points
        if entry.group == "console_scripts"
    }


def swebench_style_test_image() -> str:
    """The tag of a SWE-bench-style image built here (not a SWE-bench image): SWE-bench's
    layout in miniature. /testbed holds a git repository whose package (src/minirepo) and
    tests import only inside the conda env `testbed`; /opt/miniconda3/envs/testbed is a
    `python3 -m venv` at the conda env's path with pytest (copied from this interpreter's
    own installation, offline) and the package installed; /opt/miniconda3/bin/activate and
    etc/profile.d/conda.sh are minimal scripts whose `conda activate ENV` only puts the env
    first on PATH; /opt/miniconda3/bin (the "base" env: python without the repository) is
    first on the image's PATH, and /root/.bashrc activates testbed as SWE-bench's
    Dockerfiles write it. Built on the test base with git and python3-venv from the Debian
    mirror (about 30 s, once per host), tagged by a hash of its inputs."""
    distributions = _distribution_closure(_TESTBED_PYTEST_DISTRIBUTIONS)
    digest = hashlib.sha256(_SWEBENCH_STYLE_DOCKERFILE.encode())
    for path, text in sorted(_SWEBENCH_STYLE_FILES.items()):
        digest.update(f"\0{path}\0{text}".encode())
    for distribution in distributions:
        digest.update(f"\0{distribution.metadata['Name']}=={distribution.version}".encode())

    def build(client: docker.DockerClient, tag: str) -> None:
        if (problem := mirror_problem()) is not None:
            pytest.skip(problem)
        with tempfile.TemporaryDirectory(prefix="opd-swebench-style-") as context:
            root = Path(context)
            (root / "Dockerfile").write_text(_SWEBENCH_STYLE_DOCKERFILE)
            for path, text in _SWEBENCH_STYLE_FILES.items():
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                (root / path).write_text(text)
            _copy_distributions(distributions, root / "site-packages")
            (root / "bin").mkdir()
            for name, script in _console_scripts(distributions, _TESTBED_PYTHON).items():
                (root / "bin" / name).write_text(script)
                (root / "bin" / name).chmod(0o755)
            client.images.build(
                path=context, tag=tag, buildargs={"BASE": BASE_IMAGE}, rm=True, forcerm=True
            )

    return _built_on_base(f"{SWEBENCH_STYLE_REPOSITORY}:test-{digest.hexdigest()[:12]}", build)
