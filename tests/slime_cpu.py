"""Test-only: what lets THUDM/slime's own code import and run its data path on a CPU.

slime (installed from ../shared/vendor or a source the user names: `make slime`) imports
modules that cannot exist on a CPU machine: sglang (its wheel fails to import against a
CPU torch), sglang_router (when not installed), torch_memory_saver (a CUDA allocator
hook) and, where `make slime` could not install it, Megatron-LM's `megatron.training`.
`install()` registers IMPORT-ONLY STAND-INS for them (slime_ext/cpu_runtime/standins.py,
which the CPU runtime of a whole job installs too): every attribute is a placeholder that
can be imported, subclassed and assigned to, and raises StandInCalled when called. Nothing
of slime is restated; a test that reaches a placeholder fails loudly, naming it.

slime's accelerator layer picks CUDA/MUSA devices; `cpu_accelerator()` points its
current_device() / device() at the CPU for the duration of a test.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from slime_ext.cpu_runtime.standins import STAND_IN_ROOTS, StandInCalled, install

__all__ = ["STAND_IN_ROOTS", "StandInCalled", "cpu_accelerator", "install", "slime_installed"]

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
"""The slime commit the hooks are tested against (../shared/vendor/slime-624b824a.tar.gz)."""

HOW_TO_INSTALL = (
    "slime is not installed: `make slime` installs it from ../shared/vendor/"
    "slime-624b824a.tar.gz, or from SLIME_SOURCE=<path, .tar.gz or git URL> "
    f"(pinned commit {SLIME_COMMIT[:8]}); then the real-slime tests run"
)


def slime_installed() -> bool:
    return _importable("slime") and _importable("slime.utils.types")


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


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
