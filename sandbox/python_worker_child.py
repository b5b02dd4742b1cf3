"""The sandboxed side of the persistent python worker: a supervisor and the cells' process.

Runs inside the sandbox as `python -I python_worker_child.py OPTIONS_JSON`, alone (it
imports nothing of this package: only this file is mounted). Two roles, two processes:

- The supervisor (the process the host started) speaks with the host and never runs a
  cell. It alone holds the request and reply pipes, and it is not dumpable, so no process
  of its uid reaches its descriptors or memory through /proc or ptrace.
- The holder keeps the cells' namespace and runs each cell in its main thread. The first
  one is forked from the supervisor before any cell ran and closes everything of the
  supervisor's. For each call the supervisor hands it the request (a memfd) and fresh
  stdout and stderr pipes; all the holder can say back goes over a control socket, and
  the supervisor takes only the two messages it expects, about the call in progress,
  only from the holder's pid (attested by the kernel), and checks what they claim
  against the kernel.

A call ends when the holder reports `done CALL CODE` or exits. A holder that has more
than one thread at the end of a cell forks a single-threaded copy of itself, names it
(`next CALL PID`) and exits with the cell's code: the copy keeps the namespace, the
cell's threads die with the old process. Then the supervisor stops the holder (SIGSTOP:
between calls nothing of the sandbox runs), checks it kept one thread, kills every other
process it has below it (it is their subreaper, so nothing leaves its tree), reads what
is left in the pipes and replies. A holder that died, was not named by the one before
it, or kept threads is replaced by a fresh fork of the supervisor, and the reply says the
state was lost.

Protocol with the host (only the supervisor writes it):
- requests: one JSON object per line on stdin, {"code", "cwd", "env"};
- frames on stdout: one byte kind, four bytes big-endian length, payload. b"o" and b"e"
  carry the running cell's stdout and stderr; b"r" is a JSON reply that ends the call,
  {"exit_code", "state_lost", "reason"}, or at startup {"ready", "preload_errors"}.

Cells behave like notebook cells: a trailing expression is echoed with sys.displayhook;
an exception prints its traceback (without this file's frames) and gives exit code 1;
SystemExit gives its code; stdin is /dev/null.

Started as root (basic isolation, `drop_to_uid`), the supervisor first makes the
interpreter's import paths that the sandbox uid cannot reach (a venv under a root-only
directory) importable through descriptors it opens (/proc/self/fd/N), then drops to the
uid for good. Modules imported later come through those descriptors; running the
interpreter again from a cell (sys.executable) does not work there.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import ctypes
import functools
import importlib
import json
import linecache
import os
import re
import select
import signal
import socket
import struct
import sys
import time
import traceback
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

FRAME_HEADER = struct.Struct("!cI")
READ_CHUNK_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 64
HOLDER_MESSAGE = re.compile(rb"(done|next) (\d{1,18}) (\d{1,10})")
"""`done CALL EXIT_CODE` or `next CALL PID`, CALL being the number the request carried."""
_CREDENTIALS = struct.Struct("iII")
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_STOP_DEADLINE_S = 10.0
_EXIT_CHANNEL_LOST = 70


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}, {value}): {os.strerror(errno)}")


# -- the holder: runs the cells ------------------------------------------------------------


def _fork_detached(keep_fds: Iterable[int] | None = None) -> int | None:
    """Fork. The child gives up the standard streams (and, given `keep_fds`, every other
    descriptor but those) before the parent goes on. 0 in the child; the child's pid in
    the parent; None when the fork was refused (process cap)."""
    ack_r, ack_w = os.pipe()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "multi-threaded fork"
            pid = os.fork()
    except OSError:
        os.close(ack_r)
        os.close(ack_w)
        return None
    if pid == 0:
        os.close(ack_r)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        if keep_fds is not None:
            _close_fds_except({*keep_fds, ack_w})
        os.close(ack_w)
        return 0
    os.close(ack_w)
    os.read(ack_r, 1)  # EOF once the child let go of the pipes (or died)
    os.close(ack_r)
    return pid


def _close_fds_except(keep: set[int]) -> None:
    low = 3
    for fd in sorted(keep):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _fresh_std_streams() -> None:
    """New stream objects over fd 0, 1 and 2: whatever a cell did to the old ones (closed,
    replaced, a lock held by a thread that no longer exists) stays with them."""
    streams = {
        "stdin": open(0, encoding="utf-8", closefd=False),  # noqa: SIM115 - the fds outlive them
        "stdout": open(1, "w", encoding="utf-8", closefd=False),  # noqa: SIM115
        "stderr": open(  # noqa: SIM115
            2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False
        ),
    }
    for name, stream in streams.items():
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _silence_std_streams() -> None:
    """Point fd 1 and 2 at /dev/null and flush: output an earlier call left buffered (its
    pipes were closed under it) must not come out in the next call's."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    _flush_std_streams()


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):  # a cell's replacement may be anything
            stream.flush()  # type: ignore[union-attr]


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 2  # unknown: take the path that works with any number


class Cells:
    """The holder's side: one namespace, each cell run in the main thread."""

    def __init__(self, control: socket.socket, echo_last_expression: bool) -> None:
        self.control = control
        self.echo_last_expression = echo_last_expression
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.cell_count = 0

    def serve(self) -> None:
        """Run cells until the supervisor goes away; never returns."""
        while True:
            try:
                message, fds, _, _ = socket.recv_fds(self.control, 16, 3)
            except OSError:
                os._exit(_EXIT_CHANNEL_LOST)
            if message != b"cell" or len(fds) != 3:
                os._exit(_EXIT_CHANNEL_LOST)
            # Die with the supervisor (this process may be a fork of the one before it,
            # which the supervisor inherited as an orphan; a fork starts without it).
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            request_fd, out_fd, err_fd = fds
            with open(request_fd, "rb") as request_file:
                request = json.loads(request_file.read())
            _silence_std_streams()
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.close(out_fd)
            os.close(err_fd)
            _fresh_std_streams()
            exit_code = self.run_request(request)
            _flush_std_streams()
            self.hand_over(request["call"], exit_code)

    def hand_over(self, call: int, exit_code: int) -> None:
        """End the call. Returns in the process that keeps the namespace."""
        try:
            if _thread_count() == 1:
                self.control.send(b"done %d %d" % (call, exit_code))
                return
            pid = _fork_detached()
            if pid == 0:
                return  # the single-threaded copy: the new holder
            if pid is not None:
                self.control.send(b"next %d %d" % (call, pid))
        except OSError:
            pass  # the cell closed the control socket: its state is lost, its code is not
        os._exit(exit_code)

    def run_request(self, request: dict[str, Any]) -> int:
        try:
            if request.get("cwd"):
                os.chdir(request["cwd"])
            os.environ.update(request.get("env") or {})
        except Exception as exc:
            with contextlib.suppress(Exception):
                print(f"cannot apply cwd/env: {exc}", file=sys.stderr)
            return 1
        return self.run_cell(request["code"])

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
            with contextlib.suppress(Exception):  # stderr may be closed or gone
                traceback.print_exception(type(exc), exc, tb)
            return 1
        return 0


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


# -- the supervisor: speaks with the host ----------------------------------------------------


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (every thread's). PermissionError when it hides them (not
    dumpable) or this kernel lists none; FileNotFoundError when it is gone."""
    children = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as listing:
                children += [int(child) for child in listing.read().split()]
        except FileNotFoundError:
            if os.path.exists(f"/proc/{pid}/task/{tid}"):
                raise PermissionError(f"no children listing for {pid}") from None
    return children


def _descendants(root: int) -> set[int]:
    """Every process below `root`, read from /proc (a full scan when a process hides its
    children by turning off its dumpable flag)."""
    found: set[int] = set()
    pending = [root]
    try:
        while pending:
            pid = pending.pop()
            try:
                children = _children(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue  # gone meanwhile
            fresh = [child for child in children if child not in found]
            found.update(fresh)
            pending += fresh
    except PermissionError:
        return _descendants_by_scan(root)
    return found


def _descendants_by_scan(root: int) -> set[int]:
    by_parent: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        by_parent.setdefault(ppid, []).append(int(name))
    found: set[int] = set()
    pending = [root]
    while pending:
        fresh = [child for child in by_parent.get(pending.pop(), []) if child not in found]
        found.update(fresh)
        pending += fresh
    return found


def _is_live(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _status_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


class Supervisor:
    def __init__(self, echo_last_expression: bool, keep_fds: list[int]) -> None:
        self.echo_last_expression = echo_last_expression
        self.keep_fds = keep_fds
        self.control, self.holder_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.holder = self.fork_holder()
        self.calls = 0

    def fork_holder(self) -> int:
        """A fresh holder, forked from this clean process and stopped until the next call."""
        pid = _fork_detached([self.holder_end.fileno(), *self.keep_fds])
        if pid == 0:
            try:
                _prctl(_PR_SET_DUMPABLE, 1)  # its children listed in /proc for the supervisor
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                Cells(self.holder_end, self.echo_last_expression).serve()
            finally:
                os._exit(_EXIT_CHANNEL_LOST)
        if pid is None:
            raise RuntimeError("cannot fork the process that runs the cells")
        if not self.stop(pid):
            raise RuntimeError("the process that runs the cells died at its start")
        return pid

    def serve(self, requests: Iterator[bytes]) -> None:
        for line in requests:
            reply = self.call(json.loads(line))
            self.send(b"r", json.dumps(reply).encode())

    def send(self, kind: bytes, payload: bytes) -> None:
        _write_all(1, FRAME_HEADER.pack(kind, len(payload)) + payload)

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        self.calls += 1
        request_fd = os.memfd_create("opd-cell", os.MFD_CLOEXEC)
        _write_all(request_fd, json.dumps({**request, "call": self.calls}).encode())
        os.lseek(request_fd, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        holder = self.holder
        self.discard_messages()  # whatever was said between calls is stale
        os.kill(holder, signal.SIGCONT)
        socket.send_fds(self.control, [b"cell"], [request_fd, out_w, err_w])
        for fd in (request_fd, out_w, err_w):
            os.close(fd)
        streams = {out_r: b"o", err_r: b"e"}
        exit_code, successor, lost = self.wait_for_end(holder, streams)
        if lost is None and not self.stop(successor):
            lost = "the process keeping the cells' state died at the end of the previous call"
        if lost is None and len(os.listdir(f"/proc/{successor}/task")) != 1:
            lost = "the previous call left threads running in the worker"
        kept = self.kill_descendants(keep=None if lost is not None else successor)
        if lost is None and not kept:
            lost = "the process keeping the cells' state died at the end of the previous call"
        self.drain(streams)
        self.holder = successor if lost is None else self.fork_holder()
        return {"exit_code": exit_code, "state_lost": lost is not None, "reason": lost}

    def wait_for_end(self, holder: int, streams: dict[int, bytes]) -> tuple[int, int, str | None]:
        """Relay output until the holder says `done` or exits: (exit code, the process
        keeping the state, why the state is lost or None)."""
        exit_watch = _pidfd(holder)
        named: int | None = None
        try:
            while True:
                watched = [*streams, self.control.fileno()]
                if exit_watch is not None:
                    watched.append(exit_watch)
                # Without a pidfd (kernels before 5.3) the holder's exit is polled.
                timeout_s = None if exit_watch is not None else 0.01
                ready = select.select([*watched, 0], [], [], timeout_s)[0]
                for fd in ready:
                    if fd == 0:  # the host sends nothing during a call: it is gone
                        raise SystemExit("the host closed the request pipe during a call")
                    if fd in streams:
                        self.relay(fd, streams)
                    elif fd == self.control.fileno():
                        said = self.holder_message(holder, self.calls)
                        if said is not None and said[0] == b"done":
                            return said[1] & 0xFF, holder, None
                        if said is not None:
                            named = said[1]
                if exit_watch is None or exit_watch in ready:
                    pid, status = os.waitpid(holder, os.WNOHANG)
                    if pid == holder:
                        return self.after_exit(_status_code(status), named)
        finally:
            if exit_watch is not None:
                os.close(exit_watch)

    def after_exit(self, code: int, named: int | None) -> tuple[int, int, str | None]:
        if named is not None and named > 0:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(named, os.WNOHANG) == (0, 0):  # a live child of ours
                    return code, named, None
        if code > 128:
            return code, 0, f"the worker died from signal {code - 128} in the previous call"
        return code, 0, f"the worker exited with code {code} in the previous call"

    def holder_message(self, holder: int, call: int) -> tuple[bytes, int] | None:
        """The next message on the control socket when the holder sent it about this call
        and it parses; anything else (another process, another call, junk) is dropped."""
        message, ancillary, _, _ = self.control.recvmsg(
            MAX_MESSAGE_BYTES, socket.CMSG_SPACE(_CREDENTIALS.size)
        )
        sender = None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = _CREDENTIALS.unpack(data[: _CREDENTIALS.size])[0]
            elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                count = len(data) // 4
                for fd in struct.unpack(f"{count}i", data[: count * 4]):
                    os.close(fd)
        matched = HOLDER_MESSAGE.fullmatch(message)
        if sender != holder or matched is None or int(matched[2]) != call:
            return None
        return matched[1], int(matched[3])

    def discard_messages(self) -> None:
        self.control.setblocking(False)
        try:
            with contextlib.suppress(BlockingIOError):
                while True:
                    self.holder_message(0, 0)
        finally:
            self.control.setblocking(True)

    def relay(self, fd: int, streams: dict[int, bytes]) -> None:
        data = os.read(fd, READ_CHUNK_BYTES)
        if data:
            self.send(streams[fd], data)
        else:
            os.close(fd)
            del streams[fd]

    def drain(self, streams: dict[int, bytes]) -> None:
        """Relay what is left in the pipes: nothing can write to them any more."""
        for fd in list(streams):
            os.set_blocking(fd, False)
            with contextlib.suppress(BlockingIOError):
                while fd in streams:
                    self.relay(fd, streams)
            if fd in streams:
                os.close(fd)
                del streams[fd]

    def stop(self, pid: int) -> bool:
        """SIGSTOP a child and wait until it is stopped; False when it died instead."""
        try:
            os.kill(pid, signal.SIGSTOP)
            _, status = os.waitpid(pid, os.WUNTRACED)
        except (ProcessLookupError, ChildProcessError):
            return False
        return os.WIFSTOPPED(status)

    def kill_descendants(self, keep: int | None) -> bool:
        """SIGKILL every process below this one but `keep`, until none is left (killed
        processes fork no more; their orphans come to this subreaper and are reaped).
        Whether `keep` is still there."""
        deadline = time.monotonic() + _STOP_DEADLINE_S
        kept = True
        while True:
            kept = keep not in self.reap() and kept
            left = [pid for pid in _descendants(os.getpid()) if pid != keep and _is_live(pid)]
            if not left:
                return kept
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes the cell left survived SIGKILL: {left}")
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.001)

    @staticmethod
    def reap() -> set[int]:
        """Collect dead children (a stopped one is not reported); their pids."""
        reaped: set[int] = set()
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return reaped
            if pid == 0:
                return reaped
            reaped.add(pid)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


# -- start -----------------------------------------------------------------------------------


def _unreachable(paths: list[str], uid: int) -> set[str]:
    """Which of `paths` `uid` cannot open, tried by a child that drops to it."""
    results_r, results_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(results_r)
            _drop_privileges(uid)
            refused = []
            for path in paths:
                try:
                    if os.path.isdir(path):
                        os.listdir(path)
                    else:
                        open(path, "rb").close()
                except OSError:
                    refused.append(path)
            _write_all(results_w, json.dumps(refused).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(results_w)
    with open(results_r, "rb") as results:
        answer = results.read()
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        return set(paths)
    return set(json.loads(answer))


def _anchor_unreachable_paths(uid: int) -> list[int]:
    """As root: open the import paths `uid` cannot reach and import through the
    descriptors (/proc/self/fd/N names the directory without walking its parents). The
    descriptors; every process of the worker keeps them."""
    entries = [os.path.abspath(p) for p in sys.path if p and os.path.exists(p)]
    anchors: dict[str, str] = {}
    fds = []
    for path in sorted(_unreachable(entries, uid)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        fds.append(fd)
        anchors[path] = f"/proc/self/fd/{fd}"

    def rebase(path: str) -> str:
        absolute = os.path.abspath(path)
        for real in sorted(anchors, key=len, reverse=True):
            if absolute == real or absolute.startswith(real + os.sep):
                return anchors[real] + absolute[len(real) :]
        return path

    sys.path[:] = [rebase(p) if p else p for p in sys.path]
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if isinstance(search, list):  # packages imported already: their submodules
            search[:] = [rebase(p) for p in search]
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    return fds


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3 or os.getgroups():
        raise SystemExit(f"could not drop to uid {uid}")


def main() -> None:
    options = json.loads(sys.argv[1])
    keep_fds: list[int] = []
    if options.get("drop_to_uid") is not None:
        keep_fds = _anchor_unreachable_paths(options["drop_to_uid"])
        _drop_privileges(options["drop_to_uid"])
    # Before any cell exists: no process of the uid may open our pipes through /proc.
    _prctl(_PR_SET_DUMPABLE, 0)
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    preload_errors = {}
    for module in options["preload_modules"]:
        try:
            importlib.import_module(module)
        except Exception as exc:
            preload_errors[module] = f"{type(exc).__name__}: {exc}"
    supervisor = Supervisor(options["echo_last_expression"], keep_fds)
    try:
        ready = {"ready": True, "preload_errors": preload_errors}
        supervisor.send(b"r", json.dumps(ready).encode())
        supervisor.serve(iter(sys.stdin.buffer.readline, b""))
    finally:
        # Nothing outlives the supervisor, the stopped holder least of all: bubblewrap's
        # init would wait for it for ever.
        supervisor.kill_descendants(keep=None)


if __name__ == "__main__":
    main()
