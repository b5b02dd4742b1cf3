"""A CPU runtime for slime's processes: a TEST AND REHEARSAL AID, not a way to train.

slime's train.py runs its trainers as Ray actors (and its converters under torchrun) in
processes of their own, so an in-process patch cannot reach them. `install()` is called at
interpreter start by `site/sitecustomize.py` when OPD_CPU_RUNTIME=1 (put `site/` on the
PYTHONPATH of Ray's runtime_env or of torchrun: `runtime_env_vars()`), and registers
post-import hooks, so a process that never imports slime or Megatron pays nothing:

- import-only stand-ins for what cannot be installed here (sglang, torch_memory_saver:
  `standins`);
- slime.utils.accelerator: the CPU backend of slime's accelerator registry
  (`accelerator.CPUAccelerator`; gloo for collectives and weight updates);
- every CUDA site of megatron-core, Megatron-LM and slime a whole job reaches, pointed at
  the CPU (`sites.MEGATRON_CORE_SITES`, `sites.PROCESS_SITES`), plus
  nn.Module.cuda(cpu) and Tensor.type()'s CUDA names (the distributed optimizer's check);
- slime's numpy-1 assert (`sites.NUMPY_SITE` says why);
- fp32 parameters where slime forces bf16, and each rank loading its own checkpoint
  shards (`sites.DEFAULTS_SITE` says why);
- a fresh distributed optimizer that can take a checkpoint under torch's Adam
  (`sites.OPTIMIZER_LOAD_SITE`);
- slime's process-group wrapper forwarding torch 2.13's collectives
  (`sites.RELOADABLE_GROUP_SITE`);
- flash-linear-attention's gating norm (a Triton kernel in slime's hybrid layers) in
  torch (`redirects.gated_norm_in_torch`); their mixing runs slime_ext.gated_delta's
  torch reference on the CPU already;
- megatron-core's own Gated DeltaNet loaded without flash-linear-attention (`HIDDEN`),
  which nothing here uses, and which cost about a fifth of a Megatron process's imports;
- megatron-core's fused functions and slime's PPO losses eager, not compiled at import
  (`EAGER`): TorchDynamo and Inductor are not loaded with them.
The hooks themselves are in `redirects`, imported only when a site loads.

What slime and Megatron-LM offer as settings is used instead of a redirect where one
exists (`SLIME_FLAGS`): Megatron's inference RNG tracker (no CUDA RNG state), no
train offload (torch_memory_saver is a CUDA allocator hook), the local transformer
implementation with the layer spec of `slime_ext.cpu_runtime.spec`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ENV_FLAG = "OPD_CPU_RUNTIME"
SITE_DIR = Path(__file__).resolve().parent / "site"
"""The folder holding sitecustomize.py: on PYTHONPATH, it installs this runtime."""

MEGATRON_FLAGS = (
    "--inference-rng-tracker",
    # that tracker keeps no states, and Megatron-LM refuses a checkpoint without tracker
    # states unless told not to load RNG (checkpointing.py:1868); nothing here draws from it
    "--no-load-rng",
    "--transformer-impl", "local",
    "--distributed-backend", "gloo",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
)  # fmt: skip
"""Megatron-LM settings a CPU process takes in place of redirects: Megatron's inference
RNG tracker (forks are no-ops; no CUDA RNG state), fused kernels off (CUDA-only); slime's
converters take these."""
SLIME_FLAGS = (*MEGATRON_FLAGS, "--no-offload-train")
"""What slime's train.py takes on top: no train offload (torch_memory_saver)."""


def runtime_env_vars(pythonpath: str | None = None) -> dict[str, str]:
    """The environment that installs this runtime in every process started with it (Ray's
    runtime_env env_vars, torchrun's environment)."""
    paths = [str(SITE_DIR), str(Path(__file__).resolve().parents[2])]
    if pythonpath:
        paths.append(pythonpath)
    # slime's own run scripts set it: Megatron's TP / CP overlap assumes one CUDA queue
    return {
        ENV_FLAG: "1",
        "PYTHONPATH": os.pathsep.join(paths),
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }


HIDDEN = {"megatron.core.ssm.gated_delta_net": "fla"}
"""A package hidden while a module executes (its import fails there, as where it is not
installed): megatron-core's Gated DeltaNet imports flash-linear-attention, about a
fifth of a Megatron process's imports here (fla's Triton kernels pull transformers'
Qwen3.5 model and scipy), for kernels nothing on the CPU reaches through it: slime's
hybrid layers import fla themselves and mix with slime_ext.gated_delta. That module
records HAVE_FLA False; a process that imported fla before keeps it
(bench/cpu_runtime_start.py measures the start)."""


EAGER = ("slime.utils.ppo_utils",)
"""Modules executed with torch.compile as the identity. megatron-core's fused functions
are compiled at import through megatron.core.jit's jit_fuser, slime's PPO losses by
their own decorators: torch.compile loads TorchDynamo and Inductor (1.5 s of a Megatron
process's 9.3 s of imports here, bench/cpu_runtime_start.py), and on the CPU a compiled
function would be built by Inductor's C++ backend at its first call. Eager, they compute
the same; the fused functions through Megatron's own switch (`_eager_fusions`). They
load only where torch's optimizer first steps (its step imports TorchDynamo, which
imports part of Inductor): a trainer still loads them, the driver, rollout manager,
engines and converters do not."""


def _eager_compile(function: Any = None, **_: Any) -> Any:
    """torch.compile, leaving the function as it is (as a decorator with or without
    arguments)."""
    return function if function is not None else (lambda later: later)


def _eager_fusions(module: ModuleType) -> None:
    """megatron.core.jit just executed: its jit_fuser is torch.compile. Megatron's own
    disable_jit_fuser (what Megatron-LM's --disable-jit-fuser calls, but only after every
    fused function has been compiled) makes it the identity for each module that imports it
    later, which is all of them."""
    module.disable_jit_fuser()


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a hook right after one of the named modules has executed; hides a package
    while one of `hidden` executes; runs each of `eager` with torch.compile the identity."""

    def __init__(
        self,
        hooks: dict[str, Callable[[ModuleType], None]],
        hidden: dict[str, str],
        eager: tuple[str, ...],
    ) -> None:
        self.hooks, self.hidden, self.eager = hooks, hidden, eager

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if (
            fullname not in self.hooks
            and fullname not in self.hidden
            and fullname not in self.eager
        ):
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _HookedLoader(
                    spec.loader,
                    self.hooks.get(fullname),
                    self.hidden.get(fullname),
                    fullname in self.eager,
                )
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(
        self,
        loader: Any,
        hook: Callable[[ModuleType], None] | None,
        hidden: str | None,
        eager: bool,
    ) -> None:
        self.loader, self.hook, self.hidden, self.eager = loader, hook, hidden, eager

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # None in sys.modules fails the package's import; one already imported is kept
        hidden = self.hidden if self.hidden not in sys.modules else None
        if hidden is not None:
            sys.modules[hidden] = None  # type: ignore[assignment]
        if self.eager:  # it imports torch itself
            import torch

            compile_ = torch.compile
            torch.compile = _eager_compile  # type: ignore[assignment]
        try:
            self.loader.exec_module(module)
        finally:
            if hidden is not None:
                sys.modules.pop(hidden, None)
            if self.eager:
                torch.compile = compile_
        if self.hook is not None:
            self.hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _later(name: str) -> Callable[[ModuleType], None]:
    """redirects.<name>, imported when a site loads (redirects imports torch; sitecustomize
    runs in every Python process Ray starts, most of which never load a site)."""

    def hook(module: ModuleType) -> None:
        from slime_ext.cpu_runtime import redirects

        getattr(redirects, name)(module)

    return hook


def _register_accelerator(module: ModuleType) -> None:
    from slime_ext.cpu_runtime.accelerator import register

    register()


def _patch_torch(module: ModuleType) -> None:
    import torch

    from slime_ext.cpu_runtime import redirects

    torch.Tensor.type = redirects.type_names_cuda(torch.Tensor.type)  # type: ignore[method-assign]
    torch.nn.Module.cuda = redirects.module_cuda_on_cpu(torch.nn.Module.cuda)  # type: ignore[method-assign]


def install() -> None:
    """Register the hooks in this process (once); modules already imported are redirected
    now."""
    if any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        return
    from slime_ext.cpu_runtime import sites, standins

    standins.install()
    redirected = [*sites.MEGATRON_CORE_SITES, *sites.PROCESS_SITES, sites.NUMPY_SITE[0]]
    hooks: dict[str, Callable[[ModuleType], None]] = dict.fromkeys(redirected, _later("apply"))
    hooks["slime.utils.accelerator"] = _register_accelerator
    hooks[sites.DEFAULTS_SITE[0]] = _later("cpu_defaults")
    hooks[sites.OPTIMIZER_LOAD_SITE[0]] = _later("states_before_load")
    hooks[sites.RELOADABLE_GROUP_SITE[0]] = _later("forward_new_collectives")
    hooks["megatron.core"] = _patch_torch
    hooks["megatron.core.jit"] = _eager_fusions
    hooks["fla.modules.norm.fused_norm_gate"] = _later("gated_norm_in_torch")
    for name, hook in hooks.items():
        if name in sys.modules:
            hook(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(hooks, HIDDEN, EAGER))
