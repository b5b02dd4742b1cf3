"""The real SGLang router (PyPI `sglang-router`, the Rust gateway slime starts) in front of
two SGLang stand-ins: with a policy that honours `X-SMG-Routing-Key`, every request of a
trajectory reaches one worker (its prefix cache), and trajectories spread over both; the
default kind of policy (round_robin here, for a deterministic control) splits them.

sglang-router 0.3.2's launcher offers --policy {random, round_robin, cache_aware,
power_of_two, manual}: `manual` (what launch/ passes slime as --router-policy) runs through
that launcher; consistent_hashing, which its Rust core has but its argparse refuses, runs
through RouterArgs. Skipped where sglang_router is absent.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollout.policy import ROUTING_HEADER, SamplingParams, SGLangPolicy
from slime_ext.cpu_runtime.sglang_http import StandinState, create_standin
from slime_ext.models.factory import build_model
from tests.live_server import free_port, serve_in_thread

pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None,
        reason="sglang_router is not installed (pip install sglang-router==0.3.2)",
    ),
]
ROUTER_READY_S = 30.0
TRAJECTORIES = 16
TURNS = 3
LAUNCH_WITH_ROUTER_ARGS = (
    "import json, sys\n"
    "from sglang_router.launch_router import launch_router\n"
    "from sglang_router.router_args import RouterArgs\n"
    "launch_router(RouterArgs(**json.loads(sys.argv[1])))\n"
)


@pytest.fixture(scope="module")
def model(factory_tokenizer: Any) -> Any:
    return build_model("qwen3-tiny", factory_tokenizer, seed=5).eval()


@pytest.fixture(scope="module")
def tokenizer_dir(factory_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workers' model_path: the router loads its tokenizer from there, not the Hub."""
    path = tmp_path_factory.mktemp("router-tokenizer")
    factory_tokenizer.save_pretrained(path)
    return path


@contextmanager
def _workers(model: Any, tokenizer_dir: Path) -> Iterator[list[tuple[str, StandinState]]]:
    with ExitStack() as stack:
        workers = []
        for _ in range(2):
            app = create_standin(model, context_length=1024, model_path=str(tokenizer_dir))
            workers.append((stack.enter_context(serve_in_thread(app)), app.state.standin))
        yield workers


@contextmanager
def _router(policy: str, worker_urls: list[str], log: Path, *, via_cli: bool) -> Iterator[str]:
    """The router on 127.0.0.1 (its Prometheus endpoint too); killed on exit."""
    port, metrics_port = free_port(), free_port()
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": port,
        "worker_urls": worker_urls,
        "policy": policy,
        "prometheus_host": "127.0.0.1",
        "prometheus_port": metrics_port,
        "log_level": "warn",
    }
    if via_cli:
        command = [sys.executable, "-m", "sglang_router.launch_router"]
        for key, value in settings.items():
            flag = f"--{key.replace('_', '-')}"
            command += [flag, *value] if isinstance(value, list) else [flag, str(value)]
    else:
        command = [sys.executable, "-c", LAUNCH_WITH_ROUTER_ARGS, json.dumps(settings)]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _await_workers(url, len(worker_urls), process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _await_workers(url: str, count: int, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + ROUTER_READY_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the router exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            workers = httpx.get(f"{url}/workers", timeout=2).json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            workers = []
        if sum(bool(w.get("is_healthy")) for w in workers) == count:
            return
        time.sleep(0.05)
    pytest.fail(f"the router did not register {count} workers:\n{log.read_text()[-3000:]}")


async def _trajectory(policy: SGLangPolicy, session_id: str, prompt: list[int]) -> None:
    """TURNS turns, each context extending the last by the sampled ids and an observation."""
    context = list(prompt)
    for turn in range(TURNS):
        generation = await policy.generate(context, SamplingParams(max_new_tokens=2), session_id)
        assert generation.output_ids and len(generation.logprobs) == len(generation.output_ids)
        context += [*generation.output_ids, 40 + turn, 41 + turn]


def _run(router: str, sessions: list[str], *, concurrently: bool) -> None:
    async def run() -> None:
        policy = SGLangPolicy(router)
        try:
            prompts = {s: [5 + i, 17, 99, 230] for i, s in enumerate(sessions)}
            if concurrently:
                await asyncio.gather(*(_trajectory(policy, s, prompts[s]) for s in sessions))
            else:
                for session in sessions:
                    await _trajectory(policy, session, prompts[session])
        finally:
            await policy.close()

    asyncio.run(run())


def _sessions_by_worker(workers: list[tuple[str, StandinState]]) -> list[Counter[str]]:
    key = ROUTING_HEADER.lower()
    return [Counter(h[key] for h in state.received_headers) for _, state in workers]


@pytest.mark.parametrize(("policy", "via_cli"), [("consistent_hashing", False), ("manual", True)])
def test_a_routing_key_policy_keeps_each_trajectory_on_one_worker(
    model: Any, tokenizer_dir: Path, tmp_path: Path, policy: str, via_cli: bool
) -> None:
    sessions = [f"task-{i}#0" for i in range(TRAJECTORIES)]
    with _workers(model, tokenizer_dir) as workers:
        urls = [url for url, _ in workers]
        with _router(policy, urls, tmp_path / "router.log", via_cli=via_cli) as router:
            _run(router, sessions, concurrently=True)
        seen = _sessions_by_worker(workers)
    for session in sessions:
        holders = [counts[session] for counts in seen if counts[session]]
        assert holders == [TURNS], f"{session}'s turns were split over workers: {seen}"
    assert all(seen), f"every trajectory went to one worker: {seen}"


def test_round_robin_splits_a_trajectory_over_workers(
    model: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The negative control: a policy that ignores the routing key alternates workers."""
    with _workers(model, tokenizer_dir) as workers:
        urls = [url for url, _ in workers]
        with _router("round_robin", urls, tmp_path / "router.log", via_cli=True) as router:
            _run(router, ["task-0#0"], concurrently=False)
        seen = _sessions_by_worker(workers)
    assert sorted(counts["task-0#0"] for counts in seen) == [1, 2]
