"""slime's accelerator contract (slime/utils/accelerator/base.py) on the CPU: a test and
rehearsal aid, registered by `slime_ext.cpu_runtime.install` in each of slime's processes.

Without it slime's registry raises "No usable accelerator" in every train actor (the
registry knows CUDA and MUSA only). Collectives and weight updates go over gloo; memory
figures are the host's, from psutil (free / total) and this process's resident set.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import psutil
import torch
from slime.utils.accelerator.base import Accelerator

CPU = torch.device("cpu")


class CPUAccelerator(Accelerator):
    """One CPU 'device' per process: no streams, no pinned memory, gloo everywhere."""

    name = "cpu"
    device_type = "cpu"
    communication_backend_name = "gloo"

    def is_available(self) -> bool:
        return True

    def device(self, index: int | str | torch.device | None = None) -> torch.device:
        return CPU

    def device_name(self, index: int | str | torch.device | None = None) -> str:
        return "cpu"

    def set_device(self, index: int | str | torch.device) -> None:
        return None

    def current_device(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        return 1

    def synchronize(self, device: int | str | torch.device | None = None) -> None:
        return None

    def current_stream(self, device: int | str | torch.device | None = None) -> Any:
        return None

    def stream(self, stream: Any) -> Any:
        return nullcontext()

    def empty_cache(self) -> None:
        return None

    def mem_get_info(self, device: int | str | torch.device | None = None) -> tuple[int, int]:
        memory = psutil.virtual_memory()
        return int(memory.available), int(memory.total)

    def memory_allocated(self, device: int | str | torch.device | None = None) -> int:
        return int(psutil.Process().memory_info().rss)

    def memory_reserved(self, device: int | str | torch.device | None = None) -> int:
        return int(psutil.Process().memory_info().rss)

    def distributed_device_id(self, index: int | str | torch.device | None = None) -> None:
        return None  # gloo takes no device id

    def communication_backend(self, default: str = "nccl") -> str:
        return "gloo"

    def weight_update_backend(self, default: str = "nccl") -> str:
        return "gloo"


def register() -> None:
    """Add the CPU backend to slime's registry, below CUDA and MUSA: a machine with a GPU
    keeps choosing it."""
    from slime.utils import accelerator

    accelerator.register_accelerator("cpu", CPUAccelerator, lambda: True, priority=-100)
