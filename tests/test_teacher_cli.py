"""`opd-teacher serve` as a user meets it: one-line errors with the fix and no traceback,
the port checked before the model loads, bundled models, an API page that needs no
internet, a request log, a warning when the teacher is open to the network."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from slime_ext.local.loop import TeacherStartError, served_url
from teacher_server.cli import app, exposed_without_key
from tests.live_server import free_port

SERVE = [sys.executable, "-m", "teacher_server", "serve"]


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and re.fullmatch(r"opd-teacher \d+\.\d+\.\d+\S*\n", result.output)


@pytest.mark.timeout(60)
def test_a_taken_port_is_one_line_before_the_model_is_looked_at() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model does not exist either: the port is what it says, so it was checked first
        done = subprocess.run(
            [*SERVE, "--model", "/nope", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=50,
        )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"opd-teacher: cannot listen on 127.0.0.1:{port}: Address already in use (another "
        "server holds it: stop it or pick --port)"
    ]


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("/nope", "is neither a local HF directory nor factory:<preset>"),
        ("bundled:nope", "bundled models are bundled:student, bundled:teacher, bundled:swe"),
        ("factory:nope", "nope"),
    ],
)
def test_a_model_that_is_not_there_is_one_line(model: str, says: str) -> None:
    result = CliRunner().invoke(app, ["serve", "--model", model, "--port", str(free_port())])
    assert (result.exit_code == 2 and result.exception is None) or isinstance(
        result.exception, SystemExit
    ), result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"opd-teacher: model {model}: ") and says in line


def test_a_directory_that_is_no_model_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    result = CliRunner().invoke(
        app, ["serve", "--model", str(tmp_path), "--port", str(free_port())]
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"opd-teacher: cannot load model {tmp_path}: "), result.output


@pytest.mark.parametrize(
    ("host", "key", "exposed"),
    [
        ("127.0.0.1", None, False),
        ("127.0.5.9", None, False),
        ("::1", None, False),
        ("localhost", None, False),
        ("0.0.0.0", None, True),
        ("::", None, True),
        ("10.1.2.3", None, True),
        ("teacher-node", None, True),
        ("0.0.0.0", "k", False),
    ],
)
def test_serving_beyond_loopback_without_a_key_is_flagged(
    host: str, key: str | None, exposed: bool
) -> None:
    assert exposed_without_key(host, key) is exposed


@pytest.mark.timeout(120)
def test_bundled_teacher_serves_its_api_page_offline_and_logs_each_request(
    tmp_path: Path,
) -> None:
    log, port_file = tmp_path / "server.log", tmp_path / "port"
    with log.open("w") as sink:  # a port of its own choosing, named in --port-file
        command = [*SERVE, "--model", "bundled:teacher", "--api-key", "k", "--port", "0"]
        server = subprocess.Popen(
            [*command, "--port-file", str(port_file)],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        try:
            url = served_url(server, port_file, 100, f"its log: {log}")
        except TeacherStartError as err:
            pytest.fail(f"{err}\n{log.read_text()}")
        assert f"{url}," in log.read_text()  # the first line names the port it bound
        page = httpx.get(f"{url}/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "/v1/score" in page.text and "ScoreRequest" in page.text
        assert "<script" not in page.text and "cdn" not in page.text.lower()
        item = {"requests": [{"input_ids": [1, 2, 3, 4], "span_start": 2}]}
        headers = {"Authorization": "Bearer k"}
        assert httpx.post(f"{url}/v1/score", json=item, headers=headers).status_code == 200
        assert httpx.post(f"{url}/v1/score", json=item).status_code == 401
        deadline = time.monotonic() + 10
        while log.read_text().count("POST /v1/score") < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        server.terminate()
        server.wait(timeout=30)
    text = log.read_text()
    assert "model bundled:teacher" in text and "warning" not in text
    assert re.search(r"127\.0\.0\.1 POST /v1/score 200 \d+ B in, \d+ B out, \d+ ms", text), text
    assert re.search(r"127\.0\.0\.1 POST /v1/score 401 ", text), text
    assert "GET /health" not in text
