"""Wait until a Ray cluster has its nodes: a step of `opd launch`'s plans.

    python3 -m launch.wait_ray --address HEAD:6379 --nodes 7 --timeout-s 600

Connects as a driver (retrying while the head is still starting), polls `ray.nodes()`
until `--nodes` are alive, prints them (address, CPUs, GPUs, custom resources) and exits
0; exits 1 with what it saw when the time runs out, so the plan stops there instead of
submitting a job to a cluster that lacks nodes.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from typing import Any


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


def _give_up_at(timeout_s: float, nodes: int, address: str) -> threading.Timer:
    """However Ray blocks (a head that died while we were connected), exit 1 at the
    deadline."""

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m launch.wait_ray", description=__doc__)
    parser.add_argument("--address", required=True, help="The head's GCS address, HOST:PORT.")
    parser.add_argument("--nodes", type=int, required=True, help="Alive nodes to wait for.")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    options = parser.parse_args(argv)
    watchdog = _give_up_at(options.timeout_s, options.nodes, options.address)
    try:
        return _wait(options)
    finally:
        watchdog.cancel()  # returned in time: this process may live on (a caller's)


def _wait(options: argparse.Namespace) -> int:
    deadline = time.monotonic() + options.timeout_s
    seen: list[dict[str, Any]] = []
    last_error = ""
    while time.monotonic() < deadline:
        try:
            seen = alive_nodes(options.address)
        except Exception as err:  # the head may not be up yet: keep trying until the deadline
            last_error = f"{type(err).__name__}: {err}"
            time.sleep(2.0)
            continue
        if len(seen) >= options.nodes:
            print(f"ray at {options.address}: {len(seen)} nodes alive")
            for node in seen:
                print(f"  {describe(node)}")
            return 0
        time.sleep(2.0)
    print(
        f"ray at {options.address}: {len(seen)} of {options.nodes} nodes alive after "
        f"{options.timeout_s:.0f} s" + (f" (last error: {last_error})" if last_error else ""),
        file=sys.stderr,
    )
    for node in seen:
        print(f"  {describe(node)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
