"""What this machine has to probe on: NVIDIA GPUs (through NVML), CPU cores and host RAM.

Asked by the commands before anything runs (which device, how many probes at once, what the
model needs against what is here), so it never imports torch or creates a CUDA context. Owns
the Device a probe runs on and the one rule of how much of its memory a probe may use.
Imports nothing of autotune.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
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


def gpu_name(index: int = 0) -> str | None:
    """The NVIDIA GPU's name (e.g. 'NVIDIA H200'), or None without one."""
    name = _nvml(lambda nvml: nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index)))
    return name.decode() if isinstance(name, bytes) else name


def usable_cpu_ids() -> tuple[int, ...]:
    """The cores this process may run on (its affinity mask, e.g. a container's share)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def host_memory_bytes() -> int:
    """Total host RAM."""
    import psutil

    return int(psutil.virtual_memory().total)


DEVICE_KINDS = ("cuda", "cpu")  # what a probe runs on (a CPU is the device of the CPU demo)
DEVICE_CHOICES = ("auto", *DEVICE_KINDS)  # --device; auto: cuda where an NVIDIA GPU is seen
# what --device cuda gets where no GPU is, wherever it is found out
NO_GPU_HERE = ("--device cuda: no NVIDIA GPU is visible on this machine; use --device cpu, or "
               "run where a GPU is")


def device_kind(name: str, gpu_here: bool | None = None) -> str:
    """--device resolved: auto is cuda where an NVIDIA GPU is (`gpu_here`, else this
    machine's), cpu otherwise."""
    if name != "auto":
        return name
    return "cuda" if (has_nvidia_gpu() if gpu_here is None else gpu_here) else "cpu"


def usable_bytes(capacity_bytes: int | None, limit_bytes: int | None = None,
                 reserve_bytes: int = 0) -> int | None:
    """The memory a probe may use on a device: the cap in force (`memory_cap_bytes`), else
    the device's capacity; None when neither is known. The one rule every capacity figure of
    autotune comes from."""
    cap = memory_cap_bytes(capacity_bytes, limit_bytes, reserve_bytes)
    return cap if cap is not None else capacity_bytes


def memory_cap_bytes(capacity_bytes: int | None, limit_bytes: int | None = None,
                     reserve_bytes: int = 0) -> int | None:
    """The cap a probe runs under: --gpu-memory-limit, and the device less
    --reserve-gpu-memory, whichever is lower; None when neither is set (the reserve needs the
    capacity)."""
    caps = [limit_bytes] if limit_bytes is not None else []
    if reserve_bytes and capacity_bytes is not None:
        caps.append(capacity_bytes - reserve_bytes)
    return min(caps) if caps else None


@dataclass(frozen=True)
class Device:
    """The device probes run on and how much of its memory one probe may use.

    Resolved once, by the command's plan, and carried in every ProbeRequest: `kind` is cuda
    or cpu (never auto); `capacity_bytes` is one GPU's memory, or the host's RAM when the
    CPU is the device, None where the probes run elsewhere (a Ray cluster: each probe
    reports its own); `limit_bytes` and `reserve_bytes` are --gpu-memory-limit and
    --reserve-gpu-memory.
    """

    kind: str = "cpu"
    capacity_bytes: int | None = None
    limit_bytes: int | None = None
    reserve_bytes: int = 0

    @property
    def on_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def cap_bytes(self) -> int | None:
        """The cap in force, None without a limit or reserve (memory_cap_bytes)."""
        return memory_cap_bytes(self.capacity_bytes, self.limit_bytes, self.reserve_bytes)

    @property
    def usable_bytes(self) -> int | None:
        """The memory a probe may use (usable_bytes)."""
        return usable_bytes(self.capacity_bytes, self.limit_bytes, self.reserve_bytes)

    def with_capacity(self, capacity_bytes: int | None) -> Device:
        """The same device with its capacity as measured (a probe reports it); unchanged
        when `capacity_bytes` is None."""
        if capacity_bytes is None or capacity_bytes == self.capacity_bytes:
            return self
        return dataclasses.replace(self, capacity_bytes=int(capacity_bytes))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def this_device(kind: str, limit_bytes: int | None = None, reserve_bytes: int = 0) -> Device:
    """A device of this machine with its capacity: the first GPU's memory, or the host's RAM."""
    capacity = gpu_capacity_bytes() if kind == "cuda" else host_memory_bytes()
    return Device(kind, capacity, limit_bytes, reserve_bytes)
