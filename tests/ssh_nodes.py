"""Test-only: `count` "nodes" on this one host, each reached over real ssh, for tests of
`opd launch`'s ssh executor (`cluster.ssh_command + [host, command]`).

One sshd (run as root from its own sshd_config, never the system's) listens on a free high
port on the addresses 127.0.B.11, 127.0.B.12, ...; each address is one node. The block B
and the port are drawn at random (and checked free) so that concurrent test runs stay apart.
Host key, client key pair, authorized_keys, config, pid file and log all live in `directory`.

Inside a session on node 127.0.B.x, `SSH_CONNECTION` is "client_ip client_port 127.0.B.x
port": its third field is the node's own address, so a remote command can tell which node
it runs on (e.g. to give each node its own Ray temp dir and ports). Its fourth field, this
sshd's port, marks every process a session started: `SshNodes.leftovers` finds them by it.

- `ssh_available()`: None when nodes can start here, else why not.
- `require_ssh()`: skip with that reason (fail under CI, which must run them).
- `ssh_nodes(directory, count)`: the running nodes, each already accepting a login; on exit
  sshd, its session processes and whatever the sessions left running are killed, the
  latter listed in `SshNodes.killed_at_exit`. sshd also dies with the test process.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.slurm_cluster import _die_with_parent

HOW_TO_INSTALL = "install OpenSSH as root: apt-get install -y openssh-server openssh-client"
FIRST_HOST = 11  # node K answers at 127.0.B.(11+K), as in tests/slurm_cluster.py
START_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
# sshd's compiled-in privilege separation directory; Debian creates it only with the service
PRIVSEP_DIR = Path("/run/sshd")
ACCEPTED_ENV = ("LANG", "LC_*", "OPD_*", "RAY_*")


class SshNodesError(RuntimeError):
    """sshd did not start or a node did not accept a login; the message says why."""


def ssh_available() -> str | None:
    """None when `ssh_nodes` can run here, else the reason it cannot."""
    missing = [name for name in ("sshd", "ssh", "ssh-keygen") if shutil.which(name) is None]
    if missing:
        return f"OpenSSH not installed (no {', '.join(missing)}): {HOW_TO_INSTALL}"
    if os.geteuid() != 0:
        return "sshd must run as root (it logs sessions in as root)"
    return None


def require_ssh() -> None:
    """Skip the calling test when the nodes cannot run here; fail instead under CI."""
    reason = ssh_available()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)


@dataclass
class SshNodes:
    """Running nodes: `ssh_command + [address, command]` runs `command` on a node."""

    directory: Path
    addresses: list[str]
    port: int
    ssh_command: list[str]
    killed_at_exit: list[str] = field(default_factory=list)
    """'pid command line' of session processes still running when the nodes stopped."""

    def run(
        self, address: str, command: str, timeout_s: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """`command` run by the remote login shell on node `address`; output captured."""
        return subprocess.run(
            [*self.ssh_command, address, command],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def leftovers(self, patterns: Iterable[str] = ()) -> list[str]:
        """'pid command line' of live processes that a session on these nodes started
        (an `SSH_CONNECTION` to this sshd's port in their environment), only those whose
        command line contains one of `patterns` when any are given."""
        patterns = list(patterns)
        return [
            f"{pid} {command}"
            for pid, command in self._session_processes()
            if not patterns or any(pattern in command for pattern in patterns)
        ]

    def _session_processes(self) -> Iterator[tuple[int, str]]:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                command = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue  # gone meanwhile
            if command and self._is_session(environ):
                yield int(entry.name), command.replace(b"\0", b" ").decode(errors="replace").strip()

    def _is_session(self, environ: bytes) -> bool:
        for variable in environ.split(b"\0"):
            name, _, value = variable.partition(b"=")
            if name == b"SSH_CONNECTION":
                fields = value.decode(errors="replace").split()
                return (
                    len(fields) == 4 and fields[2] in self.addresses and fields[3] == str(self.port)
                )
        return False


@contextmanager
def ssh_nodes(directory: Path, count: int = 3) -> Iterator[SshNodes]:
    """`count` nodes served by one sshd whose files live in `directory`; on exit every
    process it started (sessions and what they left running) is gone."""
    reason = ssh_available()
    if reason is None and count > 255 - FIRST_HOST:
        reason = f"at most {255 - FIRST_HOST} nodes fit in one address block"
    if reason is not None:
        raise SshNodesError(reason)
    directory.mkdir(parents=True, exist_ok=True)
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    draw = random.Random()
    port = free_port()
    nodes = SshNodes(
        directory=directory,
        addresses=_free_address_block(draw, count, port),
        port=port,
        ssh_command=_client_command(directory, port),
    )
    config = _configure(nodes)
    log = directory / "sshd.log"
    sshd_binary = shutil.which("sshd")
    assert sshd_binary is not None  # checked by ssh_available
    with log.open("wb") as sink:
        sshd = subprocess.Popen(
            # sshd re-executes itself for each connection: it needs its absolute path
            [sshd_binary, "-D", "-e", "-f", str(config)],
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    try:
        _wait_for_logins(nodes, sshd, log)
        yield nodes
    finally:
        _stop(nodes, sshd)


def _free_address_block(draw: random.Random, count: int, port: int) -> list[str]:
    """127.0.B.11... for a B where every address can bind `port` now."""
    for _ in range(100):
        block = draw.randrange(1, 255)
        addresses = [f"127.0.{block}.{FIRST_HOST + index}" for index in range(count)]
        if all(_bindable(address, port) for address in addresses):
            return addresses
    raise SshNodesError(f"no 127.0.B.{FIRST_HOST}+ block with {count} addresses free on {port}")


def _bindable(address: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True


def _client_command(directory: Path, port: int) -> list[str]:
    return [
        "ssh",
        "-F", "/dev/null",  # neither ~/.ssh/config nor /etc/ssh/ssh_config
        "-i", str(directory / "client_ed25519"),
        "-p", str(port),
        "-o", "IdentitiesOnly=yes",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=no",
        "-o", "UserKnownHostsFile=/dev/null",
        "-o", "ConnectTimeout=5",
        "-o", "LogLevel=ERROR",
    ]  # fmt: skip


def _configure(nodes: SshNodes) -> Path:
    """Keys, authorized_keys and sshd_config in `nodes.directory`; the config's path."""
    directory = nodes.directory
    host_key, client_key = directory / "host_ed25519", directory / "client_ed25519"
    for key in (host_key, client_key):
        if not key.exists():
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", key.name, "-f", str(key)],
                check=True,
                capture_output=True,
            )
    authorized_keys = directory / "authorized_keys"
    authorized_keys.write_text(client_key.with_suffix(".pub").read_text())
    authorized_keys.chmod(0o600)
    config = directory / "sshd_config"
    lines = [
        f"Port {nodes.port}",
        *(f"ListenAddress {address}" for address in nodes.addresses),
        f"HostKey {host_key}",
        f"PidFile {directory / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",  # `directory` may sit under a world-writable /tmp
        "UseDNS no",
        "PrintMotd no",
        "X11Forwarding no",
        # `opd launch` opens many sessions at once; the default drops some of them
        "MaxStartups 200",
        "MaxSessions 200",
        f"AcceptEnv {' '.join(ACCEPTED_ENV)}",
        "LogLevel INFO",
    ]
    config.write_text("\n".join(lines) + "\n")
    return config


def _wait_for_logins(nodes: SshNodes, sshd: subprocess.Popen[bytes], log: Path) -> None:
    """Until every address accepts `ssh ... true`; sshd exiting or START_TIMEOUT_S passing
    is an error showing sshd's log."""
    deadline = time.monotonic() + START_TIMEOUT_S
    waiting = list(nodes.addresses)
    while waiting:
        if sshd.poll() is not None:
            raise SshNodesError(f"sshd exited ({sshd.returncode}):\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise SshNodesError(
                f"no ssh login to {', '.join(waiting)} within {START_TIMEOUT_S} s:\n{_tail(log)}"
            )
        try:
            answered = nodes.run(waiting[0], "true", timeout_s=START_TIMEOUT_S).returncode == 0
        except subprocess.TimeoutExpired:
            answered = False
        if answered:
            waiting.pop(0)
        else:
            time.sleep(0.1)


def _stop(nodes: SshNodes, sshd: subprocess.Popen[bytes]) -> None:
    """Kill sshd with its per-connection children, then every process a session left
    running, until none is left; those are recorded in `nodes.killed_at_exit`."""
    for pid in [*_descendants(sshd.pid), sshd.pid]:
        _kill(pid)
    sshd.wait(timeout=STOP_TIMEOUT_S)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while left := nodes.leftovers():
        for line in left:
            if line not in nodes.killed_at_exit:
                nodes.killed_at_exit.append(line)
            _kill(int(line.split(maxsplit=1)[0]))
        if time.monotonic() > deadline:
            raise SshNodesError(f"session processes survive SIGKILL: {left}")
        time.sleep(0.05)


def _descendants(root: int) -> list[int]:
    """Pids of `root`'s children, their children and so on, as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the field after "(comm)" is the state, then the parent pid
            parent = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _kill(pid: int) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
