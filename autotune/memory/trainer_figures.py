"""The memory figures a trainer logs of its own run, predicted: what its users read.

A trainer reports memory under its own definitions, which are neither NVML's peak nor the
node's total, so a prediction is only comparable when it is taken the same way. EasyR1
(verl/workers/fsdp_workers.py of EasyR1, update_actor; unchanged from v0.3.0 to 2026) logs,
on every actor rank right after the update and before it offloads again, averaged over the
ranks (verl/trainer/metrics.py reduce_metrics: np.mean), in GiB:

- `perf/max_memory_reserved_gb`: torch.cuda.max_memory_reserved() since the process
  started, less `freed_bytes`, what the engine's last sleep gave back to CUDA
  (sharding_manager/fsdp_vllm.py: mem_get_info before and after sleep(level=1)). vLLM
  allocates its weights and KV cache through torch's allocator (a CuMemAllocator pool), so
  torch's reserved peak counts the engine's pool even asleep, and the subtraction leaves
  the trainer's own reserve: its largest phase, the pool left out. Its baselines' "Peak
  VRAM" column.
- `perf/cpu_memory_used_gb`: psutil.virtual_memory().used of the node (total less free,
  page cache, reclaimable slab and buffers: every process, pinned memory included, Ray's
  object store in /dev/shm not), read at the end of the update. Its baselines' "Peak Mem".

Pure arithmetic over a MemoryEstimate (model.py) and a NodeHost (host.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.memory.host import NodeHost
from autotune.memory.model import MemoryEstimate

ENGINE_POOL_PARTS = ("engine_reservation",)  # the engine's pool in a phase's parts
SHARED_MEMORY_PARTS = ("ray_object_store_batch",)  # /dev/shm: psutil's "used" leaves it out


@dataclass(frozen=True)
class TrainerFigure:
    """One memory figure as the trainer logs it, predicted."""

    metric: str  # the trainer's metric key
    label: str  # what its published tables call it
    value_bytes: int
    how: str  # what it counts, in one line

    @property
    def value_gib(self) -> float:
        """The figure in the unit the trainer logs it in (bytes / 1024**3, named "gb")."""
        return self.value_bytes / 2**30


def easyr1_figures(estimate: MemoryEstimate, host: NodeHost) -> list[TrainerFigure]:
    """EasyR1's perf/max_memory_reserved_gb and perf/cpu_memory_used_gb for the estimated
    run, as its update_actor reads them (the module's doc)."""
    reserved = max(phase.total_bytes - phase.context_bytes
                   - sum(phase.parts.get(part, 0) for part in ENGINE_POOL_PARTS)
                   for phase in estimate.phases.values())
    update = host.phases["update"]
    used = sum(value for name, value in update.items() if name not in SHARED_MEMORY_PARTS)
    return [
        TrainerFigure("perf/max_memory_reserved_gb", "Peak VRAM", reserved,
                      "torch's reserved peak since start less what the engine's sleep freed: "
                      "the trainer's largest phase, the engine's pool left out"),
        TrainerFigure("perf/cpu_memory_used_gb", "Peak Mem", used,
                      "psutil's used memory of the node at the end of the update: every "
                      "rank's process and pinned host memory, /dev/shm left out")]


def trainer_figures(trainer: str | None, estimate: MemoryEstimate,
                    host: NodeHost) -> list[TrainerFigure]:
    """The figures `trainer` logs of its own memory, where autotune knows how it takes
    them (EasyR1); none for the others."""
    if trainer == "easyr1":
        return easyr1_figures(estimate, host)
    return []
