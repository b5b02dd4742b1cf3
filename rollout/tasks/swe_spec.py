"""SWE task specs: one description of a SWE-style task, whichever dataset it came from.

A `SWETaskSpec` says where the task's repository is (an image and the working directory
inside it), how a command enters the repository's environment (`env_setup`), what runs
before the agent's first turn (`setup_commands`), and how the submission is graded:
- "swebench": by the swebench package (rollout.rewards.swe): the row's `eval_script`
  (swebench 5 rows carry one) applies the test patch and runs the tests between swebench's
  markers; FAIL_TO_PASS / PASS_TO_PASS decide.
- "swebench_pro": by SWE-bench Pro's own harness: after the model patch, the last line of
  the row's `before_repo_set_cmd` (`eval_setup_commands`: it checks the tests out of the
  fix commit), then `test_command` (`bash /workspace/run_script.sh <test files>`) and the
  instance's parser.py. The run_script.sh and parser.py of each instance live in
  scaleapi/SWE-bench_Pro-os (run_scripts/<instance_id>/), not in the dataset row: the
  spec's `run_scripts_dir` (or the grader's) points to a copy of that folder.
- "script": `test_command` run in the working directory (after the test patch, if any,
  and `eval_setup_commands`), its log read by a swebench log parser (`log_parser`,
  pytest's by default).

rollout.rewards.graders grades each kind; rollout.tasks.swe_family serves the tasks to the
swe harness.

Adapters from dataset rows:
- `from_swebench(row)`: SWE-bench, Lite, Verified (and SWE-Gym, which shares the format).
  Image `swebench/sweb.eval.x86_64.<instance_id>:latest`, lower-cased, "__" written
  "_1776_" (swebench's naming: `swebench_image`), unless the row names its image; the
  repository is at /testbed, already at the base commit in the image; its environment is
  the conda env `testbed`, which the images activate only in /root/.bashrc: commands
  enter it with `SWEBENCH_ENV_SETUP`.
- `from_swebench_pro(row)`: image `jefzda/sweap-images:<dockerhub_tag>` (the row's
  `dockerhub_tag`; rows without one get the tag SWE-bench Pro's harness derives,
  `<owner>.<name>-<instance_id without "instance_" and "-vnan">` with the repo
  lower-cased, cut to 128 characters), repository at /app; fail_to_pass / pass_to_pass
  are lower-case there. No `env_setup`: the images put their environment in ENV lines
  (rollout.rewards.swe_pro).
- `from_generic(row)`: SWE-Gym / SWE-smith style rows that name their own image (or get
  `DEFAULT_SWE_IMAGE`), workdir (default /testbed), environment entry (`env_setup`,
  default none), setup and test commands.

`to_task(spec)` makes the rollout Task (kind "swebench", "swebench_pro" or "generic_swe";
the spec is its metadata) and `from_task(task)` reads the spec back.
"""

from __future__ import annotations

import ast
import json
import shlex
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.tasks.swe_eval_scripts import ENV_NAME
from rollout.trajectory import Task

GradingKind = Literal["swebench", "swebench_pro", "script"]
TaskKind = Literal["swebench", "swebench_pro", "generic_swe"]
KINDS: tuple[TaskKind, ...] = ("swebench", "swebench_pro", "generic_swe")
DEFAULT_SWE_IMAGE = "opd-sandbox-swe-base:latest"
SWEBENCH_NAMESPACE = "swebench"
SWEBENCH_PRO_IMAGES = "jefzda/sweap-images"
SWEBENCH_PRO_RUN_SCRIPT = "/workspace/run_script.sh"
SWEBENCH_ENV_SETUP = f"source /opt/miniconda3/bin/activate\nconda activate {ENV_NAME}"
"""How swebench's eval scripts enter a SWE-bench image's environment, the conda env
`testbed`: their first two commands, as swebench 2-4 wrote them (make_eval_script_list_py)
and swebench 5 rows' eval_script carry them. swebench 5 has no constant of it to import."""
_DOCKER_TAG_MAX_CHARS = 128
_ELEMENT_WEB_EXCEPTION = (
    "instance_element-hq__element-web-ec0f940ef0e8e3b61078f145f34dc40d1938e6c5-vnan"
)


class SWETaskSpecError(ValueError):
    """A dataset row or task that does not describe a SWE task; names the instance and
    the field."""


class SWETaskSpec(BaseModel):
    """Everything a SWE task needs to be run and graded; stored as the Task's metadata."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    instance_id: str = Field(min_length=1)
    kind: TaskKind
    """The rollout Task's kind (which adapter made it)."""
    grading: GradingKind
    """Who decides resolved: swebench's grading, SWE-bench Pro's harness, or a test script
    whose log a swebench parser reads (see the module docstring)."""
    problem_statement: str = Field(min_length=1)
    image: str = Field(min_length=1)
    """Container image holding the repository (or the base to clone it into)."""
    workdir: str = Field(pattern=r"^/")
    """The repository in the image: every command's working directory."""
    env_setup: str | None = Field(default=None, min_length=1)
    """Shell text that enters the repository's environment (activates its Python, puts its
    tools on PATH): the swe harness runs it in `workdir`, in the same bash shell, before
    each of the agent's commands and the grading's, its output hidden
    (rollout.harness.swe.in_environment); `setup_commands` run before it is entered.
    SWE-bench rows: `SWEBENCH_ENV_SETUP`; SWE-bench Pro rows: None (their images' ENV
    lines hold it); generic rows: the row's `env_setup`. None: the image's environment as
    it is."""
    repo: str = ""
    """owner/name on GitHub."""
    base_commit: str | None = None
    setup_commands: list[str] = Field(default_factory=list)
    """Run in `workdir`, in order, before the agent's first turn (and before grading)."""
    test_command: str | None = None
    """Runs the tests in `workdir` ("script" and "swebench_pro" grading)."""
    eval_setup_commands: list[str] = Field(default_factory=list)
    """Run after the model's patch, before the tests, at grading only."""
    eval_script: str | None = None
    """swebench's eval script ("swebench" grading); rows before swebench 5 lack it."""
    log_parser: str | None = None
    """A key of swebench's PARSER_REGISTRY; None: looked up from `repo`."""
    fail_to_pass: list[str] = Field(default_factory=list)
    """Tests that fail at the base commit and must pass after the fix."""
    pass_to_pass: list[str] = Field(default_factory=list)
    """Tests that pass at the base commit and must keep passing."""
    test_patch: str = ""
    """The tests that grade the task: applied at grading only, never shown to the agent."""
    gold_patch: str = ""
    """The reference fix."""
    hints_text: str = ""
    requirements: str = ""
    """SWE-bench Pro: requirements the fix must meet (shown to the agent)."""
    interface: str = ""
    """SWE-bench Pro: the interface the fix must provide (shown to the agent)."""
    version: str | None = None
    environment_setup_commit: str | None = None
    created_at: str | None = None
    language: str | None = None
    run_scripts_dir: str | None = None
    """SWE-bench Pro: a directory on the grading host holding `<instance_id>/run_script.sh`
    and `<instance_id>/parser.py` (scaleapi/SWE-bench_Pro-os's run_scripts/); None: the
    grader's own setting."""
    extra: dict[str, Any] = Field(default_factory=dict)
    """The row's other fields, kept verbatim."""


def swebench_image(
    instance_id: str, namespace: str = SWEBENCH_NAMESPACE, tag: str = "latest"
) -> str:
    """The image swebench's harness pulls for an instance: lower-cased, with "__" written
    "_1776_" (Docker Hub refuses double underscores)."""
    return f"{namespace}/sweb.eval.x86_64.{instance_id}:{tag}".lower().replace("__", "_1776_")


def swebench_pro_tag(instance_id: str, repo: str) -> str:
    """The tag SWE-bench Pro's harness derives when a row has no dockerhub_tag
    (helper_code/image_uri.py there): a "-vnan" version suffix is dropped, and
    element-hq/element-web images are published as "element" (but for one instance)."""
    owner, _, name = repo.lower().partition("/")
    name = name or owner
    suffix = instance_id.removeprefix("instance_")
    if instance_id != _ELEMENT_WEB_EXCEPTION:  # that one keeps its full name and suffix
        if (owner, name) == ("element-hq", "element-web"):
            name = "element"
        suffix = suffix.removesuffix("-vnan")
    return f"{owner}.{name}-{suffix}"[:_DOCKER_TAG_MAX_CHARS]


def from_swebench(row: Mapping[str, Any], namespace: str = SWEBENCH_NAMESPACE) -> SWETaskSpec:
    """A SWE-bench (Lite, Verified, SWE-Gym) row; `namespace`: the image registry
    namespace, for mirrors of swebench's images."""
    instance_id = _text(row, "instance_id")
    known = {
        "instance_id",
        "repo",
        "base_commit",
        "patch",
        "test_patch",
        "problem_statement",
        "hints_text",
        "created_at",
        "version",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "environment_setup_commit",
        "image",
        "eval_script",
        "log_parser",
    }
    return _spec(
        instance_id=instance_id,
        kind="swebench",
        grading="swebench",
        problem_statement=_text(row, "problem_statement"),
        image=row.get("image") or swebench_image(instance_id, namespace),
        workdir="/testbed",
        env_setup=SWEBENCH_ENV_SETUP,
        repo=_text(row, "repo"),
        base_commit=_text(row, "base_commit"),
        eval_script=row.get("eval_script") or None,
        log_parser=row.get("log_parser") or None,
        fail_to_pass=_tests(row, "FAIL_TO_PASS"),
        pass_to_pass=_tests(row, "PASS_TO_PASS"),
        test_patch=row.get("test_patch") or "",
        gold_patch=row.get("patch") or "",
        hints_text=row.get("hints_text") or "",
        version=_optional_text(row, "version"),
        environment_setup_commit=_optional_text(row, "environment_setup_commit"),
        created_at=_optional_text(row, "created_at"),
        language="python",
        extra=_extra(row, known),
    )


def from_swebench_pro(
    row: Mapping[str, Any],
    image_repository: str = SWEBENCH_PRO_IMAGES,
    run_scripts_dir: str | None = None,
) -> SWETaskSpec:
    """A SWE-bench Pro row (ScaleAI/SWE-bench_Pro); `image_repository`: where its images
    are (a mirror of jefzda/sweap-images); `run_scripts_dir`: where the instances'
    run_script.sh and parser.py are (the row's own `run_scripts_dir` wins)."""
    instance_id = _text(row, "instance_id")
    repo = _text(row, "repo")
    tag = row.get("dockerhub_tag") or swebench_pro_tag(instance_id, repo)
    repo_setup = [
        line.strip()
        for line in str(row.get("before_repo_set_cmd") or "").splitlines()
        if line.strip()
    ]
    test_files = _tests(row, "selected_test_files_to_run")
    test_command = f"bash {SWEBENCH_PRO_RUN_SCRIPT}"
    if test_files:  # the harness passes them as one comma-separated argument
        test_command += f" {shlex.quote(','.join(test_files))}"
    known = {
        "instance_id",
        "repo",
        "base_commit",
        "patch",
        "test_patch",
        "problem_statement",
        "requirements",
        "interface",
        "repo_language",
        "fail_to_pass",
        "pass_to_pass",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "before_repo_set_cmd",
        "selected_test_files_to_run",
        "dockerhub_tag",
        "image_name",
        "run_scripts_dir",
    }
    return _spec(
        instance_id=instance_id,
        kind="swebench_pro",
        grading="swebench_pro",
        problem_statement=_text(row, "problem_statement"),
        image=row.get("image_name") or f"{image_repository}:{tag}",
        workdir="/app",
        repo=repo,
        base_commit=_text(row, "base_commit"),
        # The harness runs the last line at evaluation (it checks the tests out of the
        # fix commit); the lines before it reset the repository to the base commit.
        setup_commands=repo_setup[:-1],
        eval_setup_commands=repo_setup[-1:],
        test_command=test_command,
        fail_to_pass=_tests(row, "fail_to_pass", "FAIL_TO_PASS"),
        pass_to_pass=_tests(row, "pass_to_pass", "PASS_TO_PASS"),
        test_patch=row.get("test_patch") or "",
        gold_patch=row.get("patch") or "",
        requirements=row.get("requirements") or "",
        interface=row.get("interface") or "",
        language=_optional_text(row, "repo_language"),
        run_scripts_dir=row.get("run_scripts_dir") or run_scripts_dir,
        extra=_extra(row, known),
    )


def from_generic(row: Mapping[str, Any], default_image: str = DEFAULT_SWE_IMAGE) -> SWETaskSpec:
    """A SWE-Gym / SWE-smith style row: instance_id, problem_statement, and any of image
    (or image_name), workdir, env_setup, setup_commands, test_command, eval_script,
    grading, log_parser, FAIL_TO_PASS / PASS_TO_PASS (either case), base_commit, repo, patch,
    test_patch. Grading defaults to "swebench" with an eval_script, else "script"."""
    instance_id = _text(row, "instance_id")
    eval_script = row.get("eval_script") or None
    grading = row.get("grading") or ("swebench" if eval_script else "script")
    test_command = row.get("test_command") or None
    if grading == "script" and test_command is None:
        raise SWETaskSpecError(
            f"{instance_id}: script grading needs a 'test_command' (or give an eval_script)"
        )
    known = {
        "instance_id",
        "problem_statement",
        "image",
        "image_name",
        "workdir",
        "env_setup",
        "setup_commands",
        "test_command",
        "eval_script",
        "grading",
        "log_parser",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "fail_to_pass",
        "pass_to_pass",
        "base_commit",
        "repo",
        "patch",
        "test_patch",
        "hints_text",
        "version",
        "environment_setup_commit",
        "created_at",
        "language",
    }
    return _spec(
        instance_id=instance_id,
        kind="generic_swe",
        grading=grading,
        problem_statement=_text(row, "problem_statement"),
        image=row.get("image") or row.get("image_name") or default_image,
        workdir=row.get("workdir") or "/testbed",
        env_setup=row.get("env_setup") or None,
        repo=row.get("repo") or "",
        base_commit=_optional_text(row, "base_commit"),
        setup_commands=_commands(row, "setup_commands"),
        test_command=test_command,
        eval_script=eval_script,
        log_parser=row.get("log_parser") or None,
        fail_to_pass=_tests(row, "FAIL_TO_PASS", "fail_to_pass"),
        pass_to_pass=_tests(row, "PASS_TO_PASS", "pass_to_pass"),
        test_patch=row.get("test_patch") or "",
        gold_patch=row.get("patch") or "",
        hints_text=row.get("hints_text") or "",
        version=_optional_text(row, "version"),
        environment_setup_commit=_optional_text(row, "environment_setup_commit"),
        created_at=_optional_text(row, "created_at"),
        language=_optional_text(row, "language"),
        extra=_extra(row, known),
    )


def to_task(spec: SWETaskSpec) -> Task:
    """The rollout Task: the problem statement (SWE-bench Pro's requirements and
    interface after it, when given) as the prompt, the spec as metadata."""
    sections = [spec.problem_statement.strip()]
    if spec.requirements.strip():
        sections.append(f"Requirements:\n{spec.requirements.strip()}")
    if spec.interface.strip():
        sections.append(f"Interface:\n{spec.interface.strip()}")
    return Task(
        task_id=spec.instance_id,
        kind=spec.kind,
        prompt="\n\n".join(sections),
        metadata=spec.model_dump(mode="json"),
    )


def from_task(task: Task) -> SWETaskSpec:
    """The spec `to_task` stored in `task`."""
    if task.kind not in KINDS:
        raise SWETaskSpecError(
            f"{task.task_id}: task kind {task.kind!r} holds no SWE task spec; known: {KINDS}"
        )
    try:
        spec = SWETaskSpec.model_validate(task.metadata)
    except ValidationError as exc:
        raise SWETaskSpecError(
            f"{task.task_id}: the metadata is not a SWE task spec: {exc}"
        ) from exc
    if spec.kind != task.kind or spec.instance_id != task.task_id:
        raise SWETaskSpecError(
            f"{task.task_id}: the metadata describes {spec.kind} task {spec.instance_id!r}, "
            f"not this {task.kind} task"
        )
    return spec


def _spec(**fields: Any) -> SWETaskSpec:
    try:
        return SWETaskSpec(**fields)
    except ValidationError as exc:
        raise SWETaskSpecError(f"{fields['instance_id']}: {exc}") from exc


def _text(row: Mapping[str, Any], key: str) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not value.strip():
        where = row.get("instance_id") or "a row"
        raise SWETaskSpecError(f"{where}: needs a non-empty string {key!r}, got {value!r}")
    return value


def _optional_text(row: Mapping[str, Any], key: str) -> str | None:
    value = row.get(key)
    return None if value is None or value == "" else str(value)


def _tests(row: Mapping[str, Any], *keys: str) -> list[str]:
    """The first of `keys` present, as a list of test names: datasets store these as
    lists, JSON strings (SWE-bench) or Python literals (SWE-bench Pro)."""
    key = next((k for k in keys if row.get(k) not in (None, "")), None)
    if key is None:
        return []
    value = row[key]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            try:
                value = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                value = None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise SWETaskSpecError(
            f"{row.get('instance_id')}: {key!r} must be a list of test names (or one as "
            f"JSON), got {row[key]!r:.200}"
        )
    return list(value)


def _commands(row: Mapping[str, Any], key: str) -> list[str]:
    value = row.get(key)
    if value in (None, ""):
        return []
    if isinstance(value, str):
        return [line for line in value.splitlines() if line.strip()]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    raise SWETaskSpecError(f"{row.get('instance_id')}: {key!r} must be a string or a list")


def _extra(row: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    return {key: value for key, value in row.items() if key not in known}
