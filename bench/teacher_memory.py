"""The hf teacher's memory and throughput on requests of mixed lengths, new batcher vs old.

1. Memory: one request of n stateless items (n = 1, 2, 4, ..., 32) with lengths drawn
   from 64..max_context (the longest at max_context), against the longest item scored
   alone. Each measurement runs in a fresh subprocess: it loads the model, pins glibc to
   mmap allocations over 128 KiB (freed tensors leave the resident set at once), warms up
   on a tiny request, records its resident memory, resets the kernel's high-water mark
   (/proc/self/clear_refs) and reads it back after the request (ru_maxrss): growth = peak -
   resident before. Printed per n: ratio = growth / ((total ids / longest ids) x growth of
   the longest alone); the goal is <= 1.5. The old batcher (every stateless item of a
   micro-batch in one left-padded forward with an attention mask, kept here as
   `LeftPaddedBatches` for the comparison) is measured the same way.
2. Throughput on the same mixed load: the requests of every n at once, as concurrent
   clients (the micro-batcher merges their items), new batcher vs old, each in its own
   subprocess (glibc's allocator left as it is: pinned to mmap, every tensor would cost
   page faults), after a warm-up, fastest of --repeats passes; printed as items/s and
   their ratio.

3. Bounds (--part bounds), through the real service (`opd-teacher serve` in a subprocess,
   a fresh one per point, glibc pinned to mmap over 128 KiB through its environment):
   the server's peak RSS growth (VmHWM after /proc/PID/clear_refs, minus VmRSS before)
   for one valid request of growing span x top_k, against its tokens (ids + span x
   top_k, backend.request_tokens): fitted as fixed + slope x tokens, the slope checked
   against body_route.BYTES_PER_TOKEN, the documented bound; and for invalid bodies of
   growing size (bad ids, bad items, unknown keys, one huge value), growth / body bytes
   checked against body_route.BYTES_PER_BODY_BYTE.
4. Hostile load (--part hostile): the 99th-percentile latency of keyed clients scoring
   short items, alone and while unauthenticated idle connections (kept at --idle
   connections, reopened as the server closes them) and invalid bodies (keyed and not)
   arrive, sent by a process of their own; alternated in ROUNDS rounds; the goal is a
   ratio <= 2.

Run (batching: about 3 minutes on 2 cores, the mmap-pinned memory children are slow;
bounds: about 4; hostile: about 2):

    .venv/bin/python bench/teacher_memory.py [--part batching|bounds|hostile|all]
        [--preset qwen3-tiny] [--max-context 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch
from loss_memory import peak_resident_bytes, reset_peak, resident_bytes, set_malloc
from torch import Tensor

from slime_ext.local.loop import TeacherStartError, served_url
from slime_ext.models.factory import build_checkpoint
from teacher_server.api import ScoreItem, ScoreResult
from teacher_server.body_route import BYTES_PER_BODY_BYTE, BYTES_PER_TOKEN, PROCESS_CHECK_BYTES
from teacher_server.hf_backend import HFBackend, HFScorer, ScoreJob
from teacher_server.metrics import ServerMetrics

MIB = 2**20
GOAL = 1.5
SIZES = (1, 2, 4, 8, 16, 32)
MIN_LENGTH = 64


class LeftPaddedBatches:
    """The batcher before bucketing, for comparison only: every item of a micro-batch in
    one forward, left-padded to the longest, with an attention mask (stateless items)."""

    def __init__(self, scorer: HFScorer) -> None:
        self.scorer = scorer

    @torch.no_grad()
    def score_batch(self, jobs: list[ScoreJob]) -> list[ScoreResult | Exception]:
        items = [job.item for job in jobs]
        assert all(item.session_id is None for item in items), "stateless items only"
        width = max(len(item.input_ids) for item in items)
        keep = max(len(item.input_ids) - item.span_start + 1 for item in items)
        input_ids = torch.zeros((len(items), width), dtype=torch.long)
        attention = torch.zeros((len(items), width), dtype=torch.long)
        for row, item in enumerate(items):
            input_ids[row, width - len(item.input_ids) :] = torch.tensor(item.input_ids)
            attention[row, width - len(item.input_ids) :] = 1
        padding: dict[str, Tensor] = {}
        if not bool(attention.all()):
            padding["attention_mask"] = attention
            padding["position_ids"] = (attention.cumsum(-1) - 1).clamp(min=0)
        hidden = self.scorer.model.get_decoder()(
            input_ids=input_ids, use_cache=False, **padding
        ).last_hidden_state[:, -keep:]
        results: list[ScoreResult | Exception] = []
        for row, item in enumerate(items):
            span = len(item.input_ids) - item.span_start
            start = keep - span - 1
            scores = self.scorer._span_scores(item)
            scores.add(hidden[row, start : start + span])
            results.append(scores.result(cached=0, metrics=self.scorer.metrics))
        return results


def request_lengths(n: int, max_context: int, seed: int) -> list[int]:
    """n lengths in MIN_LENGTH..max_context, the first at max_context (n > 1)."""
    rng = random.Random(seed)
    if n == 1:
        return [max_context]
    return [max_context] + [rng.randint(MIN_LENGTH, max_context) for _ in range(n - 1)]


def items_of(lengths: list[int], seed: int) -> list[ScoreItem]:
    rng = random.Random(seed)
    return [
        ScoreItem(
            input_ids=[rng.randrange(800) for _ in range(length)],
            span_start=length - min(256, length // 2),
        )
        for length in lengths
    ]


def _backend(spec: dict[str, Any]) -> HFBackend:
    backend = HFBackend(
        spec["model_dir"], ServerMetrics(), max_context=spec["max_context"], max_queue=10**6
    )
    if spec["batcher"] == "old":
        backend.batcher.run_batch = LeftPaddedBatches(backend.scorer).score_batch
    return backend


async def _score_all(backend: HFBackend, requests: list[list[ScoreItem]]) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(backend.score(items) for items in requests))
    return time.perf_counter() - started


async def _child_run(spec: dict[str, Any]) -> dict[str, float]:
    backend = _backend(spec)
    requests = [items_of(lengths, seed) for seed, lengths in enumerate(spec["requests"])]
    await backend.start()
    try:
        await _score_all(backend, [items_of([MIN_LENGTH, MIN_LENGTH + 1], 99)])  # warm-up
        if spec["repeats"]:
            return {
                "seconds": min(
                    [await _score_all(backend, requests) for _ in range(spec["repeats"])]
                )
            }
        before = resident_bytes()
        if not reset_peak():
            raise SystemExit("needs Linux >= 4.0 (/proc/self/clear_refs) to reset the peak")
        await _score_all(backend, requests)
        return {"growth_mib": (peak_resident_bytes() - before) / MIB}
    finally:
        await backend.stop()


def child(spec_json: str) -> None:
    warnings.filterwarnings("ignore")
    spec = json.loads(spec_json)
    if not spec["repeats"] and not set_malloc(128 * 1024, 128 * 1024):
        raise SystemExit("needs glibc (mallopt) so that freed tensors leave the resident set")
    print("RESULT " + json.dumps(asyncio.run(_child_run(spec))))


def measure(
    model_dir: Path, max_context: int, batcher: str, requests: list[list[int]], repeats: int = 0
) -> Any:
    """Peak RSS growth of scoring `requests` at once (repeats 0), else the fastest of
    `repeats` passes, in a fresh subprocess."""
    spec = {
        "model_dir": str(model_dir),
        "max_context": max_context,
        "batcher": batcher,
        "requests": requests,
        "repeats": repeats,
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    raise RuntimeError(f"{batcher} child failed:\n{done.stderr[-3000:]}")


def batching(args: argparse.Namespace, model_dir: Path) -> None:
    sizes = [int(size) for size in args.sizes.split(",")]
    context = args.max_context
    alone = measure(model_dir, context, "new", [[context]])["growth_mib"]
    print(
        f"teacher memory ({args.preset}, max context {context}): peak RSS growth of one "
        f"request of n items, lengths {MIN_LENGTH}..{context}; the longest "
        f"({context} ids) alone: {alone:.1f} MiB\n"
        f"ratio = growth / ((total ids / longest ids) x longest alone), goal <= {GOAL}"
    )
    print(f"{'n':>3} {'total ids':>9} | {'new MiB':>8} {'ratio':>6} | {'old MiB':>8} {'ratio':>6}")
    worst = 0.0
    load: list[list[int]] = []
    for n in sizes:
        lengths = request_lengths(n, context, seed=n)
        load.append(lengths)
        scale = sum(lengths) / max(lengths)
        row = [f"{n:>3} {sum(lengths):>9}"]
        for batcher in ("new", "old"):
            growth = measure(model_dir, context, batcher, [lengths])["growth_mib"]
            ratio = growth / (scale * alone)
            if batcher == "new":
                worst = max(worst, ratio)
            row.append(f"{growth:>8.1f} {ratio:>6.2f}")
        print(" | ".join(row))
    print(
        f"new batcher: worst ratio {worst:.2f} "
        f"({'PASS' if worst <= GOAL else 'MISS'} goal <= {GOAL})"
    )
    items = sum(len(lengths) for lengths in load)
    ids = sum(map(sum, load))
    seconds = {
        batcher: measure(model_dir, context, batcher, load, args.repeats)["seconds"]
        for batcher in ("new", "old")
    }
    print(
        f"throughput ({len(load)} concurrent requests, {items} items, {ids} ids): new "
        f"{items / seconds['new']:.1f} items/s, old {items / seconds['old']:.1f} items/s, "
        f"ratio {seconds['old'] / seconds['new']:.2f}x"
    )


# -- 3 and 4: the service's bounds, measured through `opd-teacher serve` --------------------

KEY = "bench-key"
ROUNDS = 3
"""hostile: alone and under attack, alternated this many times."""


@contextlib.contextmanager
def serving(
    model_dir: Path, *options: str, cpus: set[int] | None = None
) -> Iterator[tuple[str, int]]:
    """(url, pid) of `opd-teacher serve` on 127.0.0.1 with the bench's key; on `cpus` only
    (its body checker too) when given."""
    port_file = Path(tempfile.mkdtemp(prefix="opd-bench-")) / "port"
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
        "MALLOC_TRIM_THRESHOLD_": str(128 * 1024),
        "MALLOC_ARENA_MAX": "2",
        "OPD_TEACHER_API_KEY": KEY,
    }
    command = [
        sys.executable, "-m", "teacher_server", "serve", "--model", str(model_dir),
        "--port", "0", "--port-file", str(port_file), "--no-request-log", *options,
    ]  # fmt: skip
    server = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    try:
        try:
            url = served_url(server, port_file, 120, "its stderr, once it exited, below")
        except TeacherStartError as err:
            tail = server.stderr.read()[-2000:] if server.poll() is not None else ""  # type: ignore[union-attr]
            raise RuntimeError(f"{err}\n{tail}") from None
        yield url, server.pid
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(port_file.parent, ignore_errors=True)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (the service and its body checker)."""
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            pids += _tree(int(child))
    return pids


def server_growth(pid: int, send: Callable[[], None]) -> int:
    """Bytes the peak RSS of the server's processes grew over their RSS while `send` ran
    (summed over the processes: the service and its body checker)."""
    before = {}
    for each in _tree(pid):
        Path(f"/proc/{each}/clear_refs").write_text("5")
        before[each] = _status_kib(each, "VmRSS")
    send()
    return sum((_status_kib(each, "VmHWM") - rss) * 1024 for each, rss in before.items())


def _post(url: str, body: bytes, expect: int) -> None:
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    answer = httpx.post(f"{url}/v1/score", content=body, headers=headers, timeout=600)
    if answer.status_code != expect:
        raise RuntimeError(f"expected {expect}, got {answer.status_code}: {answer.text[:300]}")


def _fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least-squares (fixed, slope) of growth against size."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - slope * mean_x, slope


WARM_UP = b'{"requests": [{"input_ids": [1, 2, 3], "span_start": 1}]}'


def _warm_up(url: str) -> None:
    """A small request, and a large bad one (its checker process started)."""
    _post(url, WARM_UP, 200)
    _post(url, _bad_ids(PROCESS_CHECK_BYTES * 2), 422)


def bounds(args: argparse.Namespace, model_dir: Path) -> bool:
    context = args.max_context
    limits = ["--max-context", str(context), "--max-top-k", "256", "--max-body-mb", "64"]
    limits += ["--max-request-tokens", str(10**8), "--max-inflight-tokens", str(10**8)]
    rng = random.Random(0)
    ids = [rng.randrange(800) for _ in range(context)]
    print(
        f"\nbounds ({args.preset}, max context {context}): server peak RSS growth per valid "
        f"request of n items of {context} ids scored whole, against its tokens (ids + span x "
        "top_k)"
    )
    print(f"{'items':>5} {'top_k':>5} {'tokens':>9} {'growth MiB':>10} {'B/token':>8}")
    points: list[tuple[int, int]] = []
    for items, top_k in ((1, 0), (1, 64), (1, 256), (2, 256), (4, 256), (8, 256)):
        request = [
            ScoreItem(input_ids=ids[seed:] + ids[:seed], span_start=1, top_k=top_k).model_dump(
                exclude_none=True
            )
            for seed in range(items)
        ]
        body = json.dumps({"requests": request}).encode()
        tokens = items * (context + (context - 1) * top_k)
        with serving(model_dir, *limits) as (url, pid):
            _warm_up(url)
            growth = server_growth(pid, functools.partial(_post, url, body, 200))
        points.append((tokens, growth))
        print(f"{items:>5} {top_k:>5} {tokens:>9} {growth / MIB:>10.1f} {growth / tokens:>8.0f}")
    answer_bound = points[2:]  # top_k 256: the answer outweighs one forward
    fixed, slope = _fit(answer_bound)
    worst = max(abs(y - (fixed + slope * x)) / y for x, y in answer_bound)
    ok_tokens = slope <= BYTES_PER_TOKEN
    print(
        f"fit over top_k 256: {fixed / MIB:.1f} MiB + {slope:.0f} B x tokens (each point "
        f"within {100 * worst:.1f}% of the line; at top_k <= 64 one forward and its logits, "
        f"{points[0][1] / MIB:.0f} MiB, outweigh the answer); bound BYTES_PER_TOKEN = "
        f"{BYTES_PER_TOKEN}: "
        f"{'PASS' if ok_tokens else 'MISS'}"
    )
    print("\ninvalid bodies: server peak RSS growth against body bytes (422 each)")
    print(f"{'body':>14} {'MiB':>5} {'growth MiB':>10} {'x body':>7}")
    worst_ratio = 0.0
    for name, make in BOMBS.items():
        for mib in (1, 4, 16):
            body = make(mib * MIB)
            with serving(model_dir, *limits) as (url, pid):
                _warm_up(url)
                growth = server_growth(pid, functools.partial(_post, url, body, 422))
            worst_ratio = max(worst_ratio, growth / len(body))
            print(
                f"{name:>14} {len(body) / MIB:>5.1f} {growth / MIB:>10.1f} "
                f"{growth / len(body):>7.1f}"
            )
    ok_bodies = worst_ratio <= BYTES_PER_BODY_BYTE
    print(
        f"worst growth {worst_ratio:.1f} x the body; bound BYTES_PER_BODY_BYTE = "
        f"{BYTES_PER_BODY_BYTE}: {'PASS' if ok_bodies else 'MISS'}"
    )
    return ok_tokens and ok_bodies


def _bad_ids(size: int) -> bytes:
    return json.dumps({"requests": [{"input_ids": [-1] * (size // 4), "span_start": 1}]}).encode()


def _bad_items(size: int) -> bytes:
    item = {"input_ids": [1, 2], "span_start": 0}
    return json.dumps({"requests": [item] * (size // 36)}).encode()


def _unknown_keys(size: int) -> bytes:
    item: dict[str, Any] = {"input_ids": [1, 2], "span_start": 1}
    item.update({f"k{i}": 0 for i in range(size // 14)})
    return json.dumps({"requests": [item]}).encode()


def _huge_value(size: int) -> bytes:
    value = [[0] * 50] * (size // 150)
    return json.dumps(
        {"requests": [{"input_ids": [1, 2], "span_start": 1, "top_k": value}]}
    ).encode()


BOMBS: dict[str, Callable[[int], bytes]] = {
    "bad ids": _bad_ids,
    "bad items": _bad_items,
    "unknown keys": _unknown_keys,
    "a huge value": _huge_value,
}


def _keyed_latencies(url: str, seconds: float, clients: int) -> list[float]:
    body = json.dumps({"requests": [{"input_ids": list(range(64)), "span_start": 56}]}).encode()
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    latencies: list[float] = []
    failures: list[str] = []
    stop = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            while time.monotonic() < stop:
                started = time.perf_counter()
                try:
                    status = http.post("/v1/score", content=body).status_code
                except httpx.HTTPError as err:
                    failures.append(type(err).__name__)
                    continue
                latencies.append(time.perf_counter() - started)
                if status != 200:
                    failures.append(str(status))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        print(f"  keyed clients saw {len(failures)} failures: {sorted(set(failures))}")
    return latencies


def attack(url: str, idle: int) -> None:
    """Runs until killed (a child process of its own, so that its work does not slow the
    keyed clients' process): `idle` connections that send nothing, reopened as the server
    closes them, and 4 MiB invalid bodies back to back, with the key and without."""
    host, port = url.removeprefix("http://").split(":")
    stop = threading.Event()

    def idle_connections() -> None:
        sockets: list[socket.socket] = []
        while not stop.is_set():
            alive = []
            for sock in sockets:  # the server closed it: reopen
                try:
                    closed = sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
                except BlockingIOError:
                    closed = False
                except OSError:
                    closed = True
                if closed:
                    sock.close()
                else:
                    alive.append(sock)
            sockets = alive
            while len(sockets) < idle:
                try:
                    sockets.append(socket.create_connection((host, int(port)), timeout=5))
                except OSError:
                    break
            stop.wait(0.5)

    def invalid_bodies() -> None:
        bomb = _bad_ids(4 * MIB)
        with httpx.Client(base_url=url, timeout=30) as http:
            while True:
                for key in (KEY, "wrong"):
                    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
                    with contextlib.suppress(httpx.HTTPError):
                        http.post("/v1/score", content=bomb, headers=headers)

    threading.Thread(target=idle_connections, daemon=True).start()
    invalid_bodies()


def split_cpus() -> tuple[set[int] | None, set[int] | None]:
    """The service's cores and the clients' (half each): an attacker is another machine,
    whose sending should not take the service's cores. None, None on one core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def hostile(args: argparse.Namespace, model_dir: Path) -> bool:
    options = ["--max-context", str(args.max_context), "--max-body-mb", "16"]
    service_cpus, client_cpus = split_cpus()
    print(
        f"\nhostile load: {args.clients} keyed clients scoring 8-token spans for "
        f"{args.seconds:g} s alone and {args.seconds:g} s beside {args.idle} idle "
        "unauthenticated connections and a stream of 4 MiB invalid bodies (keyed and not), "
        f"alternated in {ROUNDS} rounds; the service on cores {service_cpus}, the clients on "
        f"{client_cpus} with the attacker beside them at nice 19 (a machine of its own would "
        "not take their cores)"
    )
    if client_cpus is not None:
        os.sched_setaffinity(0, client_cpus)
    quiet: list[float] = []
    loud: list[float] = []
    with serving(model_dir, *options, cpus=service_cpus) as (url, _):
        _keyed_latencies(url, 2, args.clients)  # warm-up
        for _ in range(ROUNDS):  # alternated, so that drift in the machine's load falls on both
            quiet += _keyed_latencies(url, args.seconds / ROUNDS, args.clients)
            command = [sys.executable, __file__, "--attack", url, "--idle", str(args.idle)]
            attacker = subprocess.Popen(
                command, stderr=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19)
            )
            time.sleep(2)
            try:
                loud += _keyed_latencies(url, args.seconds / ROUNDS, args.clients)
            finally:
                attacker.kill()
                attacker.wait()
    p99 = {
        name: statistics.quantiles(values, n=100)[98]
        for name, values in (("quiet", quiet), ("loud", loud))
    }
    ratio = p99["loud"] / p99["quiet"]
    print(
        f"p99 latency: alone {1000 * p99['quiet']:.0f} ms ({len(quiet)} requests), under attack "
        f"{1000 * p99['loud']:.0f} ms ({len(loud)} requests): ratio {ratio:.2f} "
        f"({'PASS' if ratio <= 2 else 'MISS'} goal <= 2)"
    )
    return ratio <= 2


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--part", choices=("batching", "bounds", "hostile", "all"), default="all")
    parser.add_argument("--preset", default="qwen3-tiny")
    parser.add_argument("--max-context", type=int, default=2048)
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)))
    parser.add_argument("--repeats", type=int, default=3, help="throughput passes per batcher")
    parser.add_argument("--clients", type=int, default=4, help="hostile: keyed clients")
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="hostile: alone, and under attack"
    )
    parser.add_argument("--idle", type=int, default=2000, help="hostile: idle connections")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--attack", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    if args.attack:
        attack(args.attack, args.idle)
        return
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(args.preset, Path(tmp) / args.preset)
        ok = True
        if args.part in ("batching", "all"):
            batching(args, model_dir)
        if args.part in ("bounds", "all"):
            ok &= bounds(args, model_dir)
        if args.part in ("hostile", "all"):
            ok &= hostile(args, model_dir)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
