"""Import-only stand-ins for what slime imports and a CPU machine cannot have: a test and
rehearsal aid (slime_ext.cpu_runtime installs them in each of slime's processes).

sglang (its wheel fails to import against a CPU torch), sglang_router (when not
installed), torch_memory_saver (a CUDA allocator hook) and, where Megatron-LM's training
package is absent, `megatron.training`. Every attribute is a placeholder that can be
imported, subclassed and assigned to, and raises StandInCalled when called, so a run that
reaches one fails loudly, naming it; except the part of SGLang's API that slime's engine
and weight senders use, which `sglang_api` restates (`SGLANG_API` lists where each name
goes).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

STAND_IN_ROOTS = ("sglang", "sglang_router", "torch_memory_saver", "megatron.training")
"""Packages that get import-only stand-ins when the real one cannot be imported."""
SGLANG_API = {
    "sglang.srt.server_args": ("ServerArgs",),
    "sglang.srt.utils": ("kill_process_tree", "MultiprocessingSerializer"),
    "sglang.srt.utils.patch_torch": ("monkey_patch_torch_reductions",),
    "sglang.srt.weight_sync.tensor_bucket": ("FlattenedTensorBucket", "FlattenedTensorMetadata"),
    "sglang.srt.entrypoints.http_server": ("launch_server",),
    "sglang.srt.constants": (
        "GPU_MEMORY_TYPE_KV_CACHE",
        "GPU_MEMORY_TYPE_WEIGHTS",
        "GPU_MEMORY_TYPE_CUDA_GRAPH",
        "GPU_MEMORY_ALL_TYPES",
    ),
}
"""The stand-in sglang modules that carry sglang_api's restated names."""


class StandInCalled(RuntimeError):
    """A test reached code of a CPU import stand-in (sglang, Megatron-LM, ...)."""


class _Placeholder:
    """Any attribute of a stand-in module: importable, subclassable, settable, not callable."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        child = _Placeholder(f"{self._name}.{attr}")
        object.__setattr__(self, attr, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise StandInCalled(f"{self._name} is a CPU import stand-in (cpu_runtime/standins.py)")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(stand_in.Base)` imports; X behaves as a plain class

    def __repr__(self) -> str:
        return f"<CPU stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        value = _Placeholder(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds stand-in modules for the roots that the real import path cannot provide."""

    def __init__(self, roots: Sequence[str]) -> None:
        self.roots = tuple(roots)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        names = SGLANG_API.get(module.__name__, ())
        if names:
            from slime_ext.cpu_runtime import sglang_api

            for name in names:
                setattr(module, name, getattr(sglang_api, name))


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install() -> list[str]:
    """Register stand-ins for the roots that cannot be imported here; returns them."""
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        finder = next(f for f in sys.meta_path if isinstance(f, _StandInFinder))
        return list(finder.roots)
    missing = [root for root in STAND_IN_ROOTS if not _real_root(root)]
    sys.meta_path.append(_StandInFinder(missing))
    return missing


def _real_root(root: str) -> bool:
    if root == "sglang":  # the real wheel imports only against a CUDA torch
        try:
            importlib.import_module("sglang.srt.server_args")
        except Exception:
            return False
        return True
    return _importable(root)
