"""Run an ASGI app on 127.0.0.1 in a background thread: a real HTTP server for tests."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from teacher_server.api import SERVICE_KEEP_ALIVE_S
from tests.ports import free_port as free_port


def bound_socket() -> socket.socket:
    """A socket bound to a free port on 127.0.0.1, for a server that takes it (bound and
    handed over: nothing can take the port in between)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextmanager
def serve_in_thread(app: Any, startup_timeout_s: float = 60.0, **options: Any) -> Iterator[str]:
    """Yields the base URL; stops the server (running its shutdown) on exit. `options`: more
    uvicorn.Config arguments (`http=` a protocol class)."""
    sock = bound_socket()
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_keep_alive=int(SERVICE_KEEP_ALIVE_S),
            **options,
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_until_healthy(url: str, server: Any, log: Any, timeout_s: float = 120.0) -> None:
    """Until `url`/health answers 200; a server process (`server`, a Popen) that exits or
    the deadline passing fails the test with the server's log (`log`, a Path)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        assert server.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server did not come up:\n{log.read_text()}"
        time.sleep(0.2)
