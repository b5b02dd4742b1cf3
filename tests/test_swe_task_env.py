"""The repository's environment around every command of a SWE task (SWETaskSpec.env_setup,
rollout.harness.swe_env.in_environment): the prefix on its own in a local shell (exit status,
cd, line numbers, hidden output, a failing setup), the harness with a family that names an
environment, and, under Docker, a SWE-bench-style image whose repository imports and
tests only inside the conda env `testbed`, each case next to its control without the
environment entry."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
from collections.abc import Iterator
from typing import Any

import pytest

from rollout.chat import RecordedTurn
from rollout.harness.swe import SWEBenchInstanceFamily, SWEHarness, SWEHarnessConfig
from rollout.harness.swe_env import ENV_SETUP_FAILED_EXIT, EnvironmentSetupError, in_environment
from rollout.masking import classify_turn
from rollout.rewards.swe import SWEGrade
from rollout.tasks.mini_swe import MiniSWETasks, generate_tasks
from rollout.tasks.swe_spec import (
    SWEBENCH_ENV_SETUP,
    SWETaskSpec,
    from_generic,
    from_swebench,
    to_task,
)
from rollout.toolcalls import ToolCall
from rollout.trajectory import MaskTier, Task
from sandbox import DockerSandboxConfig, LocalSandbox, Sandbox
from sandbox.docker import OWNER_LABEL, docker_client, reap
from tests.docker_images import SWEBENCH_STYLE_PACKAGE, daemon_problem, swebench_style_test_image

NOISY_SETUP = (
    "echo activating the environment; echo 'a warning' >&2\n"
    "export OPD_ENV=inside\n"
    "opd_env_function() { echo from-a-function; }"
)
"""A setup that talks, exports and defines: only its effects may reach the command."""
BROKEN_SETUP = "echo 'EnvironmentNameNotFound: nosuchenv' >&2; (exit 3)"
_RETURNCODE = re.compile(r"<returncode>(-?\d+)</returncode>")


Result = tuple[int, str, str]
"""exit code, stdout, stderr"""


def exec_local(*commands: str) -> list[Result]:
    """`commands` run one after the other in one local sandbox, in its working directory."""

    async def run() -> list[Result]:
        async with LocalSandbox(SWEHarnessConfig().sandbox) as sandbox:
            results = [await sandbox.exec(command, 30) for command in commands]
        return [(result.exit_code, result.stdout, result.stderr) for result in results]

    return asyncio.run(run())


def bash(index: int, command: str) -> RecordedTurn:
    call = ToolCall(name="bash", arguments={"command": command})
    message = {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
    return RecordedTurn(index, message, [call], None)


def submit(index: int) -> RecordedTurn:
    call = ToolCall(name="submit", arguments={})
    message = {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
    return RecordedTurn(index, message, [call], None)


def returncode(observation: str | None) -> int:
    assert observation is not None
    found = _RETURNCODE.search(observation)
    assert found is not None, observation
    return int(found.group(1))


# -- the prefix, in a local shell ----------------------------------------------------------


@pytest.mark.timeout(60)
def test_command_gets_the_setups_effects_but_not_its_output_and_keeps_its_exit_status() -> None:
    command = 'echo "$OPD_ENV"; opd_env_function; exit 7'
    entered, alone = exec_local(in_environment(command, NOISY_SETUP), command)
    assert entered == (7, "inside\nfrom-a-function\n", "")
    # Control: without the prefix neither the variable nor the function exists.
    exit_code, stdout, stderr = alone
    assert exit_code == 7 and stdout == "\n" and "opd_env_function: command not found" in stderr


@pytest.mark.timeout(60)
def test_cd_and_bash_messages_are_the_commands_own() -> None:
    moved, same_dir = exec_local(
        in_environment("mkdir -p sub && cd sub && pwd && cd .. && ls", NOISY_SETUP),
        # The setup runs in the command's working directory.
        in_environment('test "$OPD_SETUP_DIR" = "$PWD" && echo same', "OPD_SETUP_DIR=$PWD"),
    )
    assert moved[0] == 0 and moved[1].endswith("/sub\nsub\n") and moved[2] == ""
    assert same_dir == (0, "same\n", "")
    refused = ["true\nopd_no_such_command", "echo ok\nfi", "echo 'unterminated", "if then"]
    alone = exec_local(*refused)
    entered = exec_local(*(in_environment(command, NOISY_SETUP) for command in refused))
    assert alone[0][2].endswith("bash: line 2: opd_no_such_command: command not found\n")
    for (exit_code, stdout, stderr), (alone_code, alone_stdout, alone_stderr) in zip(
        entered, alone, strict=True
    ):
        assert (exit_code, stdout) == (alone_code, alone_stdout)
        assert classify_turn(None, exit_code, stderr) is MaskTier.SHELL_ERROR
        # A syntax error on the first line ("if then"): bash quotes that line, which holds
        # the setup too; the message before it is the command's.
        assert stderr == alone_stderr or stderr.splitlines()[0] == alone_stderr.splitlines()[0]
    assert entered[:3] == alone[:3]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "text", ["plain", 'it\'s "quoted" \\ $HOME `x`', "tab\tnew\nline", "\x01\x7f", "ünïcode"]
)
def test_setup_text_reaches_bash_unchanged(text: str) -> None:
    setup = f"export OPD_TEXT={shlex.quote(text)}\nexport OPD_SECOND_LINE=1"
    command = 'printf %s "$OPD_TEXT"; echo "|$OPD_SECOND_LINE"'
    assert exec_local(in_environment(command, setup)) == [(0, f"{text}|1\n", "")]


@pytest.mark.timeout(60)
def test_failing_setup_stops_the_command_and_says_why() -> None:
    (exit_code, stdout, stderr), listed = exec_local(
        in_environment("touch ran", BROKEN_SETUP), "ls"
    )
    assert exit_code == ENV_SETUP_FAILED_EXIT and stderr == ""
    assert "entering the repository's environment failed (exit 3)" in stdout
    assert BROKEN_SETUP in stdout  # the setup itself
    assert "EnvironmentNameNotFound: nosuchenv" in stdout  # and what it said
    assert "ran" not in listed[1].split()
    # The agent's command was not refused by the shell: its turn stays valid.
    assert classify_turn(None, exit_code, stdout) is MaskTier.VALID
    assert in_environment("ls", None) == "ls"


# -- the harness, local sandboxes ------------------------------------------------------------


class EnvironmentFamily(SWEBenchInstanceFamily):
    """mini-SWE tasks whose commands run after `setup`; records what grading saw."""

    def __init__(self, setup: str) -> None:
        super().__init__(MiniSWETasks())
        self.setup = setup
        self.grading_saw: list[str] = []

    def env_setup(self, task: Task) -> str | None:
        return self.setup

    async def grade(
        self, task: Task, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        seen = await sandbox.exec('echo "$OPD_ENV"', 30)
        self.grading_saw.append(seen.stdout.strip())
        return await super().grade(task, sandbox, model_patch, timeout_s)


def local_harness(setup: str, **config: Any) -> tuple[SWEHarness, EnvironmentFamily]:
    family = EnvironmentFamily(setup)
    return SWEHarness(SWEHarnessConfig(**config), families={"mini_swe": family}), family


@pytest.mark.timeout(60)
def test_agent_commands_run_in_the_environment_until_the_agent_breaks_it() -> None:
    # The agent can break its environment: the setup's last command fails once
    # .opd-broken exists (a setup's status is its last command's, as a sourced file's).
    harness, _ = local_harness(f"{NOISY_SETUP}\ntest ! -e .opd-broken")
    task = generate_tasks(1, seed=5)[0]

    async def scenario() -> tuple[list[Any], str]:
        episode = await harness.start(task)
        try:
            outcomes = [
                await episode.step(bash(0, 'echo "$OPD_ENV"; opd_env_function')),
                await episode.step(bash(1, "exit 5")),
                await episode.step(bash(2, "touch .opd-broken")),
                await episode.step(bash(3, "echo ran > ran.txt")),
            ]
            # The harness's own commands need no environment: they still run.
            listed = await episode.sandbox.exec("ls -a", 30, cwd=episode.repo_dir)
            return outcomes, listed.stdout
        finally:
            await episode.close()

    outcomes, listed = asyncio.run(scenario())
    shown, exited, broke, refused = outcomes
    assert returncode(shown.observation) == 0
    assert "inside\nfrom-a-function" in str(shown.observation)
    assert "activating" not in str(shown.observation) and "warning" not in str(shown.observation)
    assert returncode(exited.observation) == 5 and returncode(broke.observation) == 0
    # Broken by the agent: each later command says so and does not run; its turn is valid.
    assert returncode(refused.observation) == ENV_SETUP_FAILED_EXIT
    assert "environment failed (exit 1)" in str(refused.observation)
    assert refused.tier is MaskTier.VALID
    assert ".opd-broken" in listed.split() and "ran.txt" not in listed.split()


@pytest.mark.timeout(60)
def test_grading_runs_in_the_environment_of_a_fresh_sandbox() -> None:
    harness, family = local_harness(NOISY_SETUP, grade_empty_submissions=True)
    task = generate_tasks(1, seed=5)[0]

    async def scenario() -> SWEGrade | None:
        episode = await harness.start(task)
        try:
            await episode.step(submit(0))
            await episode.reward()
        finally:
            await episode.close()
        return episode.grade

    grade = asyncio.run(scenario())
    assert family.grading_saw == ["inside"]
    assert grade is not None and grade.tests_status  # the tests ran (and fail: no fix)


@pytest.mark.timeout(60)
def test_harness_refuses_a_sandbox_whose_environment_cannot_be_entered() -> None:
    made: list[Sandbox] = []

    def factory(image: str | None) -> Sandbox:
        made.append(LocalSandbox(SWEHarnessConfig().sandbox))
        return made[-1]

    family = EnvironmentFamily(BROKEN_SETUP)
    harness = SWEHarness(families={"mini_swe": family}, sandbox_factory=factory)
    task = generate_tasks(1, seed=5)[0]
    with pytest.raises(EnvironmentSetupError, match="exit 126") as raised:
        asyncio.run(harness.start(task))
    assert "environment failed (exit 3)" in str(raised.value)
    assert "EnvironmentNameNotFound: nosuchenv" in str(raised.value)
    assert task.task_id in str(raised.value)
    assert asyncio.run(made[0].is_alive()) is False  # closed after the failed start


# -- Docker: a SWE-bench-style image ----------------------------------------------------------

OWNER = f"pytest-swe-env-{os.getpid()}"
MUL_PATCH = (
    f"diff --git a/src/{SWEBENCH_STYLE_PACKAGE}/__init__.py "
    f"b/src/{SWEBENCH_STYLE_PACKAGE}/__init__.py\n"
    f"--- a/src/{SWEBENCH_STYLE_PACKAGE}/__init__.py\n"
    f"+++ b/src/{SWEBENCH_STYLE_PACKAGE}/__init__.py\n"
    "@@ -1,2 +1,6 @@\n"
    " def add(a, b):\n"
    "     return a + b\n"
    "+\n"
    "+\n"
    "+def mul(a, b):\n"
    "+    return a * b\n"
)
MUL_TEST_PATCH = (
    "diff --git a/tests/test_mul.py b/tests/test_mul.py\n"
    "new file mode 100644\n"
    "--- /dev/null\n"
    "+++ b/tests/test_mul.py\n"
    "@@ -0,0 +1,5 @@\n"
    f"+from {SWEBENCH_STYLE_PACKAGE} import mul\n"
    "+\n"
    "+\n"
    "+def test_mul():\n"
    "+    assert mul(2, 3) == 6\n"
)
needs_docker = pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")


@pytest.fixture(scope="module")
def swebench_style_image() -> Iterator[str]:
    yield swebench_style_test_image()
    reap({OWNER_LABEL: OWNER})


@pytest.fixture(scope="module")
def base_commit(swebench_style_image: str) -> str:
    client = docker_client()
    try:
        out = client.containers.run(
            swebench_style_image, ["git", "rev-parse", "HEAD"], remove=True, network_mode="none"
        )
    finally:
        client.close()
    return out.decode().strip()


def docker_harness() -> SWEHarness:
    return SWEHarness(SWEHarnessConfig(docker=DockerSandboxConfig(read_only=False, owner=OWNER)))


def swebench_row(image: str, base_commit: str) -> dict[str, Any]:
    eval_script = "\n".join(
        [
            "#!/bin/bash",
            "set -uxo pipefail",
            SWEBENCH_ENV_SETUP,
            "cd /testbed",
            f"git apply -v - <<'EOF_114329324912'\n{MUL_TEST_PATCH}EOF_114329324912",
            ": '>>>>> Start Test Output'",
            "pytest -rA tests",
            ": '>>>>> End Test Output'",
        ]
    )
    return {
        "instance_id": "opd__minirepo-1",
        "repo": "opd/minirepo",
        "base_commit": base_commit,
        "problem_statement": "minirepo needs mul(a, b).",
        "image": image,
        "eval_script": eval_script + "\n",
        "log_parser": "parse_log_pytest",
        "FAIL_TO_PASS": ["tests/test_mul.py::test_mul"],
        "PASS_TO_PASS": ["tests/test_minirepo.py::test_add"],
        "test_patch": MUL_TEST_PATCH,
        "patch": MUL_PATCH,
    }


def run_episode(
    harness: SWEHarness, spec: SWETaskSpec, commands: list[str]
) -> tuple[list[str], SWEGrade]:
    """The observations of `commands`, then the grade of the submission after them."""

    async def scenario() -> tuple[list[str], SWEGrade]:
        episode = await harness.start(to_task(spec))
        try:
            observations = []
            for index, command in enumerate(commands):
                observations.append(str((await episode.step(bash(index, command))).observation))
            await episode.step(submit(len(commands)))
            await episode.reward()
        finally:
            await episode.close()
        assert episode.grade is not None
        return observations, episode.grade

    return asyncio.run(scenario())


@pytest.mark.parametrize("entered", [True, False], ids=["testbed-env", "control-image-path"])
@needs_docker
@pytest.mark.timeout(300)  # the first test to run may build the image (about 30 s)
def test_agent_runs_the_repository_and_its_tests_in_the_testbed_env(
    swebench_style_image: str, base_commit: str, entered: bool
) -> None:
    spec = from_swebench(swebench_row(swebench_style_image, base_commit))
    assert spec.env_setup == SWEBENCH_ENV_SETUP
    if not entered:
        spec = spec.model_copy(update={"env_setup": None})
    commands = [
        f'python -c "import {SWEBENCH_STYLE_PACKAGE}; print({SWEBENCH_STYLE_PACKAGE}.__file__)"',
        "pytest -q",
        "cd tests && pwd && python -c 'import sys; print(sys.prefix)'",
    ]
    observations, grade = run_episode(
        docker_harness(), spec, [*commands, f"git apply <<'P'\n{MUL_PATCH}P"]
    )
    imported, tested, moved, applied = observations
    assert returncode(applied) == 0
    # swebench grading activates the env in its own eval script: resolved either way.
    assert grade.resolved, grade.reason + grade.log[-3000:]
    if entered:
        assert returncode(imported) == 0
        assert f"/testbed/src/{SWEBENCH_STYLE_PACKAGE}/__init__.py" in imported
        assert returncode(tested) == 0 and "2 passed" in tested
        assert returncode(moved) == 0
        assert "/testbed/tests\n/opt/miniconda3/envs/testbed" in moved
    else:  # the image's PATH: conda's base python, no repository, no pytest
        assert returncode(imported) == 1
        assert f"ModuleNotFoundError: No module named '{SWEBENCH_STYLE_PACKAGE}'" in imported
        assert returncode(tested) == 127 and "pytest: command not found" in tested
        assert "/testbed/tests\n" in moved and "envs/testbed" not in moved


@pytest.mark.parametrize("entered", [True, False], ids=["testbed-env", "control-image-path"])
@needs_docker
@pytest.mark.timeout(300)  # the first test to run may build the image (about 30 s)
def test_script_grading_runs_the_tests_in_the_tasks_environment(
    swebench_style_image: str, base_commit: str, entered: bool
) -> None:
    row = swebench_row(swebench_style_image, base_commit)
    row = {key: value for key, value in row.items() if key not in ("eval_script", "log_parser")}
    row |= {"test_command": "pytest -rA tests"}
    if entered:
        row["env_setup"] = SWEBENCH_ENV_SETUP
    spec = from_generic(row)
    assert spec.grading == "script"
    _, grade = run_episode(docker_harness(), spec, [f"git apply <<'P'\n{MUL_PATCH}P"])
    assert grade.patch_applied
    if entered:
        assert grade.resolved, grade.reason + grade.log[-3000:]
        assert grade.tests_status["tests/test_mul.py::test_mul"] == "PASSED"
    else:
        assert not grade.resolved and "pytest: command not found" in grade.log


@needs_docker
@pytest.mark.timeout(300)  # the first test to run may build the image (about 30 s)
def test_task_whose_environment_is_missing_fails_at_start_not_in_the_agents_turns(
    swebench_style_image: str, base_commit: str
) -> None:
    row = swebench_row(swebench_style_image, base_commit) | {
        "test_command": "pytest -rA tests",
        "env_setup": "source /opt/miniconda3/bin/activate\nconda activate nosuchenv",
    }
    with pytest.raises(EnvironmentSetupError) as raised:
        asyncio.run(docker_harness().start(to_task(from_generic(row))))
    assert "EnvironmentNameNotFound: Could not find conda environment: nosuchenv" in str(
        raised.value
    )
    client = docker_client()
    try:  # the sandbox was closed: no container of this run is left
        left = client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={OWNER}"})
    finally:
        client.close()
    assert left == []
