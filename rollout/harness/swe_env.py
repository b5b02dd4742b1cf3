"""A task's environment in its sandbox: shell text (a family's `env_setup`, e.g. SWE-bench
images' conda env `testbed`) entered before each command in the same bash shell, and a
sandbox that does so for every command (the grading's)."""

from __future__ import annotations

from sandbox.base import ExecResult, Sandbox, SandboxError, StartsAndCloses

ENV_SETUP_FAILED_EXIT = 126
"""The exit status of a command that did not run because its environment could not be
entered: the shell's "cannot execute", never one of the codes of a command the shell
refused (2, 127), which would mark the agent's turn as invalid (tier 2)."""

_BASH_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), 0x7F]} | {
    ord("\\"): "\\\\",
    ord("'"): "\\'",
    ord("\n"): "\\n",
    ord("\t"): "\\t",
}


class EnvironmentSetupError(SandboxError):
    """A new sandbox of the task cannot enter the repository's environment (the family's
    `env_setup` failed there): the image does not hold what the task says it does."""


def _bash_word(text: str) -> str:
    """`text` as one bash word on one line: $'...' with control characters escaped."""
    return "$'" + text.translate(_BASH_ESCAPES) + "'"


def in_environment(command: str, env_setup: str | None) -> str:
    """`command` run after `env_setup` in the same bash shell, so what the setup exports,
    defines or activates holds for it, and its `cd` and exit status stay its own. The
    setup goes on the command's first line, so bash's line numbers in its messages stay
    the command's (a syntax error on that line shows the line, setup included). The
    setup runs in the command's working directory; its output is dropped when it
    succeeds. When it fails (its exit status, its last command's as a sourced file's, is
    not 0) the command does not run: the output says so with the setup's exit status, the
    setup, and its output (run again in a subshell), and the exit status is
    ENV_SETUP_FAILED_EXIT. None: `command` itself."""
    if env_setup is None:
        return command
    setup = _bash_word(env_setup)
    failed = (
        "echo \"opd: entering the repository's environment failed (exit $__opd_env_exit), so "
        "the command did not run. The environment's setup, and its output run again:\"; "
        f"printf '%s\\n' {setup}; ( eval {setup} ) 2>&1"
    )
    return (
        f"{{ eval {setup}; }} >/dev/null 2>&1 || "
        f"{{ __opd_env_exit=$?; {failed}; exit {ENV_SETUP_FAILED_EXIT}; }}; {command}"
    )


class EnvironmentSandbox(StartsAndCloses):
    """`sandbox` whose every command runs in a task's environment (`in_environment`);
    files, liveness and lifetime are the wrapped sandbox's."""

    def __init__(self, sandbox: Sandbox, env_setup: str) -> None:
        self.sandbox = sandbox
        self.env_setup = env_setup

    async def start(self) -> None:
        await self.sandbox.start()

    async def exec(
        self,
        cmd: str,
        timeout_s: float,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        return await self.sandbox.exec(in_environment(cmd, self.env_setup), timeout_s, cwd, env)

    async def write_file(self, path: str, data: bytes) -> None:
        await self.sandbox.write_file(path, data)

    async def read_file(self, path: str) -> bytes:
        return await self.sandbox.read_file(path)

    async def is_alive(self) -> bool:
        return await self.sandbox.is_alive()

    async def close(self) -> None:
        await self.sandbox.close()
