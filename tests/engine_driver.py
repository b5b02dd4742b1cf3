"""Test-only driver of tests/test_sglang_engine.py: slime's own engine code against the
SGLang stand-in engine (slime_ext/cpu_runtime/sglang_engine.py), in a process of its own
under the CPU runtime, on a Ray cluster.

`python -m tests.engine_driver SPEC OUT`: SPEC is JSON {gcs_address, hf_dir, directory};
OUT gets what was observed (JSON), for the test to judge. Everything goes through slime:
its argument parser (SGLang's flags from ServerArgs), `ray.remote(SGLangEngine)` actors,
`_start_router`, `SGLangEngine.init` (launch_server_process, registration with the
router), `connect_rollout_engines_from_distributed` and `update_weights_from_distributed`
(the transport of UpdateWeightFromDistributed), `_build_flattened_tensor_data` with slime's
serializer import (the colocated transport), and the engines' own methods.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
from transformers import AutoModelForCausalLM

from slime_ext.cpu_runtime.sglang_engine import PROBE_IDS, PROBE_TOP_K, top_logprobs

ENGINES = 2
TopK = dict[str, list[list[Any]]]
"""Top-k log-probs by position: {"values": [[float]], "indices": [[int]]}."""


def slime_engine_args(hf_dir: str, *, external: bool = False) -> argparse.Namespace:
    """The engine-side arguments as slime's parser gives them (its SGLang flags); with
    `external`, what --rollout-external-engine-addrs sets."""
    from slime.backends.sglang_utils.arguments import add_sglang_arguments, validate_args
    from slime.utils.arguments import get_slime_extra_args_provider

    parser = argparse.ArgumentParser(allow_abbrev=False)
    get_slime_extra_args_provider()(parser)
    add_sglang_arguments(parser)
    args, _ = parser.parse_known_args(
        ["--hf-checkpoint", hf_dir, "--rollout-num-gpus-per-engine", "1",
         "--num-gpus-per-node", "2", "--router-policy", "manual", "--rollout-batch-size", "1"]
    )  # fmt: skip
    args.offload_rollout = bool(args.offload_rollout)
    args.rollout_external, args.fp16 = external, False  # Megatron-LM's flag
    args.actor_num_gpus_per_node, args.actor_num_nodes = 0, 1
    args.debug_rollout_only = args.debug_train_only = False  # slime pre-parses these
    validate_args(args)
    return args


def scored(url: str) -> TopK:
    """The engine's top-k prompt log-probs of PROBE_IDS (its current weights), by the
    position that predicts each token (SGLang's entry 0 has none)."""
    body = {
        "input_ids": list(PROBE_IDS), "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": PROBE_TOP_K,
    }  # fmt: skip
    meta = httpx.post(f"{url}/generate", json=body, timeout=60).json()["meta_info"]
    rows = meta["input_top_logprobs"][1:]
    return {
        "values": [[v for v, _, _ in row] for row in rows],
        "indices": [[i for _, i, _ in row] for row in rows],
    }


def local_scored(model: Any) -> TopK:
    """The same of `model` in this process (its last position predicts nothing scored)."""
    top = top_logprobs(model)
    return {key: rows[:-1] for key, rows in top.items()}


def gap(engine: TopK, local: TopK) -> float:
    """Largest difference of top-k log-probs (inf where the top-k ids differ)."""
    if engine["indices"] != local["indices"]:
        return float("inf")
    rows = zip(engine["values"], local["values"], strict=True)
    return max(abs(a - b) for row, ref in rows for a, b in zip(row, ref, strict=True))


def perturbed(model: Any, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def routed_sessions(router: str, urls: list[str]) -> dict[str, list[int]]:
    """Eight 3-turn trajectories through the router with our policy: per session, how
    many of its requests each engine received."""
    from rollout.policy import ROUTING_HEADER, SamplingParams, SGLangPolicy

    async def trajectories() -> None:
        policy = SGLangPolicy(router)

        async def one(session: str, first: int) -> None:
            context = [first, 17, 99]
            for turn in range(3):
                out = await policy.generate(context, SamplingParams(max_new_tokens=2), session)
                context += [*out.output_ids, 40 + turn]

        try:
            await asyncio.gather(*(one(f"task-{i}#0", 5 + i) for i in range(8)))
        finally:
            await policy.close()

    asyncio.run(trajectories())
    key = ROUTING_HEADER.lower()
    counts: dict[str, list[int]] = {}
    for at, url in enumerate(urls):
        for headers in httpx.get(f"{url}/standin/headers", timeout=10).json():
            counts.setdefault(headers.get(key, "?"), [0] * len(urls))[at] += 1
    return counts


def wait_for_workers(router: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        workers = httpx.get(f"{router}/workers", timeout=10).json()["workers"]
        if sum(bool(w.get("is_healthy", True)) for w in workers) >= count:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{router} did not register {count} workers")


def generate_in_background(url: str, out: dict[str, Any]) -> threading.Thread:
    """A long generation that a pause must abort."""

    def run() -> None:
        body = {"input_ids": list(PROBE_IDS), "sampling_params": {"max_new_tokens": 400}}
        out["answer"] = httpx.post(f"{url}/generate", json=body, timeout=120).json()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def main(spec: dict[str, Any], out_path: Path) -> None:
    from slime.backends.megatron_utils.sglang import MultiprocessingSerializer
    from slime.backends.megatron_utils.update_weight.update_weight_from_distributed import (
        connect_rollout_engines_from_distributed,
        update_weights_from_distributed,
    )
    from slime.backends.megatron_utils.update_weight.update_weight_from_tensor import (
        _build_flattened_tensor_data,
    )
    from slime.backends.sglang_utils.sglang_engine import SGLangEngine
    from slime.ray.rollout import _start_router

    from tests.live_server import free_port

    ray.init(address=spec["gcs_address"], logging_level="ERROR")
    observed: dict[str, Any] = {}
    args = slime_engine_args(spec["hf_dir"])
    router_ip, router_port = _start_router(args)
    router = f"http://{router_ip}:{router_port}"
    actor = ray.remote(SGLangEngine).options(num_cpus=0.1, num_gpus=0)
    engines = [actor.remote(args, rank=rank) for rank in range(ENGINES)]
    ray.get(
        [
            engine.init.remote(
                f"127.0.0.1:{free_port()}",
                free_port(),
                free_port(),
                host="127.0.0.1",
                router_ip=router_ip,
                router_port=router_port,
            )
            for engine in engines
        ],
        timeout=240,
    )
    urls = ray.get([engine.get_url.remote() for engine in engines], timeout=30)
    observed["registered"] = sorted(
        w["url"] for w in httpx.get(f"{router}/workers", timeout=10).json()["workers"]
    )
    observed["urls"] = urls
    observed["sessions"] = routed_sessions(router, urls)
    # the negative control: a router whose policy ignores the routing key splits them
    args.router_policy, args.sglang_router_ip = "round_robin", None
    ip, port = _start_router(args, force_new=True)
    for url in urls:
        httpx.post(f"http://{ip}:{port}/workers", json={"url": url}, timeout=30)
    wait_for_workers(f"http://{ip}:{port}", len(urls))
    for url in urls:
        httpx.post(f"{url}/standin/headers/clear", timeout=10)
    observed["sessions_round_robin"] = routed_sessions(f"http://{ip}:{port}", urls)

    # slime's external-engine check reads /server_info
    external = slime_engine_args(spec["hf_dir"], external=True)
    port = int(urls[0].rsplit(":", 1)[1])
    checker = SGLangEngine(external, rank=0)
    checker.init("127.0.0.1:1", port, free_port(), host="127.0.0.1")
    external.offload_rollout = True  # expects enable_memory_saver, which the engine lacks
    try:
        SGLangEngine(external, rank=0).init("127.0.0.1:1", port, free_port(), host="127.0.0.1")
        observed["external_mismatch"] = "accepted"
    except AssertionError as error:
        observed["external_mismatch"] = str(error).split(" ", 1)[0]

    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=torch.float32).eval()
    observed["initial_gap"] = max(gap(scored(url), local_scored(model)) for url in urls)
    initial = scored(urls[0])

    # the distributed transport, as UpdateWeightFromDistributed.update_weights drives it
    group = connect_rollout_engines_from_distributed(args, "slime-pp_0", engines)
    in_flight: dict[str, Any] = {}
    thread = generate_in_background(urls[0], in_flight)
    while not httpx.get(f"{urls[0]}/v1/loads", timeout=10).json()["loads"][0]["num_running_reqs"]:
        pass
    ray.get([engine.pause_generation.remote() for engine in engines], timeout=60)
    ray.get([engine.flush_cache.remote() for engine in engines], timeout=60)
    thread.join(timeout=60)
    observed["paused_request"] = in_flight["answer"]["meta_info"]["finish_reason"]
    perturbed(model, seed=1)
    observed["stale_gap"] = gap(initial, local_scored(model))  # what a missed update shows
    named = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    refs = update_weights_from_distributed("slime-pp_0", group, 1, engines, named)
    observed["distributed_replies"] = ray.get(refs, timeout=120)
    ray.get([engine.continue_generation.remote() for engine in engines], timeout=60)
    observed["distributed_gap"] = max(gap(scored(url), local_scored(model)) for url in urls)
    observed["versions"] = ray.get([e.get_weight_version.remote() for e in engines], timeout=30)

    # an update naming a parameter the model lacks: refused whole, nothing changed
    bad = [(named[0][0], named[0][1] + 1.0), ("model.no_such.weight", torch.zeros(3))]
    refs = update_weights_from_distributed("slime-pp_0", group, 2, engines, bad)
    try:
        ray.get(refs, timeout=120)
        observed["bad_update"] = "accepted"
    except ray.exceptions.RayTaskError as error:
        observed["bad_update"] = "no parameter" in str(error)
    observed["gap_after_bad_update"] = max(gap(scored(u), local_scored(model)) for u in urls)

    # the colocated transport: slime's flattened bucket through its serializer import
    perturbed(model, seed=2)
    named = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    serialized = MultiprocessingSerializer.serialize(
        _build_flattened_tensor_data(named), output_str=True
    )
    ray.get(
        engines[0].update_weights_from_tensor.remote(
            serialized_named_tensors=[serialized],
            load_format="flattened_bucket",
            weight_version="2",
        ),
        timeout=120,
    )
    observed["tensor_gap"] = gap(scored(urls[0]), local_scored(model))

    # memory released: generation and weight updates refused until resumed
    ray.get(engines[0].release_memory_occupation.remote(), timeout=60)
    refused = httpx.post(f"{urls[0]}/generate", json={"input_ids": list(PROBE_IDS)}, timeout=30)
    observed["generate_while_released"] = refused.status_code
    perturbed(model, seed=3)
    checkpoint = Path(spec["directory"]) / "v3"
    model.save_pretrained(checkpoint)
    try:
        ray.get(engines[0].update_weights_from_disk.remote(str(checkpoint), weight_version="3"))
        observed["update_while_released"] = "accepted"
    except ray.exceptions.RayTaskError as error:
        observed["update_while_released"] = "released" in str(error)
    # slime's colocated order: the weights back first (onload_weights), the KV cache after
    ray.get(engines[0].resume_memory_occupation.remote(tags=["weights"]), timeout=60)
    refused = httpx.post(f"{urls[0]}/generate", json={"input_ids": list(PROBE_IDS)}, timeout=30)
    observed["generate_with_kv_cache_released"] = refused.status_code
    bogus = httpx.post(f"{urls[0]}/release_memory_occupation", json={"tags": ["vram"]}, timeout=30)
    observed["unknown_memory_tag"] = bogus.status_code
    ray.get(engines[0].resume_memory_occupation.remote(), timeout=60)
    ray.get(engines[0].update_weights_from_disk.remote(str(checkpoint), weight_version="3"))
    observed["disk_gap"] = gap(scored(urls[0]), local_scored(model))
    observed["disk_version"] = ray.get(engines[0].get_weight_version.remote(), timeout=30)

    ray.get([engine.shutdown.remote() for engine in engines], timeout=60)
    observed["workers_after_shutdown"] = httpx.get(f"{router}/workers", timeout=10).json()[
        "workers"
    ]
    out_path.write_text(json.dumps(observed))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
