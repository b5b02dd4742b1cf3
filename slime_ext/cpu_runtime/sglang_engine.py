"""The SGLang stand-in ENGINE: a TEST AND REHEARSAL AID, what slime's `SGLangEngine`
launches on a machine where SGLang cannot run (`sglang_api.launch_server` -> `serve`). It
serves the HF checkpoint at `model_path` with sglang_http's API and the routes through
which slime moves weights and memory, restated from SGLang 0.5.23
(entrypoints/http_server.py, model_executor/model_runner_components/weight_updater.py,
utils/common.py `init_custom_process_group`):

- POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
  group_name, backend}: joins the trainer's group as SGLang does (a tcp rendezvous, the
  store under a PrefixStore(group_name), `_new_process_group_helper`), rank rank_offset
  (one engine rank: tp 1). /destroy_weights_update_group {group_name}.
- POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
  weight_version, load_format}: one broadcast from rank 0 per tensor in order (one
  flattened uint8 bucket with load_format "flattened_bucket"), then loaded by HF name.
- POST /update_weights_from_tensor {serialized_named_tensors, load_format,
  weight_version}: this rank's entry deserialized (`sglang_api.MultiprocessingSerializer`);
  with "flattened_bucket" a {flattened_tensor, metadata} dict, else (name, tensor) pairs.
- POST /update_weights_from_disk {model_path, weight_version}: the checkpoint's
  safetensors loaded.
- /release_memory_occupation, /resume_memory_occupation {tags}: recorded (SGLang's tags
  "weights", "kv_cache", "cuda_graph"; none = all; another is a 400). While weights are
  released a weight update is refused, and while anything is released /generate is
  (SGLang would touch freed memory).
- GET /get_weight_version (slime's SGLangEngine.get_weight_version asks it; SGLang 0.5.23
  reports the version in /model_info), POST /get_weights_by_name {name, truncate_size}.

Replies are SGLang's {"success": bool, "message": str}, 400 on failure. A name the model
does not have, or a shape that differs, fails the whole update and changes nothing.

With $OPD_STANDIN_PROBE_LOG set, every update appends one JSON line to that file: the
engine's url, the new weight version and the top-k log-probs of PROBE_IDS under the new
weights (what tests and rehearsals compare with the trainer's model).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import (
    GroupName,
    PrefixStore,
    _new_process_group_helper,
    rendezvous,
)

from slime_ext.cpu_runtime.sglang_api import (
    GPU_MEMORY_ALL_TYPES,
    FlattenedTensorBucket,
    MultiprocessingSerializer,
    ServerArgs,
)
from slime_ext.cpu_runtime.sglang_http import StandinState, create_standin

logger = logging.getLogger(__name__)
GROUP_TIMEOUT = timedelta(minutes=10)
PROBE_LOG_ENV = "OPD_STANDIN_PROBE_LOG"
PROBE_IDS = (5, 17, 99, 230, 31, 7)
"""A fixed prompt (ids every test tokenizer has) scored after each update."""
PROBE_TOP_K = 5


class WeightUpdateError(ValueError):
    """A weight update the engine refuses (unknown name, other shape, released memory)."""


class EngineWeights:
    """The served model's parameters and the process groups that update them."""

    def __init__(self, model: torch.nn.Module, state: StandinState, url: str = "") -> None:
        self.model, self.state, self.url = model, state, url
        self.groups: dict[str, dist.ProcessGroup] = {}

    def join(
        self, master_address: str, master_port: int, rank: int, world_size: int,
        group_name: str, backend: str,
    ) -> None:  # fmt: skip
        init = f"tcp://{master_address}:{master_port}"
        store, rank, world_size = next(rendezvous(init, rank, world_size, timeout=GROUP_TIMEOUT))
        store.set_timeout(GROUP_TIMEOUT)
        group, _ = _new_process_group_helper(
            world_size, rank, [], dist.Backend(backend), PrefixStore(group_name, store),
            group_name=GroupName(group_name), timeout=GROUP_TIMEOUT,
        )  # fmt: skip
        dist.distributed_c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        self.groups[group_name] = group

    def destroy(self, group_name: str) -> None:
        if group_name not in self.groups:
            raise WeightUpdateError("The group to be destroyed does not exist.")
        dist.destroy_process_group(self.groups.pop(group_name))

    def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
        load_format: str | None,
    ) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
        """The tensors rank 0 broadcasts for this request (blocking: run off the loop)."""
        if group_name not in self.groups:
            raise WeightUpdateError(
                f"Group {group_name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
        group = self.groups[group_name]
        if load_format == "flattened_bucket":
            bucket = _empty_bucket(names, dtypes, shapes)
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            return bucket.reconstruct_tensors()
        received = _empty_tensors(names, dtypes, shapes)
        for handle in [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in received]:
            handle.wait()
        return received

    def load(self, named_tensors: list[tuple[str, torch.Tensor]], version: str | None) -> None:
        """Copy every tensor into the parameter of its HF name, all or nothing."""
        if "weights" in self.state.released:
            raise WeightUpdateError("weights are released: /resume_memory_occupation first")
        params = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for name, tensor in named_tensors:
            if name not in params:
                raise WeightUpdateError(f"the model has no parameter {name!r}")
            if tuple(params[name].shape) != tuple(tensor.shape):
                raise WeightUpdateError(
                    f"{name}: shape {tuple(tensor.shape)} sent, the model's is "
                    f"{tuple(params[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
        if version is not None:
            self.state.weight_version = version
        if os.environ.get(PROBE_LOG_ENV):
            self._probe(Path(os.environ[PROBE_LOG_ENV]))

    def _probe(self, log: Path) -> None:
        line = {"url": self.url, "pid": os.getpid(), "weight_version": self.state.weight_version}
        with log.open("a") as out:
            out.write(json.dumps(line | top_logprobs(self.model)) + "\n")


def top_logprobs(model: Any, ids: Sequence[int] = PROBE_IDS) -> dict[str, list[list[Any]]]:
    """The PROBE_TOP_K largest next-token log-probs of `model` at every position of `ids`:
    {"values": [[float]], "indices": [[int]]}, one row per position."""
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0].float()
    top = torch.log_softmax(logits, dim=-1).topk(PROBE_TOP_K)
    return {"values": top.values.tolist(), "indices": top.indices.tolist()}


def decode_tensors(
    serialized: list[str], load_format: str | None
) -> list[tuple[str, torch.Tensor]]:
    """/update_weights_from_tensor's tensors for this engine (tp rank 0's entry)."""
    payload = MultiprocessingSerializer.deserialize(serialized[0])
    if load_format == "flattened_bucket":
        bucket = FlattenedTensorBucket(
            flattened_tensor=payload["flattened_tensor"], metadata=payload["metadata"]
        )
        return bucket.reconstruct_tensors()
    return list(payload)


def read_checkpoint(model_path: str) -> list[tuple[str, torch.Tensor]]:
    shards = sorted(Path(model_path).glob("*.safetensors"))
    if not shards:
        raise WeightUpdateError(f"no *.safetensors in {model_path}")
    named: list[tuple[str, torch.Tensor]] = []
    for shard in shards:
        named += load_file(shard).items()
    return named


def _empty_tensors(
    names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, torch.Tensor]]:
    """Receive buffers for the tensors a request announces."""
    return [
        (name, torch.empty(shape, dtype=getattr(torch, dtype)))
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
    ]


def _empty_bucket(
    names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> FlattenedTensorBucket:
    return FlattenedTensorBucket(named_tensors=_empty_tensors(names, dtypes, shapes))


def _answer(success: bool, message: str) -> JSONResponse:
    body = {"success": success, "message": message}
    return JSONResponse(body, status_code=200 if success else 400)


async def _run(action: Any, done: str, *args: Any, then: Any = None) -> JSONResponse:
    """`action(*args)` off the event loop (a collective or a read blocks), then `then` on
    its result in the loop (a model copy never runs beside a forward), as SGLang's reply."""
    try:
        result = await asyncio.to_thread(action, *args)
        if then is not None:
            then(result)
    except (WeightUpdateError, RuntimeError, ValueError, KeyError, OSError) as error:
        logger.error("%s failed: %s", action.__name__, error)
        return _answer(False, f"Failed: {error}")
    return _answer(True, done)


async def _update(
    weights: EngineWeights, body: dict[str, Any], produce: Any, done: str, *args: Any
) -> JSONResponse:
    """An update: the tensors `produce(*args)` gives loaded, then (unless the request says
    not to) the prefix cache flushed, as SGLang does."""
    answer = await _run(
        produce, done, *args, then=lambda named: weights.load(named, body.get("weight_version"))
    )
    if body.get("flush_cache", True):
        weights.state.flush()
    return answer


def add_weight_routes(app: FastAPI, weights: EngineWeights) -> None:
    """The weight-update, memory and version routes (the module docstring lists them)."""
    state = weights.state

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request) -> JSONResponse:
        body = await request.json()
        args = (
            body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
            int(body["world_size"]), body.get("group_name", "weight_update_group"),
            body.get("backend", "nccl"),
        )  # fmt: skip
        return await _run(weights.join, "Succeeded to initialize custom process group.", *args)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request) -> JSONResponse:
        body = await request.json()
        done = "Succeeded to destroy custom process group."
        return await _run(weights.destroy, done, body.get("group_name", "weight_update_group"))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request) -> JSONResponse:
        body = await request.json()
        args = (
            body["names"], body["dtypes"], body["shapes"],
            body.get("group_name", "weight_update_group"), body.get("load_format"),
        )  # fmt: skip
        return await _update(
            weights, body, weights.receive, "Succeeded to update parameter online.", *args
        )

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> JSONResponse:
        body = await request.json()
        args = (body["serialized_named_tensors"], body.get("load_format"))
        return await _update(weights, body, decode_tensors, "Success", *args)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> JSONResponse:
        body = await request.json()
        done = "Succeeded to update model weights."
        return await _update(weights, body, read_checkpoint, done, body["model_path"])

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Any:
        tags = await _memory_tags(request)
        if isinstance(tags, JSONResponse):
            return tags
        state.released |= tags
        return None

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Any:
        tags = await _memory_tags(request)
        if isinstance(tags, JSONResponse):
            return tags
        state.released -= tags
        return None

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": state.weight_version}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request) -> Any:
        body = await request.json()
        params = dict(weights.model.named_parameters())
        if body["name"] not in params:
            return JSONResponse({"error": {"message": "Get parameter by name failed"}}, 400)
        flat = params[body["name"]].detach().float().flatten()
        return flat[: int(body.get("truncate_size", 100))].tolist()


async def _memory_tags(request: Request) -> set[str] | JSONResponse:
    """The tags of a release/resume request (none: all of them, as SGLang takes it); a 400
    for a tag SGLang does not have."""
    tags = set((await _json_or_empty(request)).get("tags") or GPU_MEMORY_ALL_TYPES)
    unknown = tags - set(GPU_MEMORY_ALL_TYPES)
    if unknown:
        message = f"unknown memory tags {sorted(unknown)}: SGLang's are {GPU_MEMORY_ALL_TYPES}"
        return JSONResponse({"error": {"message": message}}, 400)
    return tags


async def _json_or_empty(request: Request) -> dict[str, Any]:
    body = await request.body()
    return await request.json() if body else {}


def create_engine(model: Any, server_args: ServerArgs) -> FastAPI:
    """The stand-in engine's app for a loaded HF `model`."""
    context_length = server_args.context_length or model.config.max_position_embeddings
    app = create_standin(
        model, context_length, model_path=server_args.model_path,
        max_running_requests=server_args.max_running_requests,
        server_args=dataclasses.asdict(server_args),
    )  # fmt: skip
    weights = EngineWeights(model, app.state.standin, server_args.url())
    add_weight_routes(app, weights)
    return app


def serve(server_args: ServerArgs) -> None:
    """Load the checkpoint and serve it at server_args.host:port until killed."""
    import uvicorn
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # an engine beside trainers on a few cores
    model = AutoModelForCausalLM.from_pretrained(server_args.model_path, dtype=torch.float32)
    app = create_engine(model.eval(), server_args)
    uvicorn.run(app, host=server_args.host, port=server_args.port, log_level="warning")
