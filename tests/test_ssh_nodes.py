"""The ssh nodes fixture (tests/ssh_nodes.py): each address is its own node over real ssh,
what a session leaves running is found, and nothing outlives the context."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.processes import running
from tests.ssh_nodes import require_ssh, ssh_nodes


@pytest.mark.timeout(60)
def test_each_node_sees_its_own_address_and_nothing_outlives_the_nodes(tmp_path: Path) -> None:
    require_ssh()
    with ssh_nodes(tmp_path / "ssh", count=3) as nodes:
        assert len(set(nodes.addresses)) == 3
        for address in nodes.addresses:
            answer = nodes.run(address, "echo ${SSH_CONNECTION}")
            assert answer.returncode == 0, answer.stderr
            assert answer.stdout.split()[2:] == [address, str(nodes.port)]

        started = nodes.run(nodes.addresses[1], "nohup sleep 300 > /dev/null 2>&1 &")
        assert started.returncode == 0, started.stderr
        left = nodes.leftovers(["sleep 300"])
        assert len(left) == 1, left
        sleeper = int(left[0].split()[0])
        sshd_pid = int((tmp_path / "ssh" / "sshd.pid").read_text())
        assert nodes.leftovers(["no such command"]) == []

    assert [line.split()[0] for line in nodes.killed_at_exit] == [str(sleeper)]
    assert nodes.leftovers() == []
    for pid in (sleeper, sshd_pid):
        assert not running(pid)


def test_require_ssh_fails_under_ci_when_ssh_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="OpenSSH not installed"):
        require_ssh()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="OpenSSH not installed"):
        require_ssh()
