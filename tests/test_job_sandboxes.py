"""The job's SWE sandboxes from its `sandbox` section (slime_ext.job.sandboxes): which
backend and hosts a section means, image mapping, limits reaching the sandboxes, E2B from
config against the E2B stand-in (and the real service when E2B_API_KEY is set), fleet
files, and the launch plan's checks. The multi-node Ray path is tests/test_fleet_job.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from rollout.harness.swe import SWEHarness
from sandbox.base import SandboxClosedError, SandboxUnavailableError
from sandbox.e2b import E2BSandbox
from slime_ext.job.assembly import harness_for
from slime_ext.job.config import ConfigError, SandboxConfig, config_from_dict
from slime_ext.job.sandboxes import (
    FleetFileError,
    JobSandboxes,
    backends_of,
    host_config,
    hosts_of,
    image_to_run,
    load_fleet_file,
    run_owner,
)
from tests.e2b_standin import STANDIN_API_KEY, standin_cloud

pytestmark = pytest.mark.timeout(120)


def test_a_section_names_its_hosts_backends_and_images() -> None:
    job = config_from_dict({"rollout": {"harness": "swe"}})
    assert hosts_of(job) == "here" and backends_of(job.sandbox) == ("local", "docker")
    cluster = config_from_dict(
        {"parallel": {"gpus_per_node": 1}, "cluster": {"sandbox_hosts": ["cpu-0"]}}
    )
    assert hosts_of(cluster) == "ray"
    # the same config trained here (`opd train`): nothing started those hosts
    local = config_from_dict({"cluster": {"sandbox_hosts": ["cpu-0"]}})
    assert hosts_of(local) == "here"
    pinned = config_from_dict({"sandbox": {"hosts": "here"}, "cluster": {"sandbox_hosts": ["c"]}})
    assert hosts_of(pinned) == "here"
    section = SandboxConfig(images={"a:1": "mirror/a:1"}, registry="reg.internal:5000/")
    assert image_to_run(section, "a:1") == "mirror/a:1"  # the map wins over the prefix
    assert image_to_run(section, "swebench/b:latest") == "reg.internal:5000/swebench/b:latest"
    assert image_to_run(section, None) is None
    assert image_to_run(SandboxConfig(), "x:1") == "x:1"
    assert image_to_run(SandboxConfig(registry="r/"), None) is None
    with pytest.raises(ConfigError, match="registry"):
        config_from_dict({"sandbox": {"registry": "has space/"}})


def test_limits_reach_the_hosts_sandboxes() -> None:
    section = SandboxConfig(
        memory_mb=4096, cpus=2.5, max_processes=100, scratch_mb=300, network=True, image="i:1"
    )
    docker = host_config(section, "h", "docker").docker
    assert (docker.memory_mb, docker.cpus, docker.max_processes) == (4096, 2.5, 100)
    assert (docker.workdir_size_mb, docker.network_mode, docker.image) == (300, "bridge", "i:1")
    assert not docker.read_only  # SWE images hold the repository in their own file system
    local = host_config(section, "h", "local").local
    assert (local.memory_mb, local.max_processes) == (4096, 100)
    assert host_config(SandboxConfig(), "h", "docker").docker.network_mode == "none"


def test_here_sandboxes_run_commands_and_refuse_before_open(tmp_path: Path) -> None:
    job = config_from_dict({"rollout": {"harness": "swe"}, "sandbox": {"backend": "local"}})
    sandboxes = JobSandboxes.of_job(job, run_owner(tmp_path))
    with pytest.raises(SandboxClosedError, match="not open"):
        sandboxes.sandbox(None)

    async def go() -> tuple[str, dict[str, Any]]:
        async with sandboxes:
            async with sandboxes.sandbox(None) as sandbox:
                result = await sandbox.exec("echo in-$((40 + 2))", 10)
            return result.stdout, sandboxes.metrics()

    stdout, metrics = asyncio.run(go())
    assert stdout == "in-42\n"
    assert set(metrics["hosts"]) == {"here-local"} and metrics["acquired"] == 1
    harness = harness_for(job, sandboxes)
    assert isinstance(harness, SWEHarness) and harness.sandbox_factory == sandboxes.sandbox
    with pytest.raises(ValueError, match="needs the job's sandboxes"):
        harness_for(job)


def test_owner_is_the_run_for_restarts_and_differs_between_runs(tmp_path: Path) -> None:
    assert run_owner(tmp_path / "a") == run_owner(tmp_path / "a" / ".." / "a")
    assert run_owner(tmp_path / "a") != run_owner(tmp_path / "b")


def test_e2b_from_config_maps_images_to_templates_with_the_named_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cloud = standin_cloud(templates=("base", "swe-astropy-1"))
    image = "swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest"
    section = SandboxConfig(
        backend="e2b", images={image: "swe-astropy-1"}, e2b_api_key_env="MY_E2B_KEY"
    )
    monkeypatch.delenv("MY_E2B_KEY", raising=False)
    keyless = JobSandboxes(section, run_owner(tmp_path), e2b_sdk=cloud.AsyncSandbox)
    with pytest.raises(SandboxUnavailableError, match=r"no E2B API key in \$MY_E2B_KEY"):
        asyncio.run(keyless.open())
    monkeypatch.setenv("MY_E2B_KEY", STANDIN_API_KEY)
    sandboxes = JobSandboxes(section, run_owner(tmp_path), e2b_sdk=cloud.AsyncSandbox)

    async def go() -> str:
        async with sandboxes:
            mapped = sandboxes.sandbox(image)
            assert isinstance(mapped, E2BSandbox)
            async with mapped, sandboxes.sandbox(None) as plain:
                result = await plain.exec("echo e2b", 10)
            with pytest.raises(SandboxUnavailableError, match="no E2B template"):
                sandboxes.sandbox("unmapped:1")
            return result.stdout

    try:
        assert asyncio.run(go()) == "e2b\n"
        assert [c["template"] for c in cloud.created] == ["swe-astropy-1", "base"]
        assert sandboxes.metrics() == {} and "e2b" in sandboxes.describe()
    finally:
        cloud.close()


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="E2B_API_KEY is not set")
def test_e2b_from_config_runs_a_command_in_a_real_e2b_sandbox(tmp_path: Path) -> None:
    sandboxes = JobSandboxes(SandboxConfig(backend="e2b"), run_owner(tmp_path, "opd-e2b-test"))

    async def go() -> str:
        async with sandboxes, sandboxes.sandbox(None) as sandbox:
            return (await sandbox.exec("echo real-e2b", 60)).stdout

    assert asyncio.run(go()) == "real-e2b\n"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("hosts: []\n", "needs `hosts:`"),
        ("hosts: [{name: a}]\nextra: 1\n", "unknown keys"),
        ("hosts: {name: a}\n", "must be a list"),
        ("hosts: [{name: 'bad name'}]\n", "name"),
        ("hosts: [{name: a}]\nconfig: {start_attempts: 0}\n", "start_attempts"),
        ("hosts: [\n", "cannot read"),
    ],
)
def test_fleet_file_problems_are_named(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    with pytest.raises(FleetFileError, match=problem):
        load_fleet_file(path)


def test_fleet_file_hosts_replace_the_sections_hosts(tmp_path: Path) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("config: {owner: from-file}\nhosts: [{name: box-1, max_sandboxes: 3}]\n")
    section = SandboxConfig(fleet_file=str(path), hosts="ray")

    async def go() -> dict[str, Any]:
        async with JobSandboxes(section, "ignored") as sandboxes:
            async with sandboxes.sandbox(None) as sandbox:
                await sandbox.exec("true", 10)
            assert sandboxes.fleet is not None and sandboxes.fleet.config.owner == "from-file"
            return sandboxes.metrics()

    assert set(asyncio.run(go())["hosts"]) == {"box-1"}


def test_ray_hosts_without_a_ray_cluster_say_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    if ray.is_initialized():
        pytest.skip("this process is connected to Ray")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # nothing listens there
    sandboxes = JobSandboxes(SandboxConfig(backend="local"), run_owner(tmp_path), hosts="ray")
    with pytest.raises(SandboxUnavailableError, match=r"no Ray cluster answers at 127\.0\.0\.1:1"):
        asyncio.run(sandboxes.open())
