"""The command line that confines one process: rlimits, bubblewrap, a dropped uid.

strict (bubblewrap, host runs as root):
    prlimit <limits> -- bwrap <namespaces, mounts> -- setpriv <uid> -- COMMAND
  bwrap runs privileged (no user namespace) so the sandbox keeps a real, unprivileged
  host uid: RLIMIT_NPROC then caps its processes, and the kernel's uid checks keep
  sandboxes apart. New network, pid, ipc, uts and cgroup namespaces; the root is a fresh
  tmpfs holding read-only binds of /usr, /etc and the interpreter prefixes, a private
  /proc and /dev, a size-capped /tmp, and the working directory (the only writable host
  path), seen at /sandbox whatever its host path. setpriv drops to the uid, clears
  supplementary groups, capabilities and the bounding set; bwrap already set
  no_new_privs, so setuid binaries grant nothing.
basic (no bubblewrap):
    [as uid] prlimit <limits> -- setpriv --no-new-privs -- COMMAND
  Same uid, rlimits and no_new_privs; the host file system is visible with ordinary Unix
  permissions and the network is the host's. The python worker alone starts as root
  (`privileged_start`) and drops to the uid itself, to reach an interpreter under a
  root-only directory (python_worker_child.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sandbox.base import STEADY_PYTHON_ENV, LimitName

logger = logging.getLogger(__name__)

STRICT_WORKDIR = "/sandbox"
"""Where a strict sandbox sees its working directory, whatever its host path: the paths
its commands print (pwd, tracebacks) are the same in every sandbox, so an agent's
observations do not depend on which slot ran it."""
SYSTEM_RO_PATHS = ("/usr", "/etc")
"""Read-only in every strict sandbox; /bin, /lib, /lib64, /sbin follow (usr-merged or not)."""
_USR_MERGE_LINKS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

Isolation = Literal["strict", "basic"]


@dataclass(frozen=True)
class Limits:
    """rlimits for every process of one command (each process gets its own copy, except
    the process count, which is per uid and therefore per sandbox)."""

    memory_mb: int
    max_processes: int
    file_size_mb: int
    open_files: int
    cpu_s: int | None = None

    def prlimit_args(self, per_uid: bool) -> list[str]:
        mib = 1024 * 1024
        args = [
            f"--as={self.memory_mb * mib}",
            f"--fsize={self.file_size_mb * mib}",
            f"--nofile={self.open_files}",
            "--core=0",
        ]
        if per_uid:
            # Only meaningful under a uid of the sandbox's own; as the host user it would
            # count every process that user runs.
            args.append(f"--nproc={self.max_processes}")
        if self.cpu_s is not None:
            # Soft limit delivers SIGXCPU (reported as cpu_time); hard limit is a backstop.
            args.append(f"--cpu={self.cpu_s}:{self.cpu_s + 1}")
        return args


@functools.cache
def find_bwrap() -> str | None:
    """Path of bubblewrap; says once, loudly, when it is missing."""
    path = shutil.which("bwrap")
    if path is None:
        logger.warning(
            "bubblewrap (bwrap) is not installed: local sandboxes cannot run with "
            "isolation='strict' and fall back to 'basic' (own uid and rlimits only: the "
            "host file system stays readable where Unix permissions allow, and the host "
            "network is reachable). Install it: apt-get install bubblewrap"
        )
    return path


@functools.cache
def probe_strict(bwrap: str) -> str | None:
    """None when a privileged bwrap with new namespaces works here, else why not
    (containers often forbid the mounts or namespaces it needs)."""
    if os.geteuid() != 0:
        return (
            "strict isolation gives each sandbox its own uid, which needs root; "
            f"this process runs as uid {os.geteuid()}"
        )
    nobody = 65534
    argv = [bwrap, *_namespace_args(), *_CAPS_FOR_SETPRIV, *_system_mount_args()]
    argv += ["--", *_drop_to(nobody), "/bin/true"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{bwrap} failed to run: {exc}"
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip()
        return f"{bwrap} cannot create a sandbox here (exit {done.returncode}): {message}"
    return None


def _namespace_args() -> list[str]:
    return [
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
    ]


_CAPS_FOR_SETPRIV = tuple(
    arg for cap in ("CAP_SETUID", "CAP_SETGID", "CAP_SETPCAP") for arg in ("--cap-add", cap)
)
"""What privileged bwrap must leave setpriv to drop to the uid and empty the bounding set."""


def _drop_to(uid: int) -> list[str]:
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--",
    ]


def _system_mount_args() -> list[str]:
    args: list[str] = []
    for path in SYSTEM_RO_PATHS:
        args += ["--ro-bind", path, path]
    for path in _USR_MERGE_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return [*args, "--proc", "/proc", "--dev", "/dev"]


def _covered(path: str, roots: Sequence[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


class Jail:
    """Builds the argv and spawn options that confine one command of one sandbox."""

    def __init__(
        self,
        isolation: Isolation,
        uid: int | None,
        workdir: Path,
        ro_paths: Sequence[Path] = (),
        tmp_size_mb: int = 64,
        bwrap: str | None = None,
    ) -> None:
        if isolation == "strict" and (bwrap is None or uid is None):
            raise ValueError("strict isolation needs bwrap and a sandbox uid")
        self.isolation = isolation
        self.uid = uid
        self.workdir = workdir
        self.ro_paths = [os.path.abspath(p) for p in ro_paths]
        self.tmp_size_mb = tmp_size_mb
        self.bwrap = bwrap

    @property
    def visible_workdir(self) -> Path:
        """The working directory as its commands see it: STRICT_WORKDIR under bubblewrap,
        else (or where a read-only path lies above or below STRICT_WORKDIR) the host path."""
        clash = _covered(STRICT_WORKDIR, self.ro_paths) or any(
            _covered(p, [STRICT_WORKDIR]) for p in self.ro_paths
        )
        return self.workdir if self.isolation == "basic" or clash else Path(STRICT_WORKDIR)

    def argv(
        self,
        command: Sequence[str],
        limits: Limits,
        ro_files: Sequence[Path] = (),
        status_fd: int | None = None,
    ) -> list[str]:
        """The full command line; `ro_files` become visible read-only at their host path
        (strict; in basic mode every readable host file already is)."""
        prlimit = ["prlimit", *limits.prlimit_args(per_uid=self.uid is not None), "--"]
        if self.isolation == "basic":
            return [*prlimit, "setpriv", "--no-new-privs", "--", *command]
        assert self.bwrap is not None and self.uid is not None
        bwrap = [self.bwrap, *_namespace_args()]
        if status_fd is not None:
            bwrap += ["--json-status-fd", str(status_fd)]
        bwrap += [*_CAPS_FOR_SETPRIV, *_system_mount_args()]
        bwrap += ["--perms", "1777", "--size", str(self.tmp_size_mb * 1024 * 1024)]
        bwrap += ["--tmpfs", "/tmp"]
        bwrap += self._bind_args(ro_files)
        bwrap += ["--chdir", str(self.visible_workdir)]
        return [*prlimit, *bwrap, "--", *_drop_to(self.uid), *command]

    def _bind_args(self, ro_files: Sequence[Path]) -> list[str]:
        """Read-only binds of the configured paths and `ro_files`, then the working
        directory read-write, each with its missing parents created 0755 (bwrap would
        make them 0700 root, closing them to the uid)."""
        mounted = [*SYSTEM_RO_PATHS, *_USR_MERGE_LINKS]
        made = {"/", "/tmp", "/proc", "/dev"}
        requested = [*self.ro_paths, *(os.path.abspath(p) for p in ro_files)]
        binds = [(p, p, "--ro-bind") for p in sorted(dict.fromkeys(requested), key=len)]
        workdir = (str(self.workdir), str(self.visible_workdir), "--bind")
        args: list[str] = []
        for source, path, kind in [*binds, workdir]:
            if kind == "--ro-bind" and _covered(path, mounted):
                continue
            for parent in map(str, reversed(Path(path).parents)):
                if parent not in made and not _covered(parent, mounted):
                    args += ["--perms", "0755", "--dir", parent]
                    made.add(parent)
            args += [kind, source, path]
            mounted.append(path)
        return args

    def spawn_kwargs(self, privileged_start: bool = False) -> dict[str, Any]:
        """Options for asyncio.create_subprocess_exec: its own session (so a deadline
        can kill the process group), and in basic mode the uid to run as (unless the
        command drops to it itself: `privileged_start`)."""
        kwargs: dict[str, Any] = {"start_new_session": True, "cwd": str(self.workdir)}
        if self.isolation == "basic" and self.uid is not None and not privileged_start:
            kwargs.update(user=self.uid, group=self.uid, extra_groups=[])
        return kwargs

    def base_env(self) -> dict[str, str]:
        """The whole environment a command starts from: nothing of the host's."""
        tmp = "/tmp" if self.isolation == "strict" else str(self.workdir)
        return {
            "PATH": SAFE_PATH,
            "HOME": str(self.visible_workdir),
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "USER": "sandbox",
            **STEADY_PYTHON_ENV,
        }


def kill_process_group(pid: int) -> None:
    """SIGKILL the group led by `pid` (every process started with start_new_session).
    Under bwrap this includes bwrap itself; its death takes the pid namespace and every
    process in it, including those that left the group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


_MEMORY_ERRORS = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")
_PROCESS_ERRORS = re.compile(
    r"fork: retry|fork: Resource temporarily unavailable|BlockingIOError: \[Errno 11\]|"
    r"can't start new thread|Resource temporarily unavailable"
)


def limit_from_exit(exit_code: int, stderr: str) -> LimitName | None:
    """Which rlimit ended a command that was not killed by us. The signal ones are
    certain; RLIMIT_AS and RLIMIT_NPROC refusals are only visible in what the program
    printed about them, so those are inferred from stderr of a failed command."""
    if exit_code == 128 + signal.SIGXFSZ:
        return "file_size"
    if exit_code == 128 + signal.SIGXCPU:
        return "cpu_time"
    if exit_code == 0:
        return None
    if _MEMORY_ERRORS.search(stderr):
        return "memory"
    if _PROCESS_ERRORS.search(stderr):
        return "processes"
    return None
