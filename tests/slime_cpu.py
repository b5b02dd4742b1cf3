"""Test-only: what lets THUDM/slime's own code import and run its data path on a CPU.

slime (installed from ../shared/vendor or a source the user names: `make slime`) imports
modules that cannot exist on a CPU machine: sglang (its wheel fails to import against a
CPU torch), sglang_router (when not installed), torch_memory_saver (a CUDA allocator
hook) and Megatron-LM's `megatron.training` (not in the megatron-core wheel). `install()`
registers IMPORT-ONLY STAND-INS for them: every attribute is a placeholder that can be
imported, subclassed and assigned to, and raises StandInCalled when called. Nothing of
slime is restated here; a test that reaches a placeholder fails loudly, naming it.

slime's accelerator layer picks CUDA/MUSA devices; `cpu_accelerator()` points its
current_device() / device() at the CPU for the duration of a test.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
"""The slime commit the hooks are tested against (../shared/vendor/slime-624b824a.tar.gz)."""

STAND_IN_ROOTS = ("sglang", "sglang_router", "torch_memory_saver", "megatron.training")
"""Packages that get import-only stand-ins when the real one cannot be imported."""

HOW_TO_INSTALL = (
    "slime is not installed: `make slime` installs it from ../shared/vendor/"
    "slime-624b824a.tar.gz, or from SLIME_SOURCE=<path, .tar.gz or git URL> "
    f"(pinned commit {SLIME_COMMIT[:8]}); then the real-slime tests run"
)


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
        raise StandInCalled(f"{self._name} is a CPU import stand-in (tests/slime_cpu.py)")

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
        return None


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


def slime_installed() -> bool:
    return _importable("slime") and _importable("slime.utils.types")


@contextmanager
def cpu_accelerator() -> Iterator[None]:
    """slime.utils.accelerator's current_device() / device() on the CPU."""
    from slime.utils import accelerator

    cpu = torch.device("cpu")
    saved = {name: getattr(accelerator, name) for name in ("current_device", "device")}
    accelerator.current_device = lambda *args, **kwargs: cpu  # type: ignore[attr-defined]
    accelerator.device = lambda *args, **kwargs: cpu  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(accelerator, name, value)
