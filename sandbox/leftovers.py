"""What a sandbox uid can leave on the host outside its working directory, and its removal.

Under basic isolation a sandbox shares the host's file system and IPC namespace, so its
uid can write wherever others may: the world-writable scratch directories (/tmp, /var/tmp,
/dev/shm, /run/lock and world-writable directories inside them) and System V IPC objects
(shared memory, semaphores, message queues). Under either isolation it shares the kernel's
keyrings: keys added to the uid's user keyrings outlive its processes. All of it would be
there for the next sandbox that leases the same uid, so it is removed whenever a uid is
taken or given back (its processes dead by then). A holder under strict isolation reaches
none of the host's scratch directories or IPC objects: it clears only the keys, and since
every holder that can reach them sweeps when it takes the uid, what a crashed basic holder
left is gone before anything that could see it runs as the uid.

Not covered: a world-writable directory elsewhere on the host (none on a usual Linux
install), deeper than MAX_DEPTH or reached through a directory others cannot search;
POSIX message queues when /dev/mqueue is not mounted (they cannot be listed then).
"""

from __future__ import annotations

import os
import platform
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

SCRATCH_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/run/shm", "/dev/mqueue")
"""The host's world-writable directories on a usual Linux install (/var/lock and /run/shm
are often links to two of them)."""
MAX_DEPTH = 8
"""How deep world-writable directories inside a scratch directory are searched."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_IPC = {"shm": ("shmid", "-m"), "sem": ("semid", "-s"), "msg": ("msqid", "-q")}
_KEYCTL_SYSCALL = {"x86_64": 250, "aarch64": 219, "riscv64": 219, "ppc64le": 271, "s390x": 280}
RemoveAt = Callable[[int, str], None]
"""Removes the entry `name` (a tree or not) of the directory open as the descriptor."""
_CLEAR_KEYRINGS = """
import ctypes, os, sys
uid = int(sys.argv[1])
os.setgroups([])
os.setresgid(uid, uid, uid)
os.setresuid(uid, uid, uid)
libc = ctypes.CDLL(None, use_errno=True)
for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
    if libc.syscall(int(sys.argv[2]), 7, keyring) != 0:  # KEYCTL_CLEAR
        sys.exit(f"keyctl clear {keyring}: {os.strerror(ctypes.get_errno())}")
"""


def remove_uid_leftovers(uid: int, remove_at: RemoveAt, host_scratch: bool = True) -> None:
    """Remove the scratch files, IPC objects and keys of `uid` (whose processes are dead).
    `host_scratch` False: only the keys, for a holder whose processes could not reach the
    host's scratch directories or IPC namespace (strict isolation: a tmpfs /tmp, its own
    /dev and IPC namespace, nothing of the host writable but its working directory).
    Sweeping the scratch directories costs milliseconds of the interpreter per sandbox,
    which a batch of decoding waits on. Raises OSError when something could not be
    removed."""
    if host_scratch:
        remove_scratch_files(uid, remove_at)
        remove_ipc_objects(uid)
    clear_keyrings(uid)


def remove_scratch_files(
    uid: int, remove_at: RemoveAt, scratch_dirs: tuple[str, ...] = SCRATCH_DIRS
) -> None:
    """Remove every entry `uid` owns in the scratch directories and in world-writable
    directories below them, without following a symlink anywhere."""
    seen: set[tuple[int, int]] = set()
    for root in dict.fromkeys(os.path.realpath(path) for path in scratch_dirs):
        try:
            fd = os.open(root, _DIR_FLAGS)
        except OSError:
            continue  # not on this host
        try:
            _sweep(fd, uid, MAX_DEPTH, seen, remove_at)
        finally:
            os.close(fd)


def _sweep(fd: int, uid: int, depth: int, seen: set[tuple[int, int]], remove: RemoveAt) -> None:
    info = os.fstat(fd)
    if (info.st_dev, info.st_ino) in seen:
        return
    seen.add((info.st_dev, info.st_ino))
    found = []
    with os.scandir(fd) as entries:
        for listed in entries:
            try:
                found.append((listed.name, listed.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue  # another process removed it meanwhile (a shared /tmp)
    for name, entry in found:
        if entry.st_uid == uid:
            remove(fd, name)
        elif stat.S_ISDIR(entry.st_mode) and entry.st_mode & stat.S_IWOTH and depth > 0:
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue  # gone, or swapped for a link meanwhile
            try:
                _sweep(child, uid, depth - 1, seen, remove)
            finally:
                os.close(child)


def remove_ipc_objects(uid: int) -> None:
    """Remove the System V IPC objects `uid` owns or created (this IPC namespace's)."""
    args = []
    for kind, (id_column, flag) in _IPC.items():
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        header = lines[0].split()
        columns = [header.index(name) for name in (id_column, "uid", "cuid")]
        for line in lines[1:]:
            fields = line.split()
            ipc_id, owner, creator = (int(fields[i]) for i in columns)
            if uid in (owner, creator):
                args += [flag, str(ipc_id)]
    if args:
        done = subprocess.run(["ipcrm", *args], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise OSError(f"ipcrm could not remove uid {uid}'s IPC objects: {done.stderr}")


def clear_keyrings(uid: int) -> None:
    """Empty `uid`'s user keyrings when it owns keys besides them (/proc/key-users)."""
    try:
        users = Path("/proc/key-users").read_text().splitlines()
    except OSError:
        return  # a kernel without keys
    rows = (line.split(":", 1) for line in users)
    owned = [counts.split() for user, counts in rows if user.strip() == str(uid)]
    # "usage nkeys/nikeys qnkeys/maxkeys ...": its two keyrings alone hold nothing.
    if not owned or int(owned[0][2].split("/")[0]) <= 2:
        return
    syscall = _KEYCTL_SYSCALL.get(platform.machine())
    if syscall is None:
        raise OSError(f"cannot clear the keyrings of uid {uid} on {platform.machine()}")
    # Started as root and dropped inside: the interpreter may sit where uid cannot go.
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", _CLEAR_KEYRINGS, str(uid), str(syscall)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        raise OSError(f"cannot clear the keyrings of uid {uid}: {done.stderr.strip()}")
