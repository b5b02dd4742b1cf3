"""The task family of SWETaskSpec tasks (kinds swebench, swebench_pro, generic_swe), as
the swe harness (rollout.harness.swe.SWETaskFamily) sees it.

- Sandbox: one per task image (`image`), repository at `spec.workdir`.
- Preparation (the agent's sandbox and the grading one alike): the grader's `check`
  first (a task that cannot be graded stops before any agent turn), a writable
  repository directory (an image run with a read-only root fails here), then
  `spec.setup_commands` in the repository, in order; then, when the spec has a base
  commit, HEAD must be it: a repository elsewhere is reset to it (the image holds the
  commit), and one that cannot be is a setup error. Every failure here is a
  sandbox.SandboxError: the task's environment failed, not the agent.
- Grading: by the spec's grading kind, through rollout.rewards.graders (swebench package,
  SWE-bench Pro's harness, or a test script with a swebench log parser). Test files are
  not protected paths: grading overwrites them (see rollout.rewards.graders).
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Mapping
from typing import Any

from rollout.rewards.graders import Grader, default_graders, grader_for, swebench_instance
from rollout.rewards.swe import SWEGrade
from rollout.tasks.swe_spec import KINDS, SWETaskSpec, from_task
from rollout.trajectory import Task
from sandbox.base import Sandbox, SandboxError

SPEC_KINDS = KINDS
"""The task kinds this family serves."""


class TaskSetupError(SandboxError):
    """A setup command failed, or the repository is not at (and cannot be reset to) the
    task's base commit."""


class SWESpecTasks:
    """Spec-described SWE tasks; `graders`: by grading kind (default: one of each,
    rollout.rewards.graders.default_graders)."""

    def __init__(
        self, graders: Mapping[str, Grader] | None = None, setup_timeout_s: float = 600.0
    ) -> None:
        self.graders: dict[str, Grader] = dict(graders or default_graders())
        self.setup_timeout_s = setup_timeout_s

    def spec(self, task: Task) -> SWETaskSpec:
        return from_task(task)

    def repo_dir(self, task: Task) -> str:
        return self.spec(task).workdir

    def env_setup(self, task: Task) -> str | None:
        """Shell text that enters the repository's environment (the spec's)."""
        return self.spec(task).env_setup

    def image(self, task: Task) -> str:
        return self.spec(task).image

    def instance(self, task: Task) -> dict[str, Any]:
        """The task as a SWE-bench instance (for predictions and reports)."""
        return swebench_instance(self.spec(task))

    def reference_patch(self, task: Task) -> str:
        """The row's fix (its `patch`; '' when it has none)."""
        return self.spec(task).gold_patch

    def check(self, task: Task) -> None:
        """Raise GradingSetupError (a SandboxError) when the task cannot be graded as
        given (no eval script, run scripts or log parser); cheap, no sandbox."""
        spec = self.spec(task)
        grader_for(spec, self.graders).check(spec)

    async def prepare(self, task: Task, sandbox: Sandbox) -> None:
        spec = self.spec(task)
        await asyncio.to_thread(self.check, task)
        workdir = shlex.quote(spec.workdir)
        writable = await sandbox.exec(f"test -d {workdir} -a -w {workdir}", 60)
        if not writable.ok:
            raise TaskSetupError(
                f"{spec.instance_id}: the repository directory {spec.workdir} is missing or "
                "not writable in this sandbox (a task image must run with a writable root "
                "file system: DockerSandboxConfig(read_only=False))"
            )
        for command in spec.setup_commands:
            ran = await sandbox.exec(
                f"exec 2>&1; {command}", self.setup_timeout_s, cwd=spec.workdir
            )
            if not ran.ok:
                raise TaskSetupError(
                    f"{spec.instance_id}: setup command {command!r} failed (exit "
                    f"{ran.exit_code}{', timed out' if ran.timed_out else ''}): "
                    f"{ran.stdout.strip()[-2000:]}"
                )
        if spec.base_commit:
            await self._at_base_commit(spec, sandbox)

    async def _at_base_commit(self, spec: SWETaskSpec, sandbox: Sandbox) -> None:
        base = shlex.quote(f"{spec.base_commit}^{{commit}}")
        at_base = f'test "$(git rev-parse HEAD)" = "$(git rev-parse --verify -q {base})"'
        if (await sandbox.exec(at_base, 60, cwd=spec.workdir)).ok:
            return
        reset = await sandbox.exec(
            f"exec 2>&1; git reset -q --hard {base} && {at_base}",
            self.setup_timeout_s,
            cwd=spec.workdir,
        )
        if not reset.ok:
            head = await sandbox.exec("exec 2>&1; git rev-parse HEAD", 60, cwd=spec.workdir)
            raise TaskSetupError(
                f"{spec.instance_id}: the repository at {spec.workdir} is at "
                f"{head.stdout.strip()!r}, not the base commit {spec.base_commit}, and cannot "
                f"be reset to it: {reset.stdout.strip()[-2000:]}"
            )

    async def grade(
        self, task: Task, sandbox: Sandbox, model_patch: str, timeout_s: float
    ) -> SWEGrade:
        spec = self.spec(task)
        return await grader_for(spec, self.graders).grade(spec, sandbox, model_patch, timeout_s)
