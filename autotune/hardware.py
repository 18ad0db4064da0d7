"""What this machine has to probe on: NVIDIA GPUs (through NVML), CPU cores and host RAM.

Asked by the commands before anything runs (which device, how many probes at once, what the
model needs against what is here), so it never imports torch or creates a CUDA context.
Imports nothing of autotune.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _nvml(query: Callable[[Any], Any]) -> Any:
    """`query(pynvml)` inside an NVML session, or None without an NVIDIA driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return query(pynvml)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def nvidia_gpu_count() -> int:
    """GPUs NVML sees (not narrowed by CUDA_VISIBLE_DEVICES); 0 without a driver."""
    return _nvml(lambda nvml: nvml.nvmlDeviceGetCount()) or 0


def has_nvidia_gpu() -> bool:
    return nvidia_gpu_count() > 0


def visible_gpu_ids() -> tuple[int, ...]:
    """The GPU ids this process may use; ids are positions in CUDA_VISIBLE_DEVICES when it is
    set, as CUDA numbers them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return tuple(range(len([x for x in visible.split(",") if x.strip()])))
    return tuple(range(nvidia_gpu_count()))


def gpu_capacity_bytes(index: int = 0) -> int | None:
    """Memory of one GPU per NVML, or None without an NVIDIA GPU."""
    total = _nvml(lambda nvml: nvml.nvmlDeviceGetMemoryInfo(
        nvml.nvmlDeviceGetHandleByIndex(index)).total)
    return int(total) if total else None


def usable_cpu_ids() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask, e.g. a container's share)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def host_memory_bytes() -> int:
    """Total host RAM."""
    import psutil

    return int(psutil.virtual_memory().total)
