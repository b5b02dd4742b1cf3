"""Where megatron-core, Megatron-LM and slime hard-code CUDA, each site pointed at the CPU:
a test and rehearsal aid (REFERENCE.md, "Megatron-core and slime on CPU").

A site is a module whose own `torch` (or `numpy`) name is replaced by a view: `torch`
whose CUDA allocations land on the CPU, whose `torch.cuda` reports the CPU as its current
device and has no-op streams, and whose `pin_memory=True` allocations are plain ones (no
pinned-memory allocator exists without an accelerator). Nothing else of those modules
changes. `apply(module)` redirects one module; `sites` names every site and why, and the
few other hooks here (slime's defaults, the distributed optimizer's load, slime's
process-group wrapper) each say what they change.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import ModuleType
from typing import Any

import torch

from slime_ext.cpu_runtime.sites import (
    DEFAULTS_SITE,
    MEGATRON_CORE_SITES,
    NUMPY_SITE,
    OPTIMIZER_LOAD_SITE,
    PROCESS_SITES,
    RELOADABLE_GROUP_SITE,
)

__all__ = [
    "DEFAULTS_SITE",
    "MEGATRON_CORE_SITES",
    "NUMPY_SITE",
    "OPTIMIZER_LOAD_SITE",
    "PROCESS_SITES",
    "RELOADABLE_GROUP_SITE",
]

CPU = torch.device("cpu")
SLIME_IMAGE_NUMPY = "1.26.4"
"""The numpy slime's image pins (NUMPY_SITE)."""


def _cpu_device(device: Any) -> Any:
    """A CUDA placement (a 'cuda' string, an index, a cuda device) becomes the CPU."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return CPU
    return device


class _NoStream:
    """torch.cuda.Stream on the CPU: work is synchronous, waits are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_stream(self, stream: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None


class _CudaOnCpu(ModuleType):
    """`torch.cuda` as a redirected module sees it: its current device is the CPU, its
    streams are no-ops, its RNG state is the CPU generator's."""

    Stream = _NoStream

    def __init__(self) -> None:
        super().__init__("torch.cuda (CPU redirect)")

    def current_device(self) -> torch.device:
        return CPU

    def current_stream(self, device: Any = None) -> _NoStream:
        return _NoStream()

    def default_stream(self, device: Any = None) -> _NoStream:
        return _NoStream()

    def stream(self, stream: Any) -> Any:
        return nullcontext()

    def synchronize(self, device: Any = None) -> None:
        return None

    def get_device_properties(self, device: Any = None) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(name="cpu", major=0, minor=0, multi_processor_count=0)

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()  # the CPU generator is the only one

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _TorchOnCpu(ModuleType):
    """`torch` as a redirected module sees it: CUDA allocations land on the CPU, pinned
    allocations are plain."""

    def __init__(self) -> None:
        super().__init__("torch (CPU redirect)")
        self.cuda = _CudaOnCpu()
        for name in ("tensor", "zeros", "empty", "empty_like", "zeros_like", "ones", "full"):
            setattr(self, name, _on_cpu(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _on_cpu(factory: Any) -> Any:
    def allocate(*args: Any, device: Any = None, pin_memory: bool = False, **kwargs: Any) -> Any:
        return factory(*args, device=_cpu_device(device), **kwargs)

    return allocate


class _NumpyAsPinned(ModuleType):
    """numpy with the version slime's image pins (NUMPY_SITE says why)."""

    __version__ = SLIME_IMAGE_NUMPY

    def __init__(self) -> None:
        super().__init__("numpy (slime image version)")

    def __getattr__(self, name: str) -> Any:
        import numpy

        return getattr(numpy, name)


TORCH_ON_CPU = _TorchOnCpu()


def apply(module: ModuleType) -> None:
    """Redirect one site (a module named in MEGATRON_CORE_SITES, PROCESS_SITES or NUMPY_SITE)."""
    if module.__name__ == NUMPY_SITE[0]:
        module.np = _NumpyAsPinned()  # type: ignore[attr-defined]
        return
    module.torch = TORCH_ON_CPU  # type: ignore[attr-defined]


def cpu_defaults(module: ModuleType) -> None:
    """The DEFAULTS_SITE: slime's default Megatron arguments, then bf16 and the fully
    parallel load off (under both of the function's names)."""
    original = module._set_default_megatron_args

    def set_default_megatron_args(args: Any) -> Any:
        args = original(args)
        args.bf16 = False
        args.ckpt_fully_parallel_load = False
        return args

    module._set_default_megatron_args = set_default_megatron_args  # type: ignore[attr-defined]
    module.set_default_megatron_args = set_default_megatron_args  # type: ignore[attr-defined]


def states_before_load(module: ModuleType) -> None:
    """The OPTIMIZER_LOAD_SITE: DistributedOptimizer.sharded_state_dict(is_loading=True) on
    an optimizer without states initializes them first; the loaded main parameters and
    states are set under no_grad; each parameter's step is the checkpoint's, its own
    tensor."""
    import inspect

    optimizer_class = module.DistributedOptimizer
    original = optimizer_class.sharded_state_dict
    signature = inspect.signature(original)

    def sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        is_loading = signature.bind(self, *args, **kwargs).arguments.get("is_loading", False)
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original(self, *args, **kwargs)

    optimizer_class.sharded_state_dict = sharded_state_dict
    set_states = optimizer_class._set_main_param_and_optimizer_states
    optimizer_class._set_main_param_and_optimizer_states = torch.no_grad()(set_states)
    load_state_dict = optimizer_class.load_state_dict

    def load_with_own_steps(self: Any, state_dict: Any) -> Any:
        result = load_state_dict(self, state_dict)
        steps = {group.get("step") for group in state_dict["optimizer"]["param_groups"]}
        if len(steps) == 1 and None not in steps:
            [step] = steps
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(float(step))
        return result

    optimizer_class.load_state_dict = load_with_own_steps


TORCH_213_COLLECTIVES = (
    "all_gather_single",
    "all_gather_single_coalesced",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "all_to_all_single",
)


def forward_new_collectives(module: ModuleType) -> None:
    """The RELOADABLE_GROUP_SITE: each of TORCH_213_COLLECTIVES that this torch has and the
    wrapper does not define, forwarded to the wrapped group as the wrapper forwards its own."""
    wrapper = module.ReloadableProcessGroup
    for name in TORCH_213_COLLECTIVES:
        if hasattr(torch.distributed.ProcessGroup, name) and name not in vars(wrapper):
            setattr(wrapper, name, _forwarding(name))


def _forwarding(name: str) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self._fwd(name, *args, **kwargs)

    return forward


def type_names_cuda(original: Any) -> Any:
    """Tensor.type() naming a CPU tensor as its CUDA twin ('torch.cuda.FloatTensor'): the
    distributed optimizer accepts only CUDA type names (distrib_optimizer.py:361,420,582)."""

    def tensor_type(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = original(self, dtype, *args, **kwargs)
        if dtype is None and self.device.type == "cpu" and isinstance(result, str):
            return result.replace("torch.", "torch.cuda.", 1)
        return result

    return tensor_type


def module_cuda_on_cpu(original: Any) -> Any:
    """nn.Module.cuda(device) with a CPU device keeps the module where it is: get_model calls
    `model_module.cuda(torch.cuda.current_device())` (training.py:1259), which the
    redirected torch.cuda answers with the CPU."""

    def cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
        if isinstance(device, torch.device) and device.type == "cpu":
            return self
        return original(self, device)

    return cuda


def gated_norm_in_torch(module: ModuleType) -> None:
    """flash-linear-attention's FusedRMSNormGated (a Triton kernel; slime's Gated DeltaNet
    gating norm) in torch: transformers' Qwen3_5RMSNormGated computes the same (RMS norm,
    weight, then times silu(gate)), for the silu gate without residual that slime uses."""
    from types import SimpleNamespace

    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    def forward(
        self: Any, x: Any, g: Any, residual: Any = None, prenorm: bool = False, **kw: Any
    ) -> Any:
        if residual is not None or prenorm or self.activation not in ("swish", "silu"):
            raise NotImplementedError(
                "FusedRMSNormGated on the CPU: the silu gate without residual only "
                f"(activation {self.activation!r}, residual {residual is not None})"
            )
        norm = SimpleNamespace(weight=self.weight, variance_epsilon=self.eps, activation="silu")
        return Qwen3_5RMSNormGated.forward(norm, x, g)  # type: ignore[arg-type]

    module.FusedRMSNormGated.forward = forward
