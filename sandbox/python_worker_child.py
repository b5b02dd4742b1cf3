"""The sandboxed side of the persistent python worker: runs cells in one namespace.

Runs inside the sandbox as `python -I python_worker_child.py READY_NONCE OPTIONS_JSON`,
alone (it imports nothing of this package: only this file is mounted). Protocol:

- requests: one JSON object per line on the original stdin, {"nonce", "code", "cwd",
  "env"}; the cell's own stdin is /dev/null, so input() cannot eat the next request;
- the cell's output goes to the real stdout/stderr pipes (fd 1 and 2, so subprocesses
  and C extensions are captured too);
- after each cell, both streams get END_MARKER + nonce + NUL, and stdout continues with
  one JSON line {"exit_code": N}. The host owns the only copy of the nonce, so a cell
  cannot end its own output early by accident. At startup the same is written for
  READY_NONCE with {"ready": true, "preload_errors": {...}}.

Cells behave like notebook cells: a trailing expression is echoed with sys.displayhook;
an exception prints its traceback (without this file's frames) and gives exit code 1;
SystemExit gives its code. The namespace survives until the worker dies.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib
import json
import linecache
import os
import sys
import traceback
from typing import Any

END_MARKER = b"\x00OPD-CELL-END "


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Worker:
    def __init__(self, echo_last_expression: bool) -> None:
        self.echo_last_expression = echo_last_expression
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.cell_count = 0
        # Private copies of the pipes: the markers must get through even if a cell
        # closed or redirected fd 0, 1 or 2.
        self.requests = os.fdopen(os.dup(0), "rb")
        self.out_fd = os.dup(1)
        self.err_fd = os.dup(2)
        self._detach_stdin()

    @staticmethod
    def _detach_stdin() -> None:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 itself, never closed

    def _restore_streams(self) -> None:
        """Flush what a cell printed, then undo what it did to the standard streams."""
        for name, fd in (("stdout", 1), ("stderr", 2)):
            for stream in (getattr(sys, name), getattr(sys, f"__{name}__")):
                # A cell's replacement (or closed) stream may be anything.
                with contextlib.suppress(Exception):
                    stream.flush()
            original = getattr(sys, f"__{name}__")
            if original is None or original.closed:
                original = open(fd, "w", closefd=False)  # noqa: SIM115 - the fd outlives it
                setattr(sys, f"__{name}__", original)
            setattr(sys, name, original)
        os.dup2(self.out_fd, 1)
        os.dup2(self.err_fd, 2)
        if sys.stdin.closed:
            self._detach_stdin()

    def signal_end(self, nonce: str, reply: dict[str, Any]) -> None:
        self._restore_streams()
        marker = END_MARKER + nonce.encode() + b"\x00"
        _write_all(self.err_fd, marker)
        _write_all(self.out_fd, marker + json.dumps(reply).encode() + b"\n")

    def run_cell(self, code: str) -> int:
        self.cell_count += 1
        filename = f"<cell-{self.cell_count}>"
        # Tracebacks show the cell's source lines.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            tree = ast.parse(code, filename, "exec")
            last: ast.Interactive | None = None
            if self.echo_last_expression and tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Interactive(body=[tree.body.pop()])
            exec(compile(tree, filename, "exec"), self.namespace)
            if last is not None:
                exec(compile(last, filename, "single"), self.namespace)
        except SystemExit as exc:
            return _exit_status(exc.code)
        except BaseException as exc:
            # Drop this frame: the cell's traceback starts in the cell.
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            traceback.print_exception(type(exc), exc, tb)
            return 1
        return 0

    def serve(self) -> None:
        for line in self.requests:
            request = json.loads(line)
            try:
                if request.get("cwd"):
                    os.chdir(request["cwd"])
                os.environ.update(request.get("env") or {})
            except OSError as exc:
                print(f"cannot apply cwd/env: {exc}", file=sys.stderr)
                exit_code = 1
            else:
                exit_code = self.run_cell(request["code"])
            self.signal_end(request["nonce"], {"exit_code": exit_code})


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def main() -> None:
    ready_nonce = sys.argv[1]
    options = json.loads(sys.argv[2])
    worker = Worker(echo_last_expression=options["echo_last_expression"])
    preload_errors = {}
    for module in options["preload_modules"]:
        try:
            importlib.import_module(module)
        except Exception as exc:
            preload_errors[module] = f"{type(exc).__name__}: {exc}"
    worker.signal_end(ready_nonce, {"ready": True, "preload_errors": preload_errors})
    worker.serve()


if __name__ == "__main__":
    main()
