"""The sandboxed side of the persistent python worker: a supervisor and the cells' process.

Runs inside the sandbox as `python -I python_worker_child.py OPTIONS_JSON`, alone (it
imports nothing of this package: only this file is mounted). Two roles, two processes:

- The supervisor (the process the host started) speaks with the host and never runs a
  cell. It alone holds the request and reply pipes, and it is not dumpable, so no process
  of its uid reaches its descriptors or memory through /proc or ptrace.
- The holder keeps the cells' namespace and runs one call's cell in its main thread. The
  first one is forked from the supervisor before any cell ran and closes everything of the
  supervisor's. For a call the supervisor hands it the request (a memfd) and fresh stdout
  and stderr pipes over the holder's control socket and continues it; between calls it is
  stopped (SIGSTOP), so nothing of the sandbox runs.

A call ends when the holder that runs it has exited, and its exit code is that process's
exit status: the supervisor is its parent or subreaper and waits for it, so nothing a cell
says or writes ends its call while its process lives, and a call that ended has no process
left to answer later ones. After the cell the holder forks a single-threaded copy of
itself (the next holder: it keeps the namespace, the cell's threads die with the old
process), names it (`next CALL PID`) and exits with the cell's code. The supervisor then
stops the copy, checks it kept one thread, kills every other process below it (it is their
subreaper, so nothing leaves its tree), reads what is left in the pipes and replies. A
holder that named no live child, or whose copy died or kept threads, is replaced by a fresh
fork of the supervisor and the reply says the state was lost. A holder that exits before
it says it took the call (`took CALL`: a cell broke what receives requests) is replaced the
same way before the call runs, and the call runs in the fresh one; its reply says so.

The control socket is in the holder while the cell runs, so the cell can say anything on
it; the supervisor hears only the holder's pid (attested by the kernel), about the call in
progress, and what it hears decides only whether a call runs again in a fresh process
(`took` never came) and which process carries the state on, never when a call ends or
what it returns. Whatever a cell leaves on descriptors 0-2, the holder points them
at /dev/null before it receives anything, so the worker's own descriptors never land there.

Protocol with the host (only the supervisor writes it):
- requests: one JSON object per line on stdin, {"code", "cwd", "env"};
- frames on stdout: one byte kind, four bytes big-endian length, payload. b"o" and b"e"
  carry the running cell's stdout and stderr; b"r" is a JSON reply that ends the call,
  {"exit_code", "state_lost", "reason", "restarted"}, or at startup {"ready",
  "preload_errors"}.

Cells behave like notebook cells: a trailing expression is echoed with sys.displayhook;
an exception prints its traceback (without this file's frames) and gives exit code 1;
SystemExit gives its code; stdin is /dev/null.

Started as root (basic isolation, `drop_to_uid`), the supervisor first makes the
interpreter's import paths that the sandbox uid cannot reach (a venv under a root-only
directory) reachable, and nothing beside them: in a private mount namespace it covers the
outermost directory the uid cannot enter with an empty read-only tmpfs holding only the
way down to those paths, each a read-only bind mount of the real one (`..` from a mount's
root leads to the tmpfs, not to the real parent). Then it drops to the uid for good and
holds no directory descriptor. A host that refuses the namespace (no CAP_SYS_ADMIN) gets
a worker that does not start and says why. Running the interpreter again from a cell
(sys.executable) does not work there.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import ctypes
import errno
import fcntl
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
from pathlib import PurePosixPath
from typing import Any, NamedTuple

FRAME_HEADER = struct.Struct("!cI")
READ_CHUNK_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 64
HOLDER_MESSAGE = re.compile(rb"took (\d{1,18})|next (\d{1,18}) (\d{1,10})")
"""`took CALL` or `next CALL PID`, CALL being the number the request carried."""
_CREDENTIALS = struct.Struct("iII")
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_STOP_DEADLINE_S = 10.0
_EXIT_CHANNEL_LOST = 70
_CLONE_NEWNS = 0x20000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, value: int) -> None:
    if _libc().prctl(option, value, 0, 0, 0) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"prctl({option}, {value}): {os.strerror(error)}")


# -- the holder: runs the cells ------------------------------------------------------------


def _fork_detached(keep_fds: Iterable[int] | None = None) -> int | None:
    """Fork. The child points the standard streams at /dev/null (and, given `keep_fds`,
    closes every other descriptor but those) before the parent goes on. 0 in the child;
    the child's pid in the parent; None when the fork was refused (process cap)."""
    ack_r, ack_w = (_above_std_streams(fd) for fd in os.pipe())
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
        _null_std_streams()
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


def _above_std_streams(fd: int) -> int:
    """`fd`, moved above 2 if a cell left 0-2 free: /dev/null put there cannot hit it."""
    if fd > 2:
        return fd
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return moved


def _null_std_streams() -> None:
    """Point descriptors 0, 1 and 2 at /dev/null, whatever was on them (a cell may have
    closed them or opened its own files there): descriptors made next land above 2."""
    null = os.open(os.devnull, os.O_RDWR)  # lands on 0-2 when one is free: kept there
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    if null > 2:
        os.close(null)


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


def _flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):  # a cell's replacement may be anything
            stream.flush()  # type: ignore[union-attr]


class Cells:
    """The holder's side: one namespace, each cell run in the main thread."""

    def __init__(self, control: socket.socket, echo_last_expression: bool) -> None:
        self.control = control
        self.echo_last_expression = echo_last_expression
        self.namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self.cell_count = 0

    def serve(self) -> None:
        """Take calls, one per process: each ends in hand_over, and the copy it returns
        in takes the next. Returns when the control socket fails (the caller exits)."""
        while True:
            _null_std_streams()  # received descriptors land above 2
            try:
                message, fds, _, _ = socket.recv_fds(self.control, 16, 3)
            except OSError:
                return
            if message != b"cell" or len(fds) != 3:
                return
            # Die with the supervisor (this process may be a fork of the one before it,
            # which the supervisor inherited as an orphan; a fork starts without it).
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            request_fd, out_fd, err_fd = fds
            with open(request_fd, "rb") as request_file:
                request = json.loads(request_file.read())
            _flush_std_streams()  # output an earlier call left buffered goes to /dev/null
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            os.close(out_fd)
            os.close(err_fd)
            _fresh_std_streams()
            self.control.send(b"took %d" % request["call"])
            exit_code = self.run_request(request)
            _flush_std_streams()
            self.hand_over(request["call"], exit_code)

    def hand_over(self, call: int, exit_code: int) -> None:
        """End the call: fork the single-threaded copy that keeps the namespace, name it
        and exit with the cell's code (the call ends when this process is gone). Returns
        in the copy."""
        pid = _fork_detached()
        if pid == 0:
            return
        if pid is not None:
            with contextlib.suppress(OSError):  # the cell closed the socket: its state is lost
                self.control.send(b"next %d %d" % (call, pid))
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


def _has_exited(pid: int) -> bool:
    """Whether the child `pid` has exited, leaving it to be reaped."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


class _Ran(NamedTuple):
    """How one holder ended a call."""

    took: bool
    """It said it took the call before it ended."""
    exit_code: int
    lost: str | None
    """Why the state is lost (None: `self.holder` keeps it)."""


class Supervisor:
    def __init__(self, echo_last_expression: bool) -> None:
        self.echo_last_expression = echo_last_expression
        self.control: socket.socket | None = None
        self.holder = self.fork_holder()
        self.calls = 0

    def fork_holder(self) -> int:
        """A fresh holder, forked from this clean process with a control socket of its
        own (nothing an earlier one left in the old socket reaches it), stopped until the
        next call."""
        if self.control is not None:
            self.control.close()
        self.control, holder_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.control.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        pid = _fork_detached([holder_end.fileno()])
        if pid == 0:
            try:
                _prctl(_PR_SET_DUMPABLE, 1)  # its children listed in /proc for the supervisor
                _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
                Cells(holder_end, self.echo_last_expression).serve()
            finally:
                os._exit(_EXIT_CHANNEL_LOST)
        holder_end.close()
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
        body = json.dumps({**request, "call": self.calls}).encode()
        ran = self.run(body)
        restarted = None
        if not ran.took:
            restarted = (
                f"the process holding the cells' state could not take the call (exit code "
                f"{ran.exit_code}): it ran in a fresh one"
            )
            ran = self.run(body)
            if not ran.took:
                raise RuntimeError(f"a fresh process for the cells could not take a call: {ran}")
        return {
            "exit_code": ran.exit_code,
            "state_lost": ran.lost is not None,
            "reason": ran.lost,
            "restarted": restarted,
        }

    def run(self, body: bytes) -> _Ran:
        """Run the request `body` in the holder until that process has exited; then
        `self.holder` is the process keeping the state (a fresh one when it is lost)."""
        assert self.control is not None
        request_fd = os.memfd_create("opd-cell", os.MFD_CLOEXEC)
        _write_all(request_fd, body)
        os.lseek(request_fd, 0, os.SEEK_SET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        holder = self.holder
        self.holder_messages(0, 0)  # whatever was said between calls is stale
        os.kill(holder, signal.SIGCONT)
        with contextlib.suppress(OSError):  # its end is gone: it exits without taking the call
            socket.send_fds(self.control, [b"cell"], [request_fd, out_w, err_w])
        for fd in (request_fd, out_w, err_w):
            os.close(fd)
        streams = {out_r: b"o", err_r: b"e"}
        took, exit_code, named = self.wait_for_exit(holder, streams)
        lost = self.take_over(named, exit_code) if took else "it never took the call"
        successor = named if lost is None else None
        if not self.kill_descendants(keep=successor) and successor is not None:
            lost = "the process keeping the cells' state died at the end of the previous call"
            successor = None
        if took:
            self.drain(streams)
        for fd in streams:  # what a process that never took the call wrote is not the call's
            os.close(fd)
        self.holder = self.fork_holder() if successor is None else successor
        return _Ran(took, exit_code, lost)

    def wait_for_exit(self, holder: int, streams: dict[int, bytes]) -> tuple[bool, int, int | None]:
        """Relay the call's output until `holder` has exited: (whether it took the call,
        its exit status as a shell gives it, the successor it named last)."""
        assert self.control is not None
        exit_watch = _pidfd(holder)
        took, named, listening = False, None, True
        try:
            while True:
                watched = [0, *(streams if took else ())]
                if listening:
                    watched.append(self.control.fileno())
                if exit_watch is not None:
                    watched.append(exit_watch)
                # Without a pidfd (kernels before 5.3) the holder's exit is polled.
                timeout_s = None if exit_watch is not None else 0.01
                ready = select.select(watched, [], [], timeout_s)[0]
                if 0 in ready:  # the host sends nothing during a call: it is gone
                    raise SystemExit("the host closed the request pipe during a call")
                exited = _has_exited(holder)  # before the messages: all it said is queued
                if listening:
                    said, listening = self.holder_messages(holder, self.calls)
                    for word, pid in said:
                        took = took or word == b"took"
                        named = pid if word == b"next" else named
                for fd in ready:
                    if took and fd in streams:
                        self.relay(fd, streams)
                if exited:
                    return took, _status_code(os.waitpid(holder, 0)[1]), named
        finally:
            if exit_watch is not None:
                os.close(exit_watch)

    def holder_messages(self, holder: int, call: int) -> tuple[list[tuple[bytes, int]], bool]:
        """The messages waiting on the control socket that `holder` sent about `call`, as
        (word, pid), and whether the socket is still open; anything else (another
        process, another call, junk) is dropped."""
        assert self.control is not None
        said: list[tuple[bytes, int]] = []
        while True:
            try:
                message, ancillary, _, _ = self.control.recvmsg(
                    MAX_MESSAGE_BYTES, socket.CMSG_SPACE(_CREDENTIALS.size), socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                return said, True
            if not message and not ancillary:
                return said, False  # every holder end is closed
            sender = None
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    sender = _CREDENTIALS.unpack(data[: _CREDENTIALS.size])[0]
                elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    count = len(data) // 4
                    for fd in struct.unpack(f"{count}i", data[: count * 4]):
                        os.close(fd)
            matched = HOLDER_MESSAGE.fullmatch(message)
            if sender != holder or matched is None or int(matched[1] or matched[2]) != call:
                continue
            said.append((b"took", 0) if matched[1] else (b"next", int(matched[3])))

    def take_over(self, named: int | None, exit_code: int) -> str | None:
        """Stop the successor the ended holder named; None when it keeps the state, else
        why the state is lost."""
        if named is None or named <= 0 or not self.is_live_child(named):
            if exit_code > 128:
                return f"the worker died from signal {exit_code - 128} in the previous call"
            return (
                f"the worker ended with exit code {exit_code} in the previous call, without "
                "handing its state on"
            )
        if not self.stop(named):
            return "the process keeping the cells' state died at the end of the previous call"
        if len(os.listdir(f"/proc/{named}/task")) != 1:
            return "the previous call left threads running in the worker"
        return None

    @staticmethod
    def is_live_child(pid: int) -> bool:
        try:
            return os.waitpid(pid, os.WNOHANG) == (0, 0)
        except ChildProcessError:
            return False

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
                # The scan reads one process's children at a time: a child of ours that
                # died after its parent's list was read handed its own children to us
                # unseen (the cell's fork, mid hand-over, left a copy that took the next
                # call). It is a zombie of ours now: reap it and scan again.
                late = self.reap()
                kept = keep not in late and kept
                if not late:
                    return kept
                continue
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


def _closed_ways(real_paths: dict[str, str], uid: int) -> dict[str, str]:
    """For each of `real_paths` (path: its real path) that `uid` cannot open, the
    outermost directory on its real path that `uid` cannot enter (the real path itself
    when only that is closed). Tried by a child that drops to `uid`."""
    results_r, results_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(results_r)
            _drop_privileges(uid)
            closed = {}
            for path, real in real_paths.items():
                try:
                    if os.path.isdir(path):
                        os.listdir(path)
                    else:
                        open(path, "rb").close()
                    continue
                except OSError:
                    pass
                way = [str(parent) for parent in reversed(PurePosixPath(real).parents)]
                closed[path] = next((d for d in way if not os.access(d, os.X_OK)), real)
            _write_all(results_w, json.dumps(closed).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(results_w)
    with open(results_r, "rb") as results:
        answer = results.read()
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        raise SystemExit(f"could not try the interpreter's import paths as uid {uid}")
    return dict(json.loads(answer))


def _expose_import_paths(uid: int) -> None:
    """As root, before the drop: make the import paths `uid` cannot reach reachable to
    this process and its children, and nothing beside them (see the module docstring).
    SystemExit, naming the paths and the fixes, when the host refuses it."""
    entries = sorted({os.path.abspath(p) for p in sys.path if p and os.path.exists(p)})
    reals = {path: os.path.realpath(path) for path in entries}
    closed = _closed_ways(reals, uid)
    covers: dict[str, list[str]] = {}
    for path, closed_dir in closed.items():
        if closed_dir != reals[path]:  # a path closed itself stays closed, as for the uid
            covers.setdefault(closed_dir, []).append(reals[path])
    if not covers:
        return
    try:
        if "/" in covers:
            raise OSError(errno.EACCES, f"uid {uid} cannot enter /, which nothing can cover")
        if _libc().unshare(_CLONE_NEWNS) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"unshare(CLONE_NEWNS): {os.strerror(error)}")
        _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing of ours reaches the host
        for closed_dir, inside in covers.items():
            _cover(closed_dir, inside)
    except OSError as exc:
        detail = exc.strerror if exc.filename is None else f"{exc.filename}: {exc.strerror}"
        raise SystemExit(
            f"basic isolation cannot let uid {uid} reach the interpreter's import paths "
            f"{', '.join(sorted(closed))} without what lies beside them ({detail}). Put "
            f"the interpreter where uid {uid} can read it, use isolation='strict', or set "
            "`python` to an interpreter the uid can read."
        ) from exc


def _cover(closed_dir: str, reals: list[str]) -> None:
    """Hide `closed_dir` under an empty read-only tmpfs holding only the way down to each
    of `reals`, where a read-only bind mount of the real one sits."""
    outermost = [r for r in reals if not any(r.startswith(o + os.sep) for o in reals)]
    # Descriptors of the real ones, opened before the tmpfs hides them, closed below.
    anchors = {real: os.open(real, os.O_PATH | os.O_CLOEXEC) for real in outermost}
    try:
        flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        _mount("tmpfs", closed_dir, "tmpfs", flags, "mode=0755,size=64k")
        for real, anchor in anchors.items():
            _make_way(closed_dir, real, is_dir=os.path.isdir(f"/proc/self/fd/{anchor}"))
            _mount(f"/proc/self/fd/{anchor}", real, None, _MS_BIND)
            _mount(None, real, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
        _mount(None, closed_dir, None, _MS_REMOUNT | _MS_RDONLY | flags)
    finally:
        for anchor in anchors.values():
            os.close(anchor)


def _make_way(top: str, path: str, is_dir: bool) -> None:
    """Directories (0755) from `top` down to `path`, and `path` itself to mount on."""
    way = top
    for part in os.path.relpath(path, top).split(os.sep)[:-1]:
        way = os.path.join(way, part)
        if not os.path.isdir(way):
            os.mkdir(way)
            os.chmod(way, 0o755)  # whatever the umask
    if is_dir:
        os.mkdir(path)
    else:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str = "") -> None:
    def text(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    arguments = (text(source), text(target), text(fstype), ctypes.c_ulong(flags), text(data))
    if _libc().mount(*arguments) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount on {target}: {os.strerror(error)}")


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid,) * 3 or os.getresgid() != (uid,) * 3 or os.getgroups():
        raise SystemExit(f"could not drop to uid {uid}")


def main() -> None:
    options = json.loads(sys.argv[1])
    if options.get("drop_to_uid") is not None:
        _expose_import_paths(options["drop_to_uid"])
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
    supervisor = Supervisor(options["echo_last_expression"])
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
