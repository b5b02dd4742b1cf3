"""The spec family (swebench, swebench_pro, generic_swe tasks) and its graders on a tiny
repository whose `add` subtracts: the hidden test fails at the base commit and passes with
the fix.

- In local sandboxes: "script" grading (test patch, pytest log through swebench's
  parser) and SWE-bench Pro grading (run_script.sh + parser.py), resolved / not resolved /
  not applied / parser failed; the family's preparation (setup commands, base commit,
  refusal of a task that cannot be graded); the harness's sandbox per task image.
- End to end on Docker (skipped when no daemon answers): an image holding the repository
  at /app, built on the SWE base test image; the harness prepares the agent's sandbox from
  the task's image, the agent applies a patch and submits, and the family grades it in a
  fresh container, for generic_swe and swebench_pro tasks.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker.errors
import pytest

import docker
from rollout.chat import RecordedTurn
from rollout.harness.swe import (
    SWEEpisode,
    SWEHarness,
    SWEHarnessConfig,
)
from rollout.rewards.graders import (
    Grader,
    GradingSetupError,
    ScriptGrader,
    SWEBenchGrader,
    SWEBenchProGrader,
    patch_paths,
)
from rollout.rewards.swe import SWEGrade
from rollout.rewards.swe_pro import MissingRunScriptsError
from rollout.tasks.mini_swe import GIT_IDENTITY, file_diff
from rollout.tasks.swe_family import SWESpecTasks, TaskSetupError
from rollout.tasks.swe_spec import (
    SWETaskSpec,
    from_generic,
    from_swebench,
    from_swebench_pro,
    to_task,
)
from rollout.toolcalls import ToolCall
from sandbox import DockerSandbox, DockerSandboxConfig, LocalSandbox, Sandbox, SandboxError
from sandbox.docker import OWNER_LABEL, reap
from tests.docker_images import daemon_problem

DATA = Path(__file__).parent / "data" / "swe"
PRO_SCRIPTS = next((DATA / "pro_run_scripts").iterdir())
"""A pytest -v run_script.sh / parser.py pair in SWE-bench Pro's shape."""
OWNER = f"pytest-swe-spec-{os.getpid()}"

CALC = "def add(a, b):\n    return a {op} b\n\n\ndef sub(a, b):\n    return a - b\n"
BUGGY, FIXED = CALC.format(op="-"), CALC.format(op="+")
TEST_SUB = "from calc import sub\n\n\ndef test_sub():\n    assert sub(5, 3) == 2\n"
TEST_ADD = (
    "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_add_zero():\n    assert add(0, 0) == 0\n"
)
FIX_PATCH = file_diff("calc.py", BUGGY, FIXED)
TEST_PATCH = file_diff("tests/test_add.py", "", TEST_ADD)
README_PATCH = file_diff("README.md", "", "add() is fixed, I think.\n")
F2P = ["tests/test_add.py::test_add"]
P2P = ["tests/test_add.py::test_add_zero", "tests/test_sub.py::test_sub"]
PYTEST = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -p no:cacheprovider tests"


def _write(files: dict[str, str]) -> str:
    return "".join(
        f"mkdir -p \"$(dirname {path})\" && cat > {path} <<'OPD_EOF'\n{text}OPD_EOF\n"
        for path, text in files.items()
    )


# The base commit on main; the fix commit (fix and new test) on the branch fix, which
# SWE-bench Pro's before_repo_set_cmd checks the tests out of.
MAKE_REPO = (
    "set -e\ngit -c init.defaultBranch=main init -q\n"
    + _write({"calc.py": BUGGY, "tests/test_sub.py": TEST_SUB})
    + "git add -A && git commit -q -m base && git checkout -q -b fix\n"
    + _write({"calc.py": FIXED, "tests/test_add.py": TEST_ADD})
    + "git add -A && git commit -q -m fix && git checkout -q main\ngit rev-parse main fix\n"
)


def generic_spec(workdir: str, base: str, image: str = "opd-test-none", **row: Any) -> SWETaskSpec:
    return from_generic(
        {
            "instance_id": "opd__calc-1",
            "problem_statement": "add() subtracts its arguments.",
            "image": image,
            "workdir": workdir,
            "base_commit": base,
            "test_command": PYTEST,
            "test_patch": TEST_PATCH,
            "patch": FIX_PATCH,
            "FAIL_TO_PASS": F2P,
            "PASS_TO_PASS": P2P,
            **row,
        }
    )


def pro_spec(
    workdir: str, base: str, fix: str, run_scripts_dir: Path, image: str = "opd-test-none"
) -> SWETaskSpec:
    instance_id = PRO_SCRIPTS.name
    spec = from_swebench_pro(
        {
            "instance_id": instance_id,
            "repo": "opd/calc",
            "base_commit": base,
            "patch": FIX_PATCH,
            "test_patch": TEST_PATCH,
            "problem_statement": "add() subtracts its arguments.",
            "fail_to_pass": str(F2P),
            "pass_to_pass": str(P2P),
            "before_repo_set_cmd": (
                f"git reset --hard {base}\ngit clean -fd \ngit checkout {base} \n"
                f"git checkout {fix} -- tests/test_add.py"
            ),
            "selected_test_files_to_run": str(["tests/test_add.py", "tests/test_sub.py"]),
            "image_name": image,
        },
        run_scripts_dir=str(run_scripts_dir),
    )
    return spec.model_copy(update={"workdir": workdir})


# -- local sandboxes --------------------------------------------------------------------


async def local_repo() -> tuple[LocalSandbox, str, str, str]:
    """A started local sandbox holding the repository; (sandbox, its path, base, fix)."""
    sandbox = LocalSandbox(SWEHarnessConfig().sandbox)
    await sandbox.start()
    root = (await sandbox.exec("pwd", 30)).stdout.strip()
    made = await sandbox.exec(f"mkdir repo && cd repo && {MAKE_REPO}", 60, env=GIT_IDENTITY)
    assert made.ok, made.stderr
    base, fix = made.stdout.split()
    return sandbox, f"{root}/repo", base, fix


SpecMaker = Callable[[str, str, str, str], SWETaskSpec]
"""(workdir, base, fix, sandbox root) -> the spec of the repository in a local sandbox."""


def grade_locally(
    make_spec: SpecMaker,
    patch: str,
    make_grader: Callable[[str], Grader] = lambda root: ScriptGrader(),
) -> SWEGrade:
    """Grade `patch` in a fresh local sandbox holding the repository."""

    async def scenario() -> SWEGrade:
        sandbox, workdir, base, fix = await local_repo()
        root = workdir.removesuffix("/repo")
        try:
            spec, grader = make_spec(workdir, base, fix, root), make_grader(root)
            grader.check(spec)
            return await grader.grade(spec, sandbox, patch, 120)
        finally:
            await sandbox.close()

    return asyncio.run(scenario())


def local_generic(workdir: str, base: str, fix: str, root: str) -> SWETaskSpec:
    return generic_spec(workdir, base)


@pytest.mark.timeout(60)
def test_script_grading_resolves_the_fix() -> None:
    result = grade_locally(local_generic, FIX_PATCH)
    assert result.resolved, result.reason + result.log[-2000:]
    assert result.fail_to_pass.success == F2P and result.pass_to_pass.success == P2P
    assert ">>>>> Start Test Output" in result.log and "Test Exit Code: 0" in result.log


@pytest.mark.timeout(60)
def test_script_grading_fails_a_patch_that_leaves_the_bug() -> None:
    result = grade_locally(local_generic, README_PATCH)
    assert not result.resolved and result.patch_applied
    assert result.fail_to_pass.failure == F2P and result.pass_to_pass.success == P2P
    assert result.tests_status["tests/test_add.py::test_add"] == "FAILED"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("with_fix", "resolved"), [(False, False), (True, True)])
def test_script_grading_replaces_a_submission_s_own_version_of_the_graded_tests(
    with_fix: bool, resolved: bool
) -> None:
    """The submission writes its own tests/test_add.py: grading puts the test patch's
    version in its place (discarded, not refused, as SWE-bench's eval scripts do)."""
    own_tests = file_diff("tests/test_add.py", "", "def test_add():\n    pass\n")
    patch = (FIX_PATCH if with_fix else "") + own_tests
    result = grade_locally(local_generic, patch)
    assert result.resolved is resolved and result.patch_applied
    assert set(result.tests_status) == {*F2P, *P2P}


def test_script_eval_script_resets_the_test_patch_files_before_applying_it() -> None:
    from rollout.rewards.graders import script_eval_script

    spec = generic_spec("/testbed", "abc123")
    script = script_eval_script(spec)
    reset, apply = script.index("git checkout -q abc123 --"), script.index("git apply -v -")
    start, end = script.index(": '>>>>> Start Test Output'"), script.index("End Test Output")
    assert reset < apply < start < script.index(PYTEST) < end
    assert patch_paths(TEST_PATCH + FIX_PATCH) == ["tests/test_add.py", "calc.py"]


def local_pro(workdir: str, base: str, fix: str, root: str) -> SWETaskSpec:
    spec = pro_spec(workdir, base, fix, PRO_SCRIPTS.parent)
    # The local sandbox cannot create /workspace: the grader's workspace is inside it.
    assert spec.test_command is not None and "/workspace/run_script.sh" in spec.test_command
    return spec.model_copy(
        update={"test_command": spec.test_command.replace("/workspace", f"{root}/ws")}
    )


def local_pro_grader(root: str) -> Grader:
    return SWEBenchProGrader(workspace_dir=f"{root}/ws")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("patch", "resolved", "reason"),
    [
        (FIX_PATCH, True, "resolved"),
        (README_PATCH, False, "1 FAIL_TO_PASS and 0 PASS_TO_PASS tests did not pass"),
        (FIX_PATCH.replace("return a - b", "return a * b"), False, "the patch did not apply"),
    ],
    ids=["fix", "no-fix", "does-not-apply"],
)
def test_pro_grading_runs_the_instance_scripts(patch: str, resolved: bool, reason: str) -> None:
    result = grade_locally(local_pro, patch, local_pro_grader)
    assert result.resolved is resolved, result.reason + result.log[-2000:]
    assert result.reason.startswith(reason)
    if reason != "the patch did not apply":
        # The fix commit's test file came in through before_repo_set_cmd's last line.
        assert result.tests_status["tests/test_add.py::test_add"] == (
            "PASSED" if resolved else "FAILED"
        )
        assert "Running selected tests: tests/test_add.py tests/test_sub.py" in result.log
        assert set(result.tests_status) == {*F2P, *P2P}


@pytest.mark.timeout(60)
def test_pro_grading_reports_a_parser_that_wrote_nothing(tmp_path: Path) -> None:
    scripts = tmp_path / PRO_SCRIPTS.name
    shutil.copytree(PRO_SCRIPTS, scripts)
    (scripts / "parser.py").write_text("import sys\nsys.exit('cannot read this log')\n")

    def make_spec(workdir: str, base: str, fix: str, root: str) -> SWETaskSpec:
        return local_pro(workdir, base, fix, root).model_copy(
            update={"run_scripts_dir": str(tmp_path)}
        )

    result = grade_locally(make_spec, FIX_PATCH, local_pro_grader)
    assert not result.resolved and result.patch_applied
    assert result.reason.startswith("parser.py wrote no output.json")
    assert "exited 1: cannot read this log" in result.reason
    assert "passed" in result.log  # the tests ran; their log is kept


def run_prepare(
    make_spec: Callable[[str, str, str], SWETaskSpec], after: str = "git rev-parse HEAD"
) -> tuple[SandboxError | None, str, str]:
    """Prepare a local repository for `make_spec(workdir, base, fix)`, then run `after` in
    it: (what prepare raised, after's output, the base commit)."""

    async def scenario() -> tuple[SandboxError | None, str, str]:
        sandbox, workdir, base, fix = await local_repo()
        try:
            error = None
            try:
                await SWESpecTasks().prepare(to_task(make_spec(workdir, base, fix)), sandbox)
            except SandboxError as exc:
                error = exc
            result = await sandbox.exec(after, 30, cwd=workdir)
            return error, result.stdout.strip(), base
        finally:
            await sandbox.close()

    return asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_prepare_runs_setup_commands_then_returns_to_the_base_commit() -> None:
    def make_spec(workdir: str, base: str, fix: str) -> SWETaskSpec:
        setup = ["echo prepared > ../setup.log", f"git checkout -q {fix}"]
        return generic_spec(workdir, base, setup_commands=setup)

    error, out, base = run_prepare(make_spec, "git rev-parse HEAD; cat ../setup.log; git status -s")
    assert error is None
    assert out.splitlines() == [base, "prepared"]  # reset from the fix commit, tree clean


@pytest.mark.timeout(60)
def test_prepare_fails_on_a_failing_setup_command_or_a_missing_base_commit() -> None:
    error, _, _ = run_prepare(
        lambda workdir, base, fix: generic_spec(
            workdir, base, setup_commands=["echo no such thing; exit 3"]
        )
    )
    assert isinstance(error, TaskSetupError)
    assert "setup command 'echo no such thing; exit 3' failed (exit 3): no such thing" in str(error)
    error, head, base = run_prepare(lambda workdir, base, fix: generic_spec(workdir, "0" * 40))
    assert isinstance(error, TaskSetupError) and "cannot be reset to it" in str(error)
    assert head == base  # left where it was


@pytest.mark.timeout(60)
def test_task_that_cannot_be_graded_stops_before_its_setup_runs(tmp_path: Path) -> None:
    def make_spec(workdir: str, base: str, fix: str) -> SWETaskSpec:
        spec = pro_spec(workdir, base, fix, tmp_path)  # no scripts there
        return spec.model_copy(update={"setup_commands": ["touch ../setup-ran"]})

    error, listing, _ = run_prepare(make_spec, "ls ..")
    assert isinstance(error, MissingRunScriptsError)
    assert "no run_script.sh or parser.py in" in str(error)
    assert "setup-ran" not in listing.split()


def test_each_grading_kind_checks_what_it_needs() -> None:
    no_script = from_swebench(
        {
            "instance_id": "django__django-11099",
            "repo": "django/django",
            "base_commit": "d26b2424437dabeeca94d7900b37d2df4410da0c",
            "problem_statement": "UsernameValidator allows a trailing newline.",
            "FAIL_TO_PASS": "[]",
            "PASS_TO_PASS": "[]",
        }
    )
    with pytest.raises(GradingSetupError, match="needs the row's eval_script"):
        SWEBenchGrader().check(no_script)
    SWEBenchGrader().check(no_script.model_copy(update={"eval_script": "#!/bin/bash\n"}))
    unknown_repo = no_script.model_copy(update={"eval_script": "x", "repo": "acme/widgets"})
    with pytest.raises(GradingSetupError, match="no log parser for repo 'acme/widgets'"):
        SWEBenchGrader().check(unknown_repo)
    bad_parser = generic_spec("/testbed", "abc", log_parser="parse_log_nothing")
    with pytest.raises(GradingSetupError, match="'parse_log_nothing' is not a key"):
        ScriptGrader().check(bad_parser)
    ScriptGrader().check(generic_spec("/testbed", "abc"))  # pytest's parser by default
    with pytest.raises(GradingSetupError, match="no grader for grading kind 'script'"):
        asyncio.run(
            SWESpecTasks(graders={"swebench": SWEBenchGrader()}).prepare(
                to_task(generic_spec("/testbed", "abc")), LocalSandbox()
            )
        )


@pytest.mark.timeout(60)
def test_harness_makes_each_sandbox_from_the_task_image() -> None:
    images: list[str | None] = []
    made: list[Sandbox] = []

    def factory(image: str | None) -> Sandbox:
        images.append(image)
        made.append(LocalSandbox(SWEHarnessConfig().sandbox))
        return made[-1]

    harness = SWEHarness(sandbox_factory=factory)
    task = to_task(generic_spec("/", "", image="registry.local/calc:1", base_commit=None))
    with pytest.raises(TaskSetupError, match="not writable"):  # "/" holds no repository
        asyncio.run(harness.start(task))
    assert images == ["registry.local/calc:1"]
    assert asyncio.run(made[0].is_alive()) is False  # closed after the failed start
    assert isinstance(harness.families["swebench_pro"], SWESpecTasks)
    default = SWEHarness()
    assert isinstance(default.default_sandbox(None), LocalSandbox)
    docker_sandbox = default.default_sandbox("registry.local/calc:1")
    assert isinstance(docker_sandbox, DockerSandbox)
    assert docker_sandbox.config.image == "registry.local/calc:1"
    assert docker_sandbox.config.read_only is False  # the image's repository is edited


# -- Docker, end to end ------------------------------------------------------------------


@pytest.fixture(scope="module")
def calc_image() -> Iterator[str]:
    """An image (built once, cached by content) holding the repository at /app, run as
    root like SWE-bench and SWE-bench Pro images."""
    if (problem := daemon_problem()) is not None:
        pytest.skip(problem)
    from tests.test_docker_images import swe_base_test_image

    base_image = swe_base_test_image()
    dockerfile = f"FROM {base_image}\nUSER 0:0\nCOPY repo/ /app/\nWORKDIR /app\n"
    digest = hashlib.sha256((dockerfile + MAKE_REPO).encode()).hexdigest()[:12]
    tag = f"opd-swe-calc-test:{digest}"
    client = docker.from_env(timeout=600)
    try:
        try:
            client.images.get(tag)
        except docker.errors.ImageNotFound:
            client.images.build(
                fileobj=_build_context(dockerfile), custom_context=True, tag=tag, rm=True
            )
        yield tag
    finally:
        reap({OWNER_LABEL: OWNER}, client)
        client.close()


def _build_context(dockerfile: str) -> io.BytesIO:
    """A tar of the Dockerfile and the repository (made with the host's git)."""
    work = Path(tempfile.mkdtemp(prefix="opd-swe-calc-"))
    try:
        (work / "repo").mkdir()
        env = {**os.environ, **GIT_IDENTITY}
        subprocess.run(["bash", "-c", MAKE_REPO], cwd=work / "repo", env=env, check=True)
        (work / "Dockerfile").write_text(dockerfile)
        context = io.BytesIO()
        with tarfile.open(fileobj=context, mode="w") as tar:
            tar.add(work / "Dockerfile", arcname="Dockerfile")
            tar.add(work / "repo", arcname="repo")
        context.seek(0)
        return context
    finally:
        shutil.rmtree(work, ignore_errors=True)


def image_commits(image: str) -> tuple[str, str]:
    client = docker.from_env(timeout=120)
    try:
        out = client.containers.run(
            image, ["git", "rev-parse", "main", "fix"], remove=True, network_mode="none"
        )
    finally:
        client.close()
    base, fix = out.decode().split()
    return base, fix


def turn(index: int, call: ToolCall) -> RecordedTurn:
    message = {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]}
    return RecordedTurn(index, message, [call], None)


@pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["generic_swe", "swebench_pro"])
@pytest.mark.parametrize(
    ("patch", "resolved"), [(FIX_PATCH, True), (README_PATCH, False)], ids=["fix", "no-fix"]
)
def test_spec_family_end_to_end_on_docker(
    calc_image: str, kind: str, patch: str, resolved: bool
) -> None:
    base, fix = image_commits(calc_image)
    spec = (
        generic_spec("/app", base, image=calc_image)
        if kind == "generic_swe"
        else pro_spec("/app", base, fix, PRO_SCRIPTS.parent, image=calc_image)
    )
    task = to_task(spec)
    harness = SWEHarness(SWEHarnessConfig(docker=DockerSandboxConfig(read_only=False, owner=OWNER)))
    apply = ToolCall(name="bash", arguments={"command": f"git apply <<'PATCH'\n{patch}PATCH"})

    async def scenario() -> tuple[str, float, SWEEpisode]:
        episode = await harness.start(task)
        try:
            where = await episode.sandbox.exec(
                "id -u; git rev-parse HEAD; ls tests", 30, cwd=episode.repo_dir
            )
            await episode.step(turn(0, apply))
            await episode.step(turn(1, ToolCall(name="submit", arguments={})))
            reward = await episode.reward()
        finally:
            await episode.close()
        return where.stdout, reward, episode

    where, reward, episode = asyncio.run(scenario())
    submission, grade = episode.submission, episode.grade
    # The agent's sandbox: root in the task's image, at the base commit, hidden tests absent.
    assert where.split() == ["0", base, "test_sub.py"]
    assert submission is not None and submission.startswith("diff --git")
    assert grade is not None
    assert grade.resolved is resolved and reward == float(resolved), (
        grade.reason + grade.log[-3000:]
    )
    assert grade.tests_status["tests/test_add.py::test_add"] == ("PASSED" if resolved else "FAILED")
    assert grade.pass_to_pass.success == P2P
    # Graded the kind's own way: swebench's markers, or Pro's run script and parser.
    marker = ">>>>> Start Test Output" if kind == "generic_swe" else "Running selected tests"
    assert marker in grade.log
    assert episode.details() == {
        "answer": submission,
        "tool_calls": 1,
        "reason": grade.reason,
        "resolved": resolved,
        "patch_applied": True,
    }
    client = docker.from_env(timeout=60)
    try:  # the agent's and the grading container are gone
        assert not client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={OWNER}"})
    finally:
        client.close()


@pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}")
@pytest.mark.timeout(120)
def test_task_image_run_read_only_is_a_setup_error(calc_image: str) -> None:
    base, _ = image_commits(calc_image)
    task = to_task(generic_spec("/app", base, image=calc_image))

    async def scenario() -> None:
        config = DockerSandboxConfig(image=calc_image, read_only=True, owner=OWNER)
        async with DockerSandbox(config) as sandbox:
            await SWESpecTasks().prepare(task, sandbox)

    with pytest.raises(TaskSetupError, match=r"/app is missing or not writable.*read_only=False"):
        asyncio.run(scenario())
