"""The probe's device, and its peak memory per phase, measured: the device figure and host RSS.

On NVIDIA the device figure is the larger of the allocator's reserved peak and the NVML
figure for this process (which includes the CUDA context). On a CPU device, "device memory" is
the process's anonymous RSS: tensors on the device live there, while tensors offloaded to the
host are moved into shared memory (see `host_tensor`), which RSS counts but the device figure
does not. A sampling thread keeps the per-phase peaks and enforces a device-memory limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypedDict

from autotune.probe.measure.unit_loops import SHORT_SAMPLE, UnitClock
from autotune.process_tag import read_anon_peak_bytes, read_statm_bytes, sample_interval_s

if TYPE_CHECKING:
    import torch

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def read_anon_rss_bytes() -> int:
    """Resident anonymous memory of this process: a CPU probe's device figure
    (process_tag.read_statm_bytes, the one definition for every probe)."""
    return read_statm_bytes()[1]


def read_rss_hwm_bytes() -> int:
    """The kernel's exact high-water mark of this process's RSS since the last reset."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def read_shmem_rss_bytes() -> int:
    """Resident shared memory of this process (RssShmem): a CPU probe's offloaded tensors."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_rss_hwm() -> None:
    """Reset the RSS high-water mark (Linux >= 4.0); harmless where not permitted."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")


def trim_host_heap() -> None:
    """Return freed heap pages to the OS so one phase's garbage is not the next one's peak."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class NvmlProcessMemory:
    """GPU memory used by this process per NVML; falls back to device used minus a baseline
    when the process is not visible by PID (inside containers)."""

    def __init__(self, physical_index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(physical_index)
        self._baseline_used_bytes = pynvml.nvmlDeviceGetMemoryInfo(self._handle).used
        self._pid = os.getpid()

    def read_bytes(self) -> int:
        nvml = self._nvml
        try:
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if proc.pid == self._pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except nvml.NVMLError:
            pass
        used = nvml.nvmlDeviceGetMemoryInfo(self._handle).used
        return max(0, int(used) - int(self._baseline_used_bytes))


class Meter(Protocol):
    """What the GRPO step (probe/step/) and its rollout engine (engine.py) measure through and
    hold host memory with: the probe's MemoryMeter, or the trace's TracedMeter (trace.py).

    A meter also owns which iterations of a loop that repeats its shapes run: of a loop of
    units (`iterations`: waves, a wave's blocks of decode steps, micro-batches, mini-batches)
    a full probe runs every one, a short probe its first few and its last, timed, its clock
    adding what the others would have taken (unit_loops.py), and in its warm-up step the
    first alone (the update's loops their last too); of any loop (`runs`: a block's decode
    steps too) a probe runs every iteration, but a short probe's warm-up its first and last.
    A trace runs the first and the last of both, and the step puts a result of the same bytes
    in place of each skipped one.
    """

    device: torch.device  # the device the step's tensors live on
    gpu_kernels: bool  # the step uses a GPU's kernels (dtype, AdamW's foreach step)
    runs_kernels: bool  # the step's kernels really run (a trace only allocates their outputs)
    current_phase: str | None
    phase_peak_mem_bytes: dict[str, int]
    phase_allocator_peak_bytes: dict[str, int]
    phase_tensor_peak_bytes: dict[str, int]  # live tensors at most (torch's allocated)
    host_peak_rss_bytes: int
    host_held_peak_bytes: int  # what the process holds in host memory for the step at most
    clock: UnitClock  # the unit loops' times, and what skipped units add to each phase

    def runs(self, iteration: int, count: int) -> bool:
        """Whether iteration `iteration` of a loop of `count` iterations runs."""
        ...

    def iterations(self, unit: str, work: Sequence[float], also: Iterable[int] = (),
                   sample: int = SHORT_SAMPLE, tail: int = 1,
                   middle: bool = True, warm_last: bool = False) -> Iterator[int]:
        """The units to run of a loop of units of `work` (rows or tokens each), in order:
        `also` always among them (a short probe's sample: `sample` units before the last
        `tail`, the first and the rest from the loop's middle or, `middle` False, the next
        ones; unit_loops.short_schedule); `warm_last`: a short probe's warm-up runs the last
        unit too (the update's loops: step/update.py)."""
        ...

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Measure one phase of the step: its peak device memory."""
        ...

    def read_device_bytes(self) -> int:
        """The device memory in use now (what vLLM's start-up check reads)."""
        ...

    def release_cache(self) -> None:
        """`torch.cuda.empty_cache()` on a GPU (vLLM calls it before it measures); nothing
        on a CPU."""
        ...

    def measure_peak_bytes(self, run: Callable[[], None]) -> int:
        """Bytes `run` adds at its peak (vLLM's profile run)."""
        ...

    def to_host(self, tensor: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        """A host copy of `tensor` (offload), counted as host memory; `pinned`: in the
        page-locked memory an offload's transfers use (else plain host memory, which goes
        back to the system when freed)."""
        ...

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor."""
        ...

    def on_host(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is held in host memory."""
        ...


class MemoryMeter:
    """Per-phase peaks of device memory and host RSS, sampled and read from the kernel: the
    probe's Meter."""

    def __init__(self, device: torch.device, device_limit_bytes: int | None = None,
                 on_limit: Callable[[str, int], None] | None = None,
                 interval_s: float | None = None, short: bool = False) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.clock = UnitClock(short, sync=self._synchronize)
        self.gpu_kernels = self.is_cuda  # whose kernels' memory the step has (trace.py: set)
        self.runs_kernels = True
        self.device_limit_bytes = device_limit_bytes
        self.on_limit = on_limit
        self.current_phase: str | None = None
        self.phase_peak_mem_bytes: dict[str, int] = {}
        self.phase_allocator_peak_bytes: dict[str, int] = {}
        self.phase_tensor_peak_bytes: dict[str, int] = {}
        self.host_peak_rss_bytes = 0
        self.host_held_peak_bytes = 0
        self.nvml: NvmlProcessMemory | None = None
        self._interval_s = interval_s or sample_interval_s(self.is_cuda)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, nvml_index: int | None = None) -> None:
        if self.is_cuda and nvml_index is not None:
            try:
                self.nvml = NvmlProcessMemory(nvml_index)
            except Exception:  # no NVML (not NVIDIA, no driver library): allocator figures only
                self.nvml = None
        self._thread = threading.Thread(target=self._sample_loop, name="memory-meter",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def runs(self, iteration: int, count: int) -> bool:
        """Every iteration of every loop runs in a probe, but in a short probe's warm-up step
        (its clock warming): there a loop's first and last (a wave's decode steps: the
        cache grown to the last one's length, a token of zeros in place of each skipped one,
        as a trace does), since its rollout's time and peak are the timed steps'."""
        return not (self.clock.short and self.clock.warming) or iteration in (0, count - 1)

    def iterations(self, unit: str, work: Sequence[float], also: Iterable[int] = (),
                   sample: int = SHORT_SAMPLE, tail: int = 1,
                   middle: bool = True, warm_last: bool = False) -> Iterator[int]:
        """Every unit (a full probe), or the clock's sample of them (a short one)."""
        return self.clock.iterations(self.current_phase or "", unit, work, also, sample, tail,
                                     middle, warm_last)

    def _synchronize(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)

    def measure_peak_bytes(self, run: Callable[[], None]) -> int:
        """Bytes `run` adds at its peak on this device (vLLM's profile run reads it so)."""
        return measure_peak_bytes(self.device, run)

    # -- host memory: where offload puts a tensor, so the device figure leaves it out --------

    def to_host(self, tensor: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        """A host copy: pinned memory beside a GPU (PyTorch's host allocator caches it once
        freed, so `pinned=False` for a copy that is only passing through); shared memory on
        a CPU device (RSS counts it, the device figure, anonymous RSS, does not)."""
        import torch

        if self.is_cuda:
            if not pinned:
                return tensor.to("cpu")
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            return host.copy_(tensor, non_blocking=False)
        return tensor.clone().share_memory_()

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.is_cuda:
            return tensor.to(self.device, non_blocking=True)
        return tensor.clone()

    def on_host(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" if self.is_cuda else tensor.is_shared()

    def read_host_held_bytes(self) -> int:
        """Host memory the step holds now, measured: beside a GPU, the pinned blocks PyTorch's
        caching host allocator owns (each rounded up to a power of two, cached ones included);
        on a CPU device, the shared memory offloaded tensors live in."""
        if self.is_cuda:
            import torch

            stats = getattr(torch.cuda, "host_memory_stats", None)  # torch >= 2.6
            if stats is None:
                return 0
            return int(stats().get("allocated_bytes.current", 0))
        return read_shmem_rss_bytes()

    def read_device_bytes(self) -> int:
        """The device figure now: NVML's process figure on NVIDIA, anonymous RSS on CPU."""
        if self.is_cuda:
            if self.nvml is not None:
                return self.nvml.read_bytes()
            import torch

            return int(torch.cuda.memory_reserved(self.device))
        return read_anon_rss_bytes()

    def release_cache(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.empty_cache()

    def _record(self, phase: str, num_bytes: int) -> None:
        with self._lock:
            if num_bytes > self.phase_peak_mem_bytes.get(phase, 0):
                self.phase_peak_mem_bytes[phase] = num_bytes

    def _sample_loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            phase = self.current_phase
            if phase is None:
                continue
            try:
                num_bytes = self.read_device_bytes()
            except Exception:
                continue
            self._record(phase, num_bytes)
            limit = self.device_limit_bytes
            if not self.is_cuda and limit is not None and num_bytes > limit and self.on_limit:
                self.on_limit(phase, num_bytes)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure one phase: start from a clean cache, keep the peak, whatever happens inside."""
        self._settle()
        if self.is_cuda:
            import torch

            torch.cuda.reset_peak_memory_stats(self.device)
        reset_rss_hwm()
        self.host_held_peak_bytes = max(self.host_held_peak_bytes, self.read_host_held_bytes())
        self.current_phase = name
        self._record(name, self.read_device_bytes())
        yield
        if not self.is_cuda:  # the kernel's peak since the phase began, between samples
            self._record(name, read_anon_peak_bytes())
        elif os.environ.get(SNAPSHOT_ENV):
            write_allocator_snapshot(Path(os.environ[SNAPSHOT_ENV]), name)
        self._settle()
        self._record(name, self.read_device_bytes())
        if self.is_cuda:
            import torch

            reserved = int(torch.cuda.max_memory_reserved(self.device))
            self._record(name, reserved)
            previous = self.phase_allocator_peak_bytes.get(name, 0)
            self.phase_allocator_peak_bytes[name] = max(previous, reserved)
            allocated = int(torch.cuda.max_memory_allocated(self.device))
            self.phase_tensor_peak_bytes[name] = max(
                self.phase_tensor_peak_bytes.get(name, 0), allocated)
        self.host_peak_rss_bytes = max(self.host_peak_rss_bytes, read_rss_hwm_bytes())
        self.host_held_peak_bytes = max(self.host_held_peak_bytes, self.read_host_held_bytes())
        self.current_phase = None

    def _settle(self) -> None:
        if self.is_cuda:
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        else:
            trim_host_heap()


SNAPSHOT_ENV = "AUTOTUNE_ALLOCATOR_SNAPSHOT"  # a folder: each phase's segment map there


def write_allocator_snapshot(folder: Path, phase: str) -> None:
    """The caching allocator's segments at the end of `phase` (before the meter empties the
    cache: what the phase reserved), as compact JSON: each segment's stream, size and
    blocks (bytes and whether allocated; blocks under 1 MiB summed). The first phase of a
    name is `<phase>-1.json`, the next `-2`, so both steps are kept."""
    import json

    import torch

    segments = []
    for segment in torch.cuda.memory._snapshot()["segments"]:
        small = {"allocated": 0, "free": 0}
        blocks = []
        for block in segment["blocks"]:
            used = block["state"] == "active_allocated"
            if block["size"] < 1 << 20:
                small["allocated" if used else "free"] += block["size"]
            else:
                blocks.append([block["size"], used])
        segments.append({"stream": segment["stream"], "size": segment["total_size"],
                         "pool": segment["segment_type"], "blocks": blocks,
                         "small_blocks": small})
    folder.mkdir(parents=True, exist_ok=True)
    index = 1
    while (folder / f"{phase}-{index}.json").exists():
        index += 1
    (folder / f"{phase}-{index}.json").write_text(json.dumps(
        {"phase": phase, "reserved_bytes": int(torch.cuda.memory_reserved()),
         "allocated_bytes": int(torch.cuda.memory_allocated()), "segments": segments}))


def measure_peak_bytes(device: torch.device, run: Callable[[], None]) -> int:
    """Bytes `run` adds at its peak on `device`: the allocator's peak on a GPU (as vLLM's
    profile run reads it), the RSS high-water mark over the RSS before on a CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return max(0, int(torch.cuda.max_memory_allocated(device)) - int(before))
    trim_host_heap()
    before = read_rss_bytes()
    reset_rss_hwm()
    run()
    return max(0, read_rss_hwm_bytes() - before)


def read_rss_bytes() -> int:
    """Resident memory of this process now (what the high-water mark is a peak of)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _PAGE_BYTES


def torch_device(kind: str) -> torch.device:
    """The torch device of a Device's kind (cuda or cpu), checked to be there."""
    import torch

    from autotune.errors import ConfigError

    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible; use --device cpu or auto")
    if kind == "cuda":  # with its index: torch's per-device calls refuse a bare "cuda"
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


class DeviceDescription(TypedDict, total=False):
    """A probe's device in its result: what it is, its memory, the limit in force, and the
    versions that produced the figures (describe_device gives them all; a result of a probe
    that never reached its device, none)."""

    device_name: str
    device_capacity_bytes: int
    device_limit_bytes: int | None
    versions: dict[str, str]


def describe_device(device: torch.device, limit_bytes: int | None) -> DeviceDescription:
    """Device name, capacity, the limit in force, and the versions that produced a figure."""
    import platform

    import torch
    import transformers

    from autotune.version import __version__

    versions = {"autotune": __version__, "torch": torch.__version__,
                "transformers": transformers.__version__, "python": platform.python_version()}
    vllm = sys.modules.get("vllm")  # imported only by the real engine (rollout_engine=vllm)
    if vllm is not None:
        versions["vllm"] = str(getattr(vllm, "__version__", "?"))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        versions["cuda"] = str(torch.version.cuda)
        return {"device_name": props.name, "device_capacity_bytes": int(props.total_memory),
                "device_limit_bytes": limit_bytes, "versions": versions}
    import psutil

    name = platform.processor() or "cpu"
    with open("/proc/cpuinfo") as handle:
        for line in handle:
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    return {"device_name": f"cpu: {name} ({os.cpu_count()} cores)",
            "device_capacity_bytes": int(psutil.virtual_memory().total),
            "device_limit_bytes": limit_bytes, "versions": versions}


def physical_gpu_index(device: object) -> int | None:
    """The NVML index of the GPU this process was pinned to (first of CUDA_VISIBLE_DEVICES)."""
    if getattr(device, "type", "") != "cuda":
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0
