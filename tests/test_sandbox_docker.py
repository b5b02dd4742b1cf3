"""DockerSandbox against a real Docker daemon: results, deadlines, files, lifecycle,
errors, reaping, and the hardening, each hardening case next to a positive control (the
same attack where that protection is off). Attacks are bounded like the local security
suite's. Skipped when no daemon answers (.ci/run starts one); the image is built once per
host by tests/docker_images.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import docker.errors
import pytest

from sandbox import (
    DockerSandbox,
    DockerSandboxConfig,
    ExecResult,
    Sandbox,
    SandboxClosedError,
    SandboxDiedError,
    SandboxError,
    SandboxFileError,
    SandboxStartError,
    SandboxUnavailableError,
)
from sandbox.docker import OWNER_LABEL, SANDBOX_LABEL, docker_client, reap
from tests.docker_images import daemon_problem, sandbox_test_image
from tests.test_sandbox_security import FORK_ATTACK, MEMORY_ATTACK, python_attack

T = TypeVar("T")
OWNER = f"pytest-{os.getpid()}"
SANDBOX_UID = 1000
"""The TIR image's user."""

pytestmark = [
    pytest.mark.skipif(daemon_problem() is not None, reason=f"{daemon_problem()}"),
    # Generous: the first test to run may build the image (about a minute).
    pytest.mark.timeout(300),
]

# Every process but this shell: "pid state uid".
LIST_PROCESSES = """
for d in /proc/[0-9]*; do
  [ "${d#/proc/}" = "$$" ] && continue
  u=; s=
  while read -r key value _; do
    case "$key" in Uid:) u=$value ;; State:) s=$value ;; esac
  done < "$d/status"
  echo "${d#/proc/} $s $u"
done 2>/dev/null
"""


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@pytest.fixture(scope="session")
def image() -> str:
    return sandbox_test_image()


@pytest.fixture(scope="module")
def client() -> Iterator[docker.DockerClient]:
    client = docker_client(concurrency=4)
    yield client
    reap({OWNER_LABEL: OWNER}, client)
    client.close()


def config(image: str, **fields: Any) -> DockerSandboxConfig:
    return DockerSandboxConfig(image=image, owner=OWNER, **fields)


async def sandboxed(cfg: DockerSandboxConfig, cmd: str, timeout_s: float = 20.0) -> ExecResult:
    async with DockerSandbox(cfg) as sandbox:
        return await sandbox.exec(cmd, timeout_s)


async def user_processes(sandbox: DockerSandbox, uid: int, settle_s: float = 2.0) -> list[int]:
    """Live processes of `uid` in the container other than the lister (SIGKILL lands
    asynchronously, so a moment is allowed for the dead to go)."""
    deadline = time.monotonic() + settle_s
    while True:
        listing = (await sandbox.exec(LIST_PROCESSES, 10)).stdout.splitlines()
        rows = [line.split() for line in listing]
        left = [int(r[0]) for r in rows if len(r) == 3 and r[2] == str(uid) and r[1] != "Z"]
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.1)


def labelled(client: docker.DockerClient, owner: str) -> tuple[list[str], list[str]]:
    """Names of the containers and volumes carrying this owner's label."""
    selector = {"label": [f"{SANDBOX_LABEL}=1", f"{OWNER_LABEL}={owner}"]}
    containers = [c.name for c in client.containers.list(all=True, filters=selector)]
    return containers, [v.name for v in client.volumes.list(filters=selector)]


def plain_container(client: docker.DockerClient, image: str, cmd: str) -> str:
    """The control: a container with docker's defaults (as root), nothing dropped."""
    labels = {SANDBOX_LABEL: "1", OWNER_LABEL: OWNER}
    output = client.containers.run(
        image, ["/bin/sh", "-c", cmd], user="0:0", remove=True, labels=labels
    )
    return output.decode()


# -- commands ------------------------------------------------------------------------------


def test_docker_sandbox_implements_the_protocol() -> None:
    assert isinstance(DockerSandbox(), Sandbox)


def test_command_output_streams_and_exit_code(image: str) -> None:
    async def scenario() -> tuple[ExecResult, ExecResult]:
        async with DockerSandbox(config(image)) as sandbox:
            failing = await sandbox.exec("echo out; echo err >&2; exit 3", 10)
            text = await sandbox.exec(r"printf 'caf\303\251 \377'", 10)
            return failing, text

    failing, text = run(scenario())
    assert (failing.exit_code, failing.stdout, failing.stderr) == (3, "out\n", "err\n")
    assert not failing.ok and not failing.timed_out and failing.limit_hit is None
    assert failing.stdout_bytes == 4 and failing.stderr_bytes == 4
    assert text.ok and text.stdout == "café \ufffd"


def test_python_runs_an_edit_made_in_the_second_of_an_earlier_import(image: str) -> None:
    """As in local sandboxes: no stale bytecode (sandbox.base.STEADY_PYTHON_ENV), also in an
    image that does not set it itself (the test base, as SWE-bench's images; `image`, built
    on it, sets it)."""
    from tests.docker_images import BASE_IMAGE
    from tests.test_sandbox_local import STALE_BYTECODE_SCRIPT, assert_ran_the_edit

    assert_ran_the_edit(run(sandboxed(config(BASE_IMAGE), STALE_BYTECODE_SCRIPT, 30)))


def test_cwd_env_and_home_and_no_host_environment(
    image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPD_SANDBOX_TEST_SECRET", "host-secret-8d2e")

    async def scenario() -> tuple[ExecResult, ExecResult, ExecResult]:
        cfg = config(image, env={"FROM_CONFIG": "c1"})
        async with DockerSandbox(cfg) as sandbox:
            await sandbox.exec("mkdir -p sub/dir", 10)
            inside = await sandbox.exec(
                'pwd; echo "$GREETING $FROM_CONFIG $HOME"; env',
                10,
                cwd="sub/dir",
                env={"GREETING": "hi"},
            )
            missing = await sandbox.exec("pwd", 10, cwd="nowhere")
            with pytest.raises(ValueError):
                await sandbox.exec("true", 0)
            return inside, missing, await sandbox.exec("id -u", 10)

    inside, missing, uid = run(scenario())
    assert inside.stdout.startswith("/work/sub/dir\nhi c1 /work\n")
    assert "host-secret-8d2e" not in inside.stdout
    assert missing.exit_code == 1 and "can't cd to nowhere" in missing.stderr  # not an error
    assert uid.stdout == f"{SANDBOX_UID}\n"  # the image's non-root user by default


def test_deadline_kills_the_command_and_everything_it_started(image: str) -> None:
    async def scenario() -> tuple[list[int], ExecResult, float, list[int]]:
        async with DockerSandbox(config(image)) as sandbox:
            # Control: work left behind by a command is visible to the check below.
            await sandbox.exec("sleep 30 >/dev/null 2>&1 &", 10)
            leftover = await user_processes(sandbox, SANDBOX_UID, settle_s=0)
            started = time.monotonic()
            result = await sandbox.exec(
                "setsid sleep 200 >/dev/null 2>&1 & sleep 300 & sleep 100", timeout_s=1
            )
            elapsed = time.monotonic() - started
            return leftover, result, elapsed, await user_processes(sandbox, SANDBOX_UID)

    leftover, result, elapsed, left = run(scenario())
    assert len(leftover) == 1
    assert result.timed_out and result.exit_code == 137 and result.limit_hit == "wall_time"
    assert result.duration_s >= 1.0 and elapsed < 3.0
    assert left == []  # the escaped setsid child and the earlier background sleep too


def test_a_command_that_ends_in_time_is_not_a_timeout_despite_background_output(
    image: str,
) -> None:
    """docker keeps a command's output open a moment for background processes that still
    hold it; that moment is not the command's time."""
    result = run(sandboxed(config(image), "(sleep 1; echo late; sleep 30) & echo done", 1.0))
    assert not result.timed_out and result.exit_code == 0 and result.limit_hit is None
    assert result.stdout.startswith("done\n")


def test_output_flood_is_cut_at_the_cap_keeping_head_and_tail(image: str) -> None:
    cfg = config(image, max_output_mb=8, output_head_kb=16, output_tail_kb=16)
    result = run(sandboxed(cfg, "head -c 100M /dev/zero | tr '\\0' x"))
    assert result.limit_hit == "output" and result.exit_code == 137 and not result.timed_out
    assert result.stdout_truncated
    assert 8 * 1024 * 1024 < result.stdout_bytes < 100 * 1024 * 1024
    assert len(result.stdout) < 33 * 1024 + 200
    assert result.stdout.startswith("x" * 1000) and result.stdout.endswith("x" * 1000)
    assert "bytes of output omitted" in result.stdout


def test_concurrent_sandboxes_share_one_client(image: str, client: docker.DockerClient) -> None:
    async def scenario() -> tuple[list[ExecResult], float]:
        sandboxes = [DockerSandbox(config(image), client=client) for _ in range(4)]
        try:
            await asyncio.gather(*(s.start() for s in sandboxes))
            started = time.monotonic()
            results = await asyncio.gather(
                *(s.exec(f"sleep 1; echo {i}", 10) for i, s in enumerate(sandboxes))
            )
            return list(results), time.monotonic() - started
        finally:
            await asyncio.gather(*(s.close() for s in sandboxes))

    results, elapsed = run(scenario())
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    assert elapsed < 3.5  # they ran side by side, not one after another


# -- the output stream ---------------------------------------------------------------------


def slow_to_read_headers(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.5) -> None:
    """A loaded client: every response's headers are read `delay_s` late, so a quick
    command's output and end are already waiting when http.client reads them."""
    begin = http.client.HTTPResponse.begin

    def late_begin(response: http.client.HTTPResponse) -> None:
        time.sleep(delay_s)
        begin(response)

    monkeypatch.setattr(http.client.HTTPResponse, "begin", late_begin)


def test_output_that_arrives_with_the_response_headers_is_kept(
    image: str, client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fleet's fault test saw this under load: a quick command came back with exit 0
    and no output, which http.client had buffered with the headers (docker-py#2042)."""

    async def scenario() -> tuple[tuple[bytes | None, bytes | None], ExecResult]:
        async with DockerSandbox(config(image)) as sandbox:
            with monkeypatch.context() as patched:
                slow_to_read_headers(patched)
                argv = ["/bin/sh", "-c", "echo hello"]
                exec_id = client.api.exec_create(sandbox.container_id, argv)["Id"]
                docker_py = client.api.exec_start(exec_id, demux=True)  # control: its own reader
                return docker_py, await sandbox.exec("echo hello; echo oops >&2", 10)

    docker_py, result = run(scenario())
    assert docker_py == (None, None)  # the race happened: docker-py lost the output
    assert (result.exit_code, result.stdout, result.stderr) == (0, "hello\n", "oops\n")


class CuttingRelay:
    """A Unix-socket relay to the Docker daemon that, once armed, cuts the next command's
    output connection `keep_bytes` after its HTTP upgrade: the client sees the stream end
    there, the daemon a client that went away, as when the connection drops."""

    def __init__(self, path: Path) -> None:
        daemon = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        if not daemon.startswith("unix://"):
            pytest.skip(f"the relay needs the daemon on a Unix socket, not {daemon}")
        self.upstream = daemon.removeprefix("unix://")
        self.url = f"unix://{path}"
        self.keep_bytes: int | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(str(path))
        self._server.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, keep_bytes: int) -> None:
        with self._lock:
            self.keep_bytes = keep_bytes

    def close(self) -> None:
        with self._lock:
            for sock in [self._server, *self._sockets]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.upstream)
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._forward, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._answer, args=(upstream, client), daemon=True).start()

    def _forward(self, client: socket.socket, upstream: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                upstream.sendall(data)
            upstream.shutdown(socket.SHUT_WR)

    def _answer(self, upstream: socket.socket, client: socket.socket) -> None:
        """Daemon to client; cuts both sides at the armed length after an upgrade."""
        seen, cut_at = b"", None
        with contextlib.suppress(OSError):
            while data := upstream.recv(65536):
                sent = len(seen)
                seen += data
                upgrade = seen.find(b"HTTP/1.1 101")
                headers_end = seen.find(b"\r\n\r\n", upgrade) if upgrade >= 0 else -1
                with self._lock:
                    if cut_at is None and self.keep_bytes is not None and headers_end >= 0:
                        cut_at, self.keep_bytes = headers_end + 4 + self.keep_bytes, None
                if cut_at is None or len(seen) < cut_at:
                    client.sendall(data)
                    continue
                client.sendall(data[: max(cut_at - sent, 0)])
                for sock in (client, upstream):
                    sock.shutdown(socket.SHUT_RDWR)
                return
            client.shutdown(socket.SHUT_WR)


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[CuttingRelay]:
    relay = CuttingRelay(tmp_path / "docker.sock")
    yield relay
    relay.close()


def assert_a_cut_stream_is_a_sandbox_error(
    image: str, relay: CuttingRelay, *, keep_bytes: int, cmd: str, output: str, message: str
) -> None:
    """The command with its output cut `keep_bytes` into the stream raises a SandboxDiedError
    saying `message`; the same command uncut afterwards (the control: the relay passes it
    whole) prints `output`."""

    async def scenario() -> tuple[ExecResult | BaseException, ExecResult]:
        async with DockerSandbox(config(image, docker_url=relay.url)) as sandbox:
            relay.arm(keep_bytes)
            outcome = (await asyncio.gather(sandbox.exec(cmd, 10), return_exceptions=True))[0]
            return outcome, await sandbox.exec(cmd, 10)

    cut, control = run(scenario())
    assert control.stdout == output
    assert isinstance(cut, SandboxDiedError), cut
    assert message in str(cut)


def test_an_output_stream_cut_while_the_command_runs_is_a_sandbox_error(
    image: str, relay: CuttingRelay
) -> None:
    """Not exit 0 with no output: the command finishes after the cut, and it printed."""
    assert_a_cut_stream_is_a_sandbox_error(
        image,
        relay,
        keep_bytes=0,
        cmd="sleep 1.5; echo late",
        output="late\n",
        message="output is incomplete",
    )


def test_an_output_stream_cut_inside_a_frame_is_a_sandbox_error(
    image: str, relay: CuttingRelay
) -> None:
    """8 header bytes and 2 of the 6 payload bytes arrive; "he" is not the output."""
    assert_a_cut_stream_is_a_sandbox_error(
        image,
        relay,
        keep_bytes=10,
        cmd="echo hello",
        output="hello\n",
        message="4 bytes into a frame",
    )


def test_a_command_silent_for_longer_than_the_api_timeout_still_gets_its_output(
    image: str,
) -> None:
    """The output is read without docker's HTTP timeout: the deadline is the command's."""
    result = run(sandboxed(config(image, api_timeout_s=1), "sleep 2; echo done", 10))
    assert (result.exit_code, result.stdout, result.timed_out) == (0, "done\n", False)


# -- files ---------------------------------------------------------------------------------


def test_files_round_trip_owned_by_the_sandbox_user(image: str) -> None:
    payload = bytes(range(256)) * 1000

    async def scenario() -> tuple[bytes, ExecResult, bytes]:
        async with DockerSandbox(config(image)) as sandbox:
            await sandbox.write_file("deep/er/data.bin", payload)
            back = await sandbox.read_file("/work/deep/er/data.bin")
            listing = await sandbox.exec(
                "stat -c '%u %a %n' deep deep/er deep/er/data.bin; echo more >> deep/er/data.bin",
                10,
            )
            await sandbox.exec("echo made by a command > made.txt", 10)
            await sandbox.write_file("made.txt", b"replaced")
            return back, listing, await sandbox.read_file("made.txt")

    back, listing, replaced = run(scenario())
    assert back == payload
    assert listing.exit_code == 0, listing.stderr  # the user may append to what it was given
    assert listing.stdout.splitlines() == [
        f"{SANDBOX_UID} 755 deep",
        f"{SANDBOX_UID} 755 deep/er",
        f"{SANDBOX_UID} 644 deep/er/data.bin",
    ]
    assert replaced == b"replaced"


def test_a_file_that_shrinks_during_the_copy_is_a_sandbox_file_error(
    image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def scenario() -> bytes:
        async with DockerSandbox(config(image)) as sandbox:
            await sandbox.write_file("out.bin", bytes(10_000))
            api = sandbox._api
            copy = api.get_archive

            def cut_short(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
                # What the daemon sends when the file shrinks under it: a header for the
                # size it saw, then less data than that.
                stream, stat = copy(*args, **kwargs)
                return iter([b"".join(stream)[:3000]]), stat

            monkeypatch.setattr(api, "get_archive", cut_short)
            with pytest.raises(SandboxFileError, match="changed while it was read"):
                await sandbox.read_file("out.bin")
            monkeypatch.undo()
            return await sandbox.read_file("out.bin")

    assert run(scenario()) == bytes(10_000)


def test_file_paths_outside_the_workdir_links_and_oversized_reads_are_refused(
    image: str, client: docker.DockerClient
) -> None:
    async def scenario() -> tuple[str, list[str], ExecResult]:
        async with DockerSandbox(config(image, max_read_file_mb=1)) as sandbox:
            await sandbox.exec(
                "ln -s /etc/passwd passwd_link; ln -s /etc etc_link; mkfifo trap; mkdir dir; "
                "head -c 2M /dev/zero > big.bin",
                10,
            )
            # Control: the daemon itself follows a link in a parent to a root-only file.
            stream, _ = client.api.get_archive(sandbox.container_id, "/work/etc_link/shadow")
            naive = b"".join(stream).decode(errors="replace")
            refusals = []
            for op in (
                sandbox.read_file("missing.txt"),
                sandbox.read_file("/etc/hostname"),
                sandbox.read_file("a/../../x"),
                sandbox.write_file("", b"x"),
                sandbox.read_file("passwd_link"),
                sandbox.read_file("etc_link/shadow"),
                sandbox.write_file("etc_link/planted", b"x"),
                sandbox.write_file("passwd_link", b"x"),
                sandbox.read_file("trap"),
                sandbox.read_file("dir"),
                sandbox.read_file("big.bin"),
            ):
                with pytest.raises(SandboxFileError) as refused:
                    await asyncio.wait_for(op, 10)
                refusals.append(str(refused.value))
            return naive, refusals, await sandbox.exec("ls; cat /etc/passwd | head -1", 10)

    naive, refusals, after = run(scenario())
    assert "root:" in naive
    missing, outside, dotdot, empty, link, link_dir, write_dir, write_link, fifo, folder, big = (
        refusals
    )
    assert "No such file" in missing
    assert "outside the working directory" in outside
    assert "inside the working directory" in dotdot and "inside the working directory" in empty
    assert "symlink" in link and "symlink" in link_dir and "symlink" in write_dir
    assert "symlink" in write_link
    assert "not a regular file" in fifo and "not a regular file" in folder
    assert "over the 1,048,576 limit" in big
    assert "planted" not in after.stdout and after.stdout.rstrip().endswith("/bin/bash")


# -- lifecycle and errors ------------------------------------------------------------------


def test_missing_image_is_a_start_error_that_names_it(client: docker.DockerClient) -> None:
    owner = f"{OWNER}-missing"
    cfg = DockerSandboxConfig(image="opd-sandbox-missing:never", owner=owner)
    with pytest.raises(SandboxStartError, match="opd-sandbox-missing:never is not present"):
        run(DockerSandbox(cfg).start())
    assert labelled(client, owner) == ([], [])


def test_an_unreachable_daemon_is_unavailable_not_a_crash() -> None:
    cfg = DockerSandboxConfig(docker_url="unix:///nonexistent/opd-docker.sock", owner=OWNER)
    with pytest.raises(SandboxUnavailableError, match="no Docker daemon answers"):
        run(DockerSandbox(cfg).start())


def test_a_failed_start_leaves_nothing_behind(image: str, client: docker.DockerClient) -> None:
    owner = f"{OWNER}-nouser"
    cfg = config(image, user="nosuchuser").model_copy(update={"owner": owner})
    with pytest.raises(SandboxStartError, match="cannot run commands as user 'nosuchuser'"):
        run(DockerSandbox(cfg).start())
    assert labelled(client, owner) == ([], [])


def test_a_killed_container_is_dead_not_a_command_failure(
    image: str, client: docker.DockerClient
) -> None:
    async def scenario() -> tuple[bool, bool, list[type[BaseException]], list[str]]:
        sandbox = DockerSandbox(config(image))
        await sandbox.start()
        alive_before = await sandbox.is_alive()
        client.containers.get(sandbox.container_id).kill()
        alive_after = await sandbox.is_alive()
        raised = []
        for op in (sandbox.exec("true", 10), sandbox.read_file("x"), sandbox.write_file("x", b"")):
            with pytest.raises(SandboxDiedError) as died:
                await op
            raised.append(type(died.value))
        name = client.containers.get(sandbox.container_id).name
        await sandbox.close()
        return alive_before, alive_after, raised, [name]

    alive_before, alive_after, raised, names = run(scenario())
    assert alive_before and not alive_after
    assert raised == [SandboxDiedError] * 3
    assert names[0] not in labelled(client, OWNER)[0]  # close() still removed it


def test_close_is_idempotent_and_removes_container_and_volume(
    image: str, client: docker.DockerClient
) -> None:
    async def scenario() -> tuple[str, list[str], bool]:
        sandbox = DockerSandbox(config(image))
        await sandbox.start()
        name = client.containers.get(sandbox.container_id).name
        volumes = labelled(client, OWNER)[1]
        await sandbox.close()
        await sandbox.close()
        with pytest.raises(SandboxClosedError):
            await sandbox.exec("true", 10)
        return name, volumes, await sandbox.is_alive()

    name, volumes_before, alive = run(scenario())
    assert f"{name}-work" in volumes_before
    containers, volumes = labelled(client, OWNER)
    assert name not in containers and f"{name}-work" not in volumes
    assert not alive


def test_close_during_a_command_ends_it_with_a_sandbox_error(image: str) -> None:
    async def scenario() -> tuple[BaseException | ExecResult, float]:
        sandbox = DockerSandbox(config(image))
        await sandbox.start()
        running = asyncio.create_task(sandbox.exec("sleep 60", timeout_s=60))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        await sandbox.close()
        outcome = (await asyncio.gather(running, return_exceptions=True))[0]
        return outcome, time.monotonic() - started

    outcome, elapsed = run(scenario())
    assert isinstance(outcome, SandboxError), outcome
    assert elapsed < 10


def test_reap_removes_only_the_labelled_leftovers(image: str, client: docker.DockerClient) -> None:
    crashed, other = f"{OWNER}-crashed", f"{OWNER}-other"

    async def leave_behind() -> None:
        for owner in (crashed, crashed, other):
            cfg = config(image).model_copy(update={"owner": owner})
            await DockerSandbox(cfg, client=client).start()  # never closed: a crashed run

    run(leave_behind())
    assert [len(x) for x in labelled(client, crashed)] == [2, 2]
    assert reap({OWNER_LABEL: crashed}, client) == 2
    assert labelled(client, crashed) == ([], [])
    assert [len(x) for x in labelled(client, other)] == [1, 1]
    assert reap({OWNER_LABEL: other}, client) == 1


# -- hardening -----------------------------------------------------------------------------


def test_host_loopback_listener_is_unreachable(image: str) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        attack = f"exec 3<>/dev/tcp/127.0.0.1/{server.getsockname()[1]} && echo connected"
        control = run(sandboxed(config(image, network_mode="host"), attack))
        assert control.exit_code == 0 and "connected" in control.stdout

        result = run(sandboxed(config(image), attack + "; exec 4<>/dev/tcp/172.17.0.1/53"))
    assert "connected" not in result.stdout and result.exit_code != 0
    assert "Connection refused" in result.stderr  # a loopback of its own, nothing behind it
    assert "Network is unreachable" in result.stderr  # and no route out


def test_fork_attack_stops_at_the_process_cap(image: str) -> None:
    attack = python_attack(FORK_ATTACK)
    control = run(sandboxed(config(image, max_processes=1024), attack))
    assert control.exit_code == 0 and int(control.stdout) == 300

    result = run(sandboxed(config(image, max_processes=64), attack))
    assert result.exit_code == 1
    assert 0 < int(result.stdout) < 64
    assert "Resource temporarily unavailable" in result.stderr
    assert result.limit_hit == "processes"


def test_classic_fork_bomb_is_contained_and_cleaned_up(image: str) -> None:
    async def scenario() -> tuple[ExecResult, list[int], ExecResult]:
        async with DockerSandbox(config(image, max_processes=64)) as sandbox:
            result = await sandbox.exec(":(){ :|:& };:; sleep 30", timeout_s=2)
            left = await user_processes(sandbox, SANDBOX_UID)
            return result, left, await sandbox.exec("echo still usable", 10)

    result, left, after = run(scenario())
    assert result.timed_out and result.limit_hit == "wall_time"
    assert left == []
    assert after.stdout == "still usable\n"


def test_memory_bomb_is_killed_at_the_container_limit(image: str) -> None:
    attack = python_attack(MEMORY_ATTACK, 512)
    control = run(sandboxed(config(image, memory_mb=1024), attack))
    assert control.exit_code == 0 and "allocated 536870912" in control.stdout

    async def scenario() -> tuple[ExecResult, ExecResult, ExecResult]:
        async with DockerSandbox(config(image, memory_mb=256)) as sandbox:
            small = await sandbox.exec(python_attack(MEMORY_ATTACK, 64), 20)
            bomb = await sandbox.exec(attack, 20)
            return small, bomb, await sandbox.exec("echo survived", 10)

    small, bomb, after = run(scenario())
    assert small.exit_code == 0 and "allocated 67108864" in small.stdout  # cap is not too low
    assert bomb.exit_code == 137 and "allocated" not in bomb.stdout
    assert bomb.limit_hit == "memory" and not bomb.timed_out
    assert after.stdout == "survived\n"  # the OOM killer took the command, not the sandbox


def test_root_file_system_is_read_only_and_tmp_and_workdir_are_capped(image: str) -> None:
    plant = "echo pwned > /usr/planted && cat /usr/planted"
    control = run(sandboxed(config(image, user="0:0", read_only=False), plant))
    assert control.exit_code == 0 and control.stdout == "pwned\n"

    result = run(sandboxed(config(image, user="0:0"), plant))
    assert result.exit_code != 0 and "Read-only file system" in result.stderr

    fill = (
        "head -c 8M /dev/zero > /tmp/ok && head -c 8M /dev/zero > ok && echo fits; "
        "head -c 32M /dev/zero > /tmp/fill; head -c 32M /dev/zero > fill"
    )
    capped = run(sandboxed(config(image, tmp_size_mb=16, workdir_size_mb=16), fill))
    assert capped.stdout == "fits\n"
    assert capped.stderr.count("No space left on device") == 2


def test_no_capabilities_no_privilege_gain_and_a_non_root_user(
    image: str, client: docker.DockerClient
) -> None:
    probe = "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status; chown 4242 /work && echo chowned"
    control = plain_container(client, image, probe + " 2>&1; true")
    assert "CapEff:\t0000000000000000" not in control and "NoNewPrivs:\t0" in control
    assert "chowned" in control

    async def as_root() -> tuple[ExecResult, ExecResult]:
        async with DockerSandbox(config(image, user="0:0")) as sandbox:
            result = await sandbox.exec(probe, 10)
            await sandbox.exec("kill -KILL -1; pkill -KILL sleep; true", 10)
            return result, await sandbox.exec("id -u", 10)  # nothing it kills ends the sandbox

    root, still_root = run(as_root())
    default = run(sandboxed(config(image), probe + "; id -u"))
    for result in (root, default):
        assert "CapEff:\t0000000000000000" in result.stdout
        assert "NoNewPrivs:\t1" in result.stdout
        assert "chowned" not in result.stdout and "Operation not permitted" in result.stderr
    assert still_root.stdout == "0\n"
    assert default.stdout.splitlines()[-1] == str(SANDBOX_UID)


# -- the host afterwards -------------------------------------------------------------------


def test_nothing_is_left_behind(image: str, client: docker.DockerClient) -> None:
    async def forgotten() -> None:
        await DockerSandbox(config(image), client=client).start()

    run(forgotten())  # control: an unclosed sandbox is seen by the check below
    assert [len(x) for x in labelled(client, OWNER)] == [1, 1]
    reap({OWNER_LABEL: OWNER}, client)
    assert labelled(client, OWNER) == ([], [])
