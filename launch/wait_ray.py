"""Wait until a Ray cluster has its nodes: a step of `opd launch`'s plans.

    python3 -m launch.wait_ray --address HEAD:6379 --nodes 7 --timeout-s 600

Polls `ray.nodes()` as a driver (retrying while the head is still starting) until
`--nodes` are alive, prints them (address, CPUs, GPUs, custom resources) and exits 0;
exits 1 with what it saw when the time runs out, so the plan stops there instead of
submitting a job to a cluster that lacks nodes.

The driver runs in a child process: Ray's core worker ends its process from C++ when
the head dies while it connects ("Failed to register worker to Raylet"), and that must
count as one failed attempt, not end the wait. The child prints one JSON line per poll;
the parent starts another child while time is left.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

POLL_S = 2.0


def alive_nodes(address: str) -> list[dict[str, Any]]:
    import logging

    import ray

    if not ray.is_initialized():
        host, _, port = address.rpartition(":")
        # ray.init waits long for a GCS that is not there: ask the port first
        with socket.create_connection((host, int(port)), timeout=5.0):
            pass
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    return [node for node in ray.nodes() if node.get("Alive")]


def describe(node: dict[str, Any]) -> str:
    resources = dict(node.get("Resources", {}))
    custom = {
        k: v
        for k, v in resources.items()
        if k not in ("CPU", "GPU", "memory", "object_store_memory")
        and not k.startswith("node:")
        and not k.startswith("accelerator_type:")
    }
    return (
        f"{node.get('NodeManagerAddress')}: CPU {resources.get('CPU', 0):g}, "
        f"GPU {resources.get('GPU', 0):g}" + (f", {custom}" if custom else "")
    )


def _poll(address: str, nodes: int, timeout_s: float) -> int:
    """The child: one JSON line per poll ({"nodes": [...]} or {"error": ...}); exits 0
    once `nodes` are alive, 1 at its deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            seen = [describe(node) for node in alive_nodes(address)]
        except Exception as err:  # the head may not be up yet: keep trying until the deadline
            print(json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
        else:
            print(json.dumps({"nodes": seen}), flush=True)
            if len(seen) >= nodes:
                return 0
        time.sleep(POLL_S)
    return 1


def _give_up_at(timeout_s: float, nodes: int, address: str) -> threading.Timer:
    """However the wait blocks, exit 1 at the deadline."""

    def give_up() -> None:
        print(
            f"ray at {address}: {nodes} nodes not alive after {timeout_s:.0f} s (no answer)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    timer = threading.Timer(timeout_s + 10.0, give_up)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m launch.wait_ray", description=__doc__)
    parser.add_argument("--address", required=True, help="The head's GCS address, HOST:PORT.")
    parser.add_argument("--nodes", type=int, required=True, help="Alive nodes to wait for.")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--poll", action="store_true", help=argparse.SUPPRESS)  # the child
    options = parser.parse_args(argv)
    if options.poll:
        return _poll(options.address, options.nodes, options.timeout_s)
    watchdog = _give_up_at(options.timeout_s, options.nodes, options.address)
    try:
        return _wait(options)
    finally:
        watchdog.cancel()  # returned in time: this process may live on (a caller's)


class _Driver:
    """One child driver; its lines are read on a thread so the parent keeps its clock."""

    def __init__(self, options: argparse.Namespace, timeout_s: float) -> None:
        command = [sys.executable, "-m", "launch.wait_ray", "--poll"]
        command += ["--address", options.address, "--nodes", str(options.nodes)]
        command += ["--timeout-s", f"{timeout_s:.1f}"]
        # the child imports this module from the same tree, wherever the caller's cwd is
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
        )
        self.reports: list[dict[str, Any]] = []
        self.stderr = ""
        self._threads = [
            threading.Thread(target=self._read_reports, daemon=True),
            threading.Thread(target=self._read_stderr, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _read_reports(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                report = json.loads(line)
            except ValueError:
                continue  # something Ray printed: not ours
            if isinstance(report, dict):
                self.reports.append(report)

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        self.stderr = self.process.stderr.read()[-4000:]

    def finish(self, timeout_s: float) -> int | None:
        """The child's exit status, or None (killed) when it outlives `timeout_s`."""
        try:
            code = self.process.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            code = None
        for thread in self._threads:
            thread.join(timeout=5.0)
        return code


def _wait(options: argparse.Namespace) -> int:
    deadline = time.monotonic() + options.timeout_s
    seen: list[str] = []
    last_error = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        driver = _Driver(options, left)
        code = driver.finish(left + 15.0)  # its own deadline first; then it is hung
        for report in driver.reports:
            if "nodes" in report:
                seen = [str(node) for node in report["nodes"]]
            elif "error" in report:
                last_error = str(report["error"])
        if code == 0:
            print(f"ray at {options.address}: {len(seen)} nodes alive")
            for node in seen:
                print(f"  {node}")
            return 0
        if code not in (0, 1):  # the driver died (Ray ended it): one failed attempt
            tail = driver.stderr.strip().splitlines()[-1:] or ["no output"]
            last_error = f"the driver process ended with {code}: {tail[0][:300]}"
            time.sleep(POLL_S)
    print(
        f"ray at {options.address}: {len(seen)} of {options.nodes} nodes alive after "
        f"{options.timeout_s:.0f} s" + (f" (last error: {last_error})" if last_error else ""),
        file=sys.stderr,
    )
    for node in seen:
        print(f"  {node}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
