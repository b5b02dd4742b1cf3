"""Fleet throughput: a warm pool vs cold starts, as a ratio measured in one run.

Each round is one rollout batch: `--concurrency` trajectories at once, each acquiring a
sandbox, running `--commands` short commands and closing it. Between rounds the trainer
would be busy; a warm host refills its pool then (that time is printed, not counted). The
cold fleet starts every sandbox when asked. Printed per mode: commands per second,
sandboxes handed out per second (container starts from the trajectories' view), acquire
latency; then warm / cold ratios.

    .venv/bin/python bench/fleet_throughput.py                    # Docker, 32 at once
    .venv/bin/python bench/fleet_throughput.py --backend local    # local sandboxes
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

from sandbox.docker import DockerSandboxConfig
from sandbox.fleet import Fleet, FleetConfig, HostConfig, InProcessHost
from sandbox.local import LocalSandboxConfig


@dataclass
class Round:
    wall_s: float
    commands: int
    acquired: int
    acquire_s: list[float]
    refill_s: float


def host_config(args: argparse.Namespace, warm: int) -> HostConfig:
    return HostConfig(
        name="bench",
        backend=args.backend,
        local=LocalSandboxConfig(uid_base=1_900_000_000, uid_count=1000),
        docker=DockerSandboxConfig(image=args.image, memory_mb=256, workdir_size_mb=16),
        max_sandboxes=args.concurrency + warm,
        warm_per_image=warm,
    )


async def run_mode(args: argparse.Namespace, warm: int) -> list[Round]:
    config = FleetConfig(owner=f"bench-fleet-{'warm' if warm else 'cold'}")
    host = InProcessHost(host_config(args, warm), config.owner)
    rounds = []
    async with Fleet([host], config) as fleet:

        async def trajectory(index: int, acquire_s: list[float]) -> int:
            started = time.perf_counter()
            async with await fleet.acquire() as sandbox:
                acquire_s.append(time.perf_counter() - started)
                for step in range(args.commands):
                    result = await sandbox.exec(f"echo {index}-{step}", 30)
                    assert result.stdout == f"{index}-{step}\n", result
            return args.commands

        for _ in range(args.rounds):
            refill_started = time.perf_counter()
            await fleet.prefetch([None])  # waits for the warm pool (nothing when cold)
            refill_s = time.perf_counter() - refill_started
            acquire_s: list[float] = []
            started = time.perf_counter()
            done = await asyncio.gather(
                *(trajectory(i, acquire_s) for i in range(args.concurrency))
            )
            wall_s = time.perf_counter() - started
            rounds.append(Round(wall_s, sum(done), len(done), acquire_s, refill_s))
    return rounds


def report(name: str, rounds: list[Round]) -> tuple[float, float]:
    wall = sum(r.wall_s for r in rounds)
    commands_per_s = sum(r.commands for r in rounds) / wall
    starts_per_s = sum(r.acquired for r in rounds) / wall
    acquire = [s for r in rounds for s in r.acquire_s]
    refill = sum(r.refill_s for r in rounds)
    print(
        f"{name:>5}: {commands_per_s:8.1f} commands/s  {starts_per_s:7.2f} sandboxes/s  "
        f"acquire p50 {statistics.median(acquire):.3f} s  max {max(acquire):.3f} s  "
        f"(refill between rounds {refill:.1f} s, not counted)"
    )
    return commands_per_s, starts_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["docker", "local"], default="docker")
    parser.add_argument("--image", default="opd-sandbox-tir:latest")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--commands", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{args.backend}: {args.rounds} rounds of {args.concurrency} concurrent trajectories, "
        f"{args.commands} commands each"
    )
    cold = report("cold", asyncio.run(run_mode(args, warm=0)))
    warm = report("warm", asyncio.run(run_mode(args, warm=args.concurrency)))
    print(
        f"warm / cold: commands/s x{warm[0] / cold[0]:.2f}, "
        f"sandboxes handed out/s x{warm[1] / cold[1]:.2f}"
    )


if __name__ == "__main__":
    main()
