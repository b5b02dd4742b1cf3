"""Ports for servers that tests start on this host, drawn so that they do not collide.

A server that can take a bound socket gets one (tests.live_server.bound_socket); one that
binds its own port 0 reports it (opd-teacher serve --port-file). What remains needs a
number before it starts (a torch.distributed rendezvous, Ray's ports, a launch config):
those are drawn here, outside Linux's ephemeral range (32768-60999), where the kernel gives
ports to bind(0) and to outgoing connections (a port bind(0) returned and that was bound
again later was taken by one of those under load: EADDRINUSE).
"""

from __future__ import annotations

import collections
import os
import random
import socket

_DRAW = random.SystemRandom()  # tests seed `random`; two draws must not repeat each other
FREE_PORTS = (30_000, 32_768)
"""Where free_port draws: below Linux's ephemeral range (32768-60999), so no bind to port
0 and no outgoing connection is given such a port, and above RAY_BLOCKS."""
RAY_BLOCKS = range(21_000, 30_000, 1_000)
"""A Ray cluster on this host takes one block of 1000 ports: node i's ports from block +
100 i, the head's GCS at block + 999 (tests/ray_nodes.py, launch_standins, rehearsal).
Not 20000-20999: slime's training actors draw their MASTER_PORT there."""


def _share(values: range) -> range:
    """This test process's share of `values`: pytest-xdist's workers (PYTEST_XDIST_WORKER
    gwI of PYTEST_XDIST_WORKER_COUNT) draw from disjoint slices, so the clusters and
    servers of two workers never get the same ports, whatever their timing."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker.startswith("gw") or count <= 1:
        return values
    return values[int(worker[2:]) % count :: count]


def free_port() -> int:
    """A port nothing listens on now, for a process that can neither take a bound socket
    nor pick its own (a torch.distributed rendezvous, Ray's dashboard, a launch config),
    drawn from FREE_PORTS: only another draw could take it before its user binds it (a port
    that bind(0) returned was taken by an outgoing connection that way: EADDRINUSE)."""
    return free_ports(1)[0]


_RECENT: collections.deque[int] = collections.deque(maxlen=256)
"""The ports this process drew last: a draw skips them, as it may not be bound yet (a
launch test draws its Ray port, then its Slurm cluster's ports: one of those was the Ray
port, and the Ray head failed to bind it)."""


def free_ports(count: int) -> list[int]:
    """`count` distinct ports as free_port draws them, none of this process's last 256."""
    ports: list[int] = []
    while len(ports) < count:
        port = _DRAW.choice(_share(range(*FREE_PORTS)))
        if port in ports or port in _RECENT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue
        ports.append(port)
    _RECENT.extend(ports)
    return ports


def ray_port_block() -> int:
    """The first port of a block of RAY_BLOCKS for one Ray cluster on this host."""
    return _DRAW.choice(_share(RAY_BLOCKS))
