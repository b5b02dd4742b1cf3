"""A sandbox's identity on the host: its own uid and its private working directory.

Per-sandbox uids are what make the kernel keep sandboxes apart when the host runs as
root: RLIMIT_NPROC counts processes per uid (and never limits root), a process may only
signal processes of its own uid, and a 0700 directory is closed to every other uid. Uids
come from a reserved range; an flock on `<root>/locks/<uid>.lock` marks one in use, across
processes, and is released by the kernel if the holder dies. A new holder first kills
whatever a dead holder left running under the uid and removes its directory. Taking and
giving back a uid both remove what it left elsewhere on the host (`sandbox.leftovers`).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sandbox.base import SandboxCleanupError, SandboxResourceError, SandboxStartError
from sandbox.leftovers import remove_uid_leftovers

logger = logging.getLogger(__name__)


@dataclass
class SandboxLease:
    """What one sandbox holds until it is closed."""

    uid: int | None
    """The sandbox's own uid; None when the host is not root and commands run as the
    host's user (no per-sandbox process cap or uid separation then)."""
    workdir: Path
    lock_fd: int | None = None
    host_scratch: bool = True
    """Whether its processes can write to the host's scratch directories and IPC (basic
    isolation): then taking and giving back the uid sweeps them (`sandbox.leftovers`)."""


def default_root_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"opd-sandbox-{os.geteuid()}"


def prepare_root(root_dir: Path) -> None:
    """Create `root_dir` (0711: others may enter their own subdirectory, not list it) and
    refuse one that someone else planted, since its contents are trusted."""
    root_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
    info = root_dir.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise SandboxStartError(
            f"sandbox root {root_dir} is not a directory owned by uid {os.geteuid()}; "
            "remove it or set root_dir"
        )
    os.chmod(root_dir, 0o711)
    (root_dir / "locks").mkdir(mode=0o700, exist_ok=True)


ZOMBIE_WAIT_S = 10.0
"""How long acquire() waits for the host's init to reap what a uid's last holder left
exited (its orphans become zombies of pid 1, which still count against RLIMIT_NPROC) when
no uid is free otherwise. An init that reaps only every few seconds (this machine's:
about 2 s) would otherwise make a small uid range fail for no reason."""


def acquire(
    root_dir: Path, uid_base: int, uid_count: int, host_scratch: bool = True
) -> SandboxLease:
    """Lease a free uid from [uid_base, uid_base + uid_count) and a fresh working
    directory for it; runs as the host's user (uid None) when the host is not root.
    `host_scratch`: whether the holder's processes can write to the host's scratch
    directories and IPC (basic isolation); False sweeps only the uid's keys. A uid
    whose only processes are exited ones not yet reaped is waited for (at most
    ZOMBIE_WAIT_S) when no other is free."""
    prepare_root(root_dir)
    if os.geteuid() != 0:
        return SandboxLease(uid=None, workdir=Path(tempfile.mkdtemp(prefix="work-", dir=root_dir)))
    deadline = time.monotonic() + ZOMBIE_WAIT_S
    while True:
        lease, unreaped = _try_acquire(root_dir, uid_base, uid_count, host_scratch)
        if lease is not None:
            return lease
        if not unreaped or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    reason = (
        f"; {len(unreaped)} of them (e.g. {unreaped[0]}) only by exited processes that "
        f"the host's init did not reap in {ZOMBIE_WAIT_S:.0f} s (run the job under an "
        "init that reaps orphans, e.g. `docker run --init`)"
        if unreaped
        else ""
    )
    raise SandboxResourceError(
        f"all {uid_count} sandbox uids from {uid_base} are in use{reason}; close "
        "sandboxes or raise uid_count"
    )


def _try_acquire(
    root_dir: Path, uid_base: int, uid_count: int, host_scratch: bool
) -> tuple[SandboxLease | None, list[int]]:
    """One pass over the range from a random start: a lease, or none and the uids that
    were free but for processes that have exited or were just killed."""
    unreaped = []
    start = secrets.randbelow(uid_count)
    for step in range(uid_count):
        uid = uid_base + (start + step) % uid_count
        lock_fd = os.open(root_dir / "locks" / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            continue
        if uid_processes(uid):
            # A dead holder's leftovers (killed now), or zombies the host's init has not
            # reaped yet; zombies still count against RLIMIT_NPROC, so take another uid
            # (or wait for this one when none is free).
            if uid_processes(uid, include_zombies=False):
                _kill_uid_processes_now(uid)
            os.close(lock_fd)
            unreaped.append(uid)
            continue
        workdir = root_dir / f"work-{uid}"
        try:
            remove_tree(workdir)
            remove_uid_leftovers(uid, remove_tree_at, host_scratch)
        except OSError as exc:  # e.g. an immutable file: this uid stays out of use
            logger.warning("sandbox uid %d skipped: cannot remove what it left: %s", uid, exc)
            os.close(lock_fd)
            continue
        try:
            workdir.mkdir(mode=0o700)
            os.chown(workdir, uid, uid)
        except OSError as exc:
            os.close(lock_fd)
            raise SandboxStartError(f"cannot prepare working directory {workdir}: {exc}") from exc
        return SandboxLease(uid, workdir, lock_fd, host_scratch), unreaped
    return None, unreaped


def release(lease: SandboxLease) -> None:
    """Remove the working directory and what the uid left elsewhere on the host, and free
    the uid (its processes must be dead). The uid is freed even when something cannot be
    removed: its next holder retries."""
    try:
        remove_tree(lease.workdir)
        if lease.uid is not None:
            remove_uid_leftovers(lease.uid, remove_tree_at, lease.host_scratch)
    except OSError as exc:
        raise SandboxCleanupError(
            f"cannot remove what the sandbox left ({lease.workdir}, scratch files, IPC "
            f"objects, keys of uid {lease.uid}): {exc}"
        ) from exc
    finally:
        if lease.lock_fd is not None:
            os.close(lease.lock_fd)
            lease.lock_fd = None


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: Path) -> None:
    """Remove `path` and everything below it, whatever shape the sandbox left: no recursion
    (a tree thousands of levels deep), no path longer than one name (every call is
    relative to a directory descriptor), symlinks unlinked and never followed, and
    directories the sandbox made unreadable or unwritable opened up first."""
    try:
        parent_fd = os.open(path.parent, _DIR_FLAGS)
    except FileNotFoundError:
        return
    try:
        remove_tree_at(parent_fd, path.name)
    finally:
        os.close(parent_fd)


def remove_tree_at(parent_fd: int, name: str) -> None:
    """`remove_tree` of the entry `name` of the directory open as `parent_fd`."""
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        _remove_dir_at(parent_fd, name)
    else:
        os.unlink(name, dir_fd=parent_fd)


def _remove_dir_at(parent_fd: int, name: str) -> None:
    """Depth first with one descriptor open at a time: down into the first subdirectory
    left, back up through '..' (checked against the inode it came from) once one is empty."""
    fd = _open_dir_at(parent_fd, name)
    trail: list[tuple[str, tuple[int, int]]] = [(name, _identity(fd))]
    try:
        while True:
            child = _clear_files(fd)
            if child is not None:
                child_fd = _open_dir_at(fd, child)
                os.close(fd)
                fd = child_fd
                trail.append((child, _identity(fd)))
                continue
            done, _ = trail.pop()
            if not trail:
                break
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = up
            if _identity(fd) != trail[-1][1]:
                raise OSError(f"a directory under {name} moved while it was being removed")
            os.rmdir(done, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _clear_files(fd: int) -> str | None:
    """Unlink every non-directory in the directory open as `fd`; the name of a
    subdirectory left in it, if any."""
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                return entry.name
            os.unlink(entry.name, dir_fd=fd)
    return None


def _open_dir_at(parent_fd: int, name: str) -> int:
    """Open directory `name` (never a symlink) for listing and removing its entries,
    giving its owner the permissions that takes when it had taken them away."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        handle = os.open(
            name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent_fd
        )
        try:
            os.chmod(f"/proc/self/fd/{handle}", 0o700)  # the inode opened, never a symlink
        finally:
            os.close(handle)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    mode = os.fstat(fd).st_mode
    if mode & 0o700 != 0o700:
        os.fchmod(fd, stat.S_IMODE(mode) | 0o700)
    return fd


def _identity(fd: int) -> tuple[int, int]:
    info = os.fstat(fd)
    return info.st_dev, info.st_ino


KILL_ALL_ARGV = ("/bin/sh", "-c", "kill -KILL -1")
"""Run as a uid: SIGKILL to every process of that uid (kill(-1) as the uid)."""


def _kill_uid_processes_now(uid: int) -> None:
    subprocess.run(
        KILL_ALL_ARGV,
        user=uid,
        group=uid,
        extra_groups=[],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=False,
    )


_DYING_PAUSES = (0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256)
DYING_GRACE_S = sum(_DYING_PAUSES)
"""How long kill_uid_processes(dying=True) waits for a pid namespace's teardown (a few
milliseconds here) before it spawns a kill after all."""


async def kill_uid_processes(uid: int, wait_s: float = 5.0, dying: bool = False) -> None:
    """SIGKILL every process running as `uid`, wherever it hides (other sessions, other
    pid namespaces), and wait until none runs. kill(-1) from a process of that uid
    reaches exactly those; the kernel walks the task list under a lock, so no fork
    escapes it. Delivery is asynchronous, hence the wait. With no live process of `uid`
    there is nothing to kill and nothing that could start one (only a process of that uid
    forks as it): the kill is not spawned (a fork of this whole process, holding its
    interpreter: the most costly step of closing a sandbox once its worker has ended).
    `dying`: the caller has just killed what takes every process of `uid` down with it
    (under strict isolation, each command's bubblewrap: its pid namespace dies with it),
    so their deaths are awaited for up to DYING_GRACE_S before a kill is spawned."""
    deadline = time.monotonic() + wait_s
    if dying:
        for pause in _DYING_PAUSES:
            if not uid_processes(uid, include_zombies=False):
                return
            await asyncio.sleep(pause)
    while uid_processes(uid, include_zombies=False):
        try:
            proc = await asyncio.create_subprocess_exec(
                *KILL_ALL_ARGV,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                user=uid,
                group=uid,
                extra_groups=[],
                env={"PATH": "/usr/bin:/bin"},
            )
        except OSError as exc:
            raise SandboxResourceError(f"cannot start a process as uid {uid}: {exc}") from exc
        await proc.wait()
        for _ in range(10):
            if not uid_processes(uid, include_zombies=False):
                return
            await asyncio.sleep(0.01)
        if time.monotonic() > deadline:
            logger.warning("processes of sandbox uid %d survived SIGKILL for %.1f s", uid, wait_s)
            return


def uid_processes(uid: int, include_zombies: bool = True) -> list[int]:
    """Pids whose real uid is `uid` (read from status: a process can make its /proc
    directory root-owned by turning off its dumpable flag). Each status is searched for
    its two fields, not parsed whole: every sandbox start and close scans all of /proc."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/status", "rb") as file:
                status = file.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        at = status.find(b"\nUid:")
        if at < 0 or int(status[at + 5 :].split(None, 1)[0]) != uid:
            continue
        at = status.find(b"\nState:")
        if include_zombies or not status[at + 7 :].lstrip().startswith(b"Z"):
            pids.append(int(entry.name))
    return pids
