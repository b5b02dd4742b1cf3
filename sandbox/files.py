"""File transfer into and out of a working directory that untrusted code controls.

The host side runs as root, the directory's contents are the sandbox's: any component of
a path may be a symlink to /etc/shadow, a FIFO that blocks a reader forever, or a hard
link. Paths are therefore walked one component at a time with O_NOFOLLOW relative to the
previous directory's descriptor, and only regular, singly linked files are read or
written. A path the sandbox swaps for a symlink mid-walk is refused, not followed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from sandbox.base import SandboxFileError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PATH_MAX = 4096
"""Linux's limit on a path, its terminating NUL included."""


def _components(workdir: Path, path: str) -> list[str]:
    """`path` as components below `workdir`; refuses anything that leaves it, and any path
    the sandbox itself could not name (a NUL byte, unencodable text, over PATH_MAX)."""
    if "\x00" in path:
        raise SandboxFileError(f"path {path!r} contains a NUL byte")
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError as exc:
        raise SandboxFileError(f"path {path!r} cannot be encoded ({exc.reason})") from None
    if len(encoded) >= PATH_MAX:
        raise SandboxFileError(f"path {path[:64]!r}... is longer than {PATH_MAX - 1} bytes")
    normal = os.path.normpath(path)
    if os.path.isabs(normal):
        root = os.path.normpath(str(workdir))
        if normal != root and not normal.startswith(root + os.sep):
            raise SandboxFileError(f"{path!r} is outside the working directory {root}")
        normal = os.path.relpath(normal, root)
    parts = [part for part in normal.split(os.sep) if part not in ("", ".")]
    if not parts or ".." in parts:
        raise SandboxFileError(f"{path!r} does not name a file inside the working directory")
    return parts


def _open_parent(workdir: Path, parts: list[str], create: bool, owner_uid: int | None) -> int:
    """A descriptor of the directory holding the last component, opened without
    following a symlink anywhere on the way."""
    fd = os.open(workdir, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            try:
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
                if owner_uid is not None:
                    os.fchown(next_fd, owner_uid, owner_uid)
            os.close(fd)
            fd = next_fd
    except OSError:
        os.close(fd)
        raise
    return fd


def _refusal(action: str, path: str, exc: OSError) -> SandboxFileError:
    if exc.errno == errno.ELOOP:
        return SandboxFileError(f"cannot {action} {path!r}: a component is a symlink")
    return SandboxFileError(f"cannot {action} {path!r}: {exc.strerror}")


def _check_regular(fd: int, path: str) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise SandboxFileError(f"{path!r} is not a regular file")
    if info.st_nlink > 1:
        raise SandboxFileError(f"{path!r} has {info.st_nlink} hard links; refusing it")
    return info


def write_file(workdir: Path, path: str, data: bytes, owner_uid: int | None) -> None:
    """Create or replace `path` under `workdir`, owned by `owner_uid` (when given)."""
    parts = _components(workdir, path)
    try:
        parent = _open_parent(workdir, parts, create=True, owner_uid=owner_uid)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(parts[-1], flags, 0o644, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError as exc:
        raise _refusal("write", path, exc) from exc
    try:
        _check_regular(fd, path)
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if owner_uid is not None:
            os.fchown(fd, owner_uid, owner_uid)
    except OSError as exc:
        raise _refusal("write", path, exc) from exc
    finally:
        os.close(fd)


def read_file(workdir: Path, path: str, max_bytes: int) -> bytes:
    """The contents of the regular file `path` under `workdir`, at most `max_bytes`."""
    parts = _components(workdir, path)
    try:
        parent = _open_parent(workdir, parts, create=False, owner_uid=None)
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(parts[-1], flags, dir_fd=parent)
        finally:
            os.close(parent)
    except OSError as exc:
        raise _refusal("read", path, exc) from exc
    try:
        size = _check_regular(fd, path).st_size
        if size > max_bytes:
            raise SandboxFileError(f"{path!r} is {size:,} bytes, over the {max_bytes:,} limit")
        chunks = []
        remaining = max_bytes + 1
        while remaining > 0 and (chunk := os.read(fd, min(remaining, 1 << 20))):
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:
        raise _refusal("read", path, exc) from exc
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise SandboxFileError(f"{path!r} grew past the {max_bytes:,} byte limit while read")
    return data
