"""What the job's nodes must share, checked on each training node before anything starts.

`opd launch` writes job.yaml and the hook config into run_dir where it runs (the Slurm
batch script: on the allocation's first node), and every training node's processes then
read them at the same paths, with the tasks file and the student's HF checkpoint, and
write checkpoints into save_dir. Nothing is copied: a cluster job needs one filesystem
that every node mounts at the same path, and a node that does not see it would fail late
(a train actor that cannot read job.yaml, a checkpoint save that lands on a node's own
disk). So each training node runs

    python3 -m launch.shared_paths --same PATH=SHA256 ... --read PATH ... --write DIR ...

as a plan step, and the launch stops at the first node that cannot see a path, or sees
another file there (a node-local copy of job.yaml would train another config), or cannot
write save_dir, with the path, what it is for and the fix.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import socket
import sys
import uuid
from pathlib import Path

from slime_ext.job.config import JobConfig

FIX = (
    "every node of the job must see these paths: put them on a filesystem that all nodes "
    "mount at the same path (or mount it there on this node)"
)


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_command(job: JobConfig, node: str, written: dict[str, str]) -> str:
    """The check each training node runs: `written` (path -> the text the launch writes
    there) read back identical (readable, where the text has shell variables the Slurm
    batch script expands as it writes: the teacher's address), the job's inputs readable,
    save_dir writable."""
    cluster = job.cluster
    args = ["python3", "-m", "launch.shared_paths", "--node", node]
    for path, text in written.items():
        args += ["--read", path] if "$" in text else ["--same", f"{path}={digest(text)}"]
    for read in (job.model.student, cluster.tasks_file):
        if read:
            args += ["--read", str(read)]
    if cluster.save_dir:
        args += ["--write", str(cluster.save_dir)]
    command = shlex.join(args)
    # a Slurm node is a variable of the batch script ($ADDR_0), which the node's shell expands
    return command.replace(shlex.quote(node), f'"{node}"') if node.startswith("$") else command


def problems(same: list[str], read: list[str], write: list[str]) -> list[str]:
    """What this node cannot see or do, one line each."""
    found = []
    for entry in same:
        path, _, expected = entry.rpartition("=")
        file = Path(path)
        if not file.is_file():
            found.append(f"{path}: not there (opd launch wrote it where it runs)")
        elif digest(file.read_text(errors="replace")) != expected:
            found.append(
                f"{path}: another file than the one opd launch wrote (a node-local copy, or "
                "an older run's): this node would run another config"
            )
    for path in read:
        if not os.path.exists(path):
            found.append(f"{path}: not there")
        elif not os.access(path, os.R_OK):
            found.append(f"{path}: not readable by {_user()}")
    for directory in write:
        probe = Path(directory) / f".opd-write-check-{uuid.uuid4().hex[:8]}"
        try:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            found.append(f"{directory}: not writable ({err.strerror or err})")
    return found


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m launch.shared_paths")
    parser.add_argument(
        "--node", default=socket.gethostname(), help="this node, as the plan names it"
    )
    parser.add_argument("--same", action="append", default=[], metavar="PATH=SHA256")
    parser.add_argument("--read", action="append", default=[], metavar="PATH")
    parser.add_argument("--write", action="append", default=[], metavar="DIR")
    args = parser.parse_args(argv)
    found = problems(args.same, args.read, args.write)
    if not found:
        print(f"{args.node}: sees every shared path")
        return 0
    print(f"node {args.node} does not share the job's paths:", file=sys.stderr)
    for line in found:
        print(f"  {line}", file=sys.stderr)
    print(FIX, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
