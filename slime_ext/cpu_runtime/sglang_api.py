"""The part of SGLang's Python API that slime imports, for a CPU machine where the SGLang
wheel cannot import (it needs a CUDA torch): a TEST AND REHEARSAL AID. `standins` puts
these names into the stand-in `sglang` modules, so slime's own code (its argument parser,
SGLangEngine, its weight senders) runs unchanged against the stand-in engine.

Restated from SGLang 0.5.23, only what slime reaches:
- `ServerArgs` (srt/server_args.py): the fields slime sets or reads and the flags users
  pass most (a subset of SGLang's ~400; `add_cli_args` registers them as SGLang does,
  `--tp-size` with its `--tensor-parallel-size` alias and so on), `url()`.
- `kill_process_tree` (srt/utils): the process and its children.
- `MultiprocessingSerializer` (srt/utils): SGLang pickles CUDA tensors as IPC handles; CPU
  tensors under ForkingPickler's file-descriptor strategy cannot cross unrelated
  processes, so this one pickles them by value (base64 text with output_str, as SGLang).
- `FlattenedTensorBucket` (srt/weight_sync/tensor_bucket.py): named tensors of any dtypes
  as one uint8 buffer and their metadata (`supports_multi_dtypes`).
- `monkey_patch_torch_reductions` (srt/utils/patch_torch.py): SGLang rewrites CUDA IPC
  device ids there; nothing on CPU to rewrite.
- `GPU_MEMORY_TYPE_*` (srt/constants.py): the tags of release/resume_memory_occupation.
- `launch_server` (srt/entrypoints/http_server.py): serves `sglang_http.create_standin`
  with the checkpoint at `model_path` (the stand-in engine; sglang_http says what it
  answers).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import pickle
from dataclasses import dataclass
from typing import Any

import psutil
import torch

GPU_MEMORY_TYPE_KV_CACHE = "kv_cache"
GPU_MEMORY_TYPE_WEIGHTS = "weights"
GPU_MEMORY_TYPE_CUDA_GRAPH = "cuda_graph"
GPU_MEMORY_ALL_TYPES = (
    GPU_MEMORY_TYPE_KV_CACHE,
    GPU_MEMORY_TYPE_WEIGHTS,
    GPU_MEMORY_TYPE_CUDA_GRAPH,
)

SIZE_ALIASES = {
    "tp_size": "--tensor-parallel-size",
    "dp_size": "--data-parallel-size",
    "pp_size": "--pipeline-parallel-size",
    "ep_size": "--expert-parallel-size",
}
"""SGLang's long aliases of the parallel sizes (arg_groups/fields/parallel.py)."""


@dataclass
class ServerArgs:
    """SGLang's server arguments that slime sets (sglang_engine._compute_server_args) or
    reads (`args.sglang_*`), and the ones users pass most; defaults as SGLang 0.5.23."""

    model_path: str = ""
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    context_length: int | None = None
    random_seed: int | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    nccl_port: int | None = None
    api_key: str | None = None
    log_level: str = "info"
    # memory
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = False
    max_running_requests: int | None = None
    chunked_prefill_size: int | None = None
    cuda_graph_max_bs: int | None = None
    # distributed
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    moe_dp_size: int = 1
    enable_dp_attention: bool = False
    # serving
    skip_server_warmup: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_metrics: bool = False
    disable_radix_cache: bool = False
    disaggregation_mode: str = "null"
    disaggregation_bootstrap_port: int = 8998
    load_balance_method: str = "round_robin"
    prefill_round_robin_balance: bool = False
    enable_return_routed_experts: bool = False
    attention_backend: str | None = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Each field as `--field-name` (booleans as store_true), as SGLang registers them."""
        for field in dataclasses.fields(ServerArgs):
            flags = [f"--{field.name.replace('_', '-')}"]
            if field.name in SIZE_ALIASES:
                flags.append(SIZE_ALIASES[field.name])
            if field.type == "bool":
                parser.add_argument(*flags, action="store_true", dest=field.name)
                continue
            kind = {"int": int, "float": float}.get(field.type.split(" ")[0], str)
            parser.add_argument(*flags, type=kind, default=field.default, dest=field.name)

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


def kill_process_tree(parent_pid: int, include_parent: bool = True) -> None:
    """SIGKILL the process's children, then the process (a gone process is not an error)."""
    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return
    victims = parent.children(recursive=True) + ([parent] if include_parent else [])
    for process in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(victims, timeout=10)


class MultiprocessingSerializer:
    """Pickles by value (CPU tensors included); base64 text with `output_str`."""

    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        payload = pickle.dumps(obj)
        return base64.b64encode(payload).decode("ascii") if output_str else payload

    @staticmethod
    def deserialize(data: bytes | str) -> Any:
        payload = base64.b64decode(data) if isinstance(data, str) else data
        return pickle.loads(payload)


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Named tensors as one uint8 buffer plus where each lies in it."""

    supports_multi_dtypes = True

    def __init__(
        self,
        named_tensors: list[tuple[str, torch.Tensor]] | None = None,
        flattened_tensor: torch.Tensor | None = None,
        metadata: list[FlattenedTensorMetadata] | None = None,
    ) -> None:
        if named_tensors is None:
            if flattened_tensor is None or metadata is None:
                raise ValueError("give named_tensors, or flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, metadata
            return
        if not named_tensors:
            raise ValueError("Cannot create empty tensor bucket")
        pieces, self.metadata, start = [], [], 0
        for name, tensor in named_tensors:
            flat = tensor.detach().contiguous().flatten().view(torch.uint8)
            pieces.append(flat)
            end = start + flat.numel()
            self.metadata.append(
                FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, end, flat.numel())
            )
            start = end
        self.flattened_tensor = torch.cat(pieces)

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [
            (
                meta.name,
                self.flattened_tensor[meta.start_idx : meta.end_idx]
                .view(meta.dtype)
                .reshape(meta.shape),
            )
            for meta in self.metadata
        ]


def monkey_patch_torch_reductions() -> None:
    """SGLang maps CUDA IPC device ids here; CPU tensors carry none."""


def launch_server(server_args: ServerArgs) -> None:
    """Serve the stand-in engine for `server_args` until the process is killed."""
    from slime_ext.cpu_runtime.sglang_engine import serve

    serve(server_args)
