"""Never probe a config that must run out of memory: dominance over measured OOMs.

Peak device memory is monotone along known axes (config.MEMORY_DIRECTION): larger
micro-batches, batch sizes, rollout_n and lengths need more; gradient checkpointing and
offload need less. So once config A has run out of device memory, any config B at least as
demanding as A on every axis (and equal on axes with no monotone effect) must too, and is
recorded as a predicted OOM without running.

Host RAM runs the other way on the offload axes: offload moves tensors into host memory. A
config that offloads at least what a host-OOM config offloaded, and is at least as demanding
on every other axis, is predicted to exhaust host RAM too.

Cache OOM (the rollout engine's KV-cache reservation) is two-sided in the engine's memory
share and is never used for dominance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune.config import MEMORY_DIRECTION

OFFLOAD_KNOBS = ("offload_params", "offload_optimizer")


@dataclass(frozen=True)
class KnownOOM:
    """A measured OOM that later configs are compared with."""

    trial_number: int
    params: dict[str, Any]
    status: str  # gpu_oom | host_oom
    failed_phase: str | None


def _ordered(value: Any) -> float:
    return -1.0 if value is None else float(value)


def at_least_as_demanding(candidate: dict[str, Any], known: dict[str, Any],
                          host: bool = False) -> bool:
    """Whether `candidate` needs at least the memory `known` needed, on every axis.

    Device memory (host=False) follows MEMORY_DIRECTION; host memory (host=True) flips the
    offload axes. Knobs without a monotone effect must be equal. Both configs must share the
    same knob names (those of one search space; fixed knobs are equal by construction).
    """
    for name, known_value in known.items():
        value = candidate[name]
        direction = MEMORY_DIRECTION.get(name, 0)
        if host and name in OFFLOAD_KNOBS:
            direction = -direction
        if direction > 0 and _ordered(value) < _ordered(known_value):
            return False
        if direction < 0 and _ordered(value) > _ordered(known_value):
            return False
        if direction == 0 and value != known_value:
            return False
    return True


class Feasibility:
    """What the sweep knows about where the memory wall is, from measured OOMs."""

    def __init__(self) -> None:
        self.known: list[KnownOOM] = []

    def record(self, trial_number: int, params: dict[str, Any], status: str,
               failed_phase: str | None = None) -> None:
        """Learn from a measured probe outcome (only GPU and host OOMs are kept)."""
        if status in ("gpu_oom", "host_oom") and params:
            self.known.append(KnownOOM(trial_number, dict(params), status, failed_phase))

    def predicted_oom(self, params: dict[str, Any]) -> KnownOOM | None:
        """The measured OOM that proves `params` cannot fit, or None."""
        for known in self.known:
            if at_least_as_demanding(params, known.params, host=known.status == "host_oom"):
                return known
        return None


def reason_for(known: KnownOOM) -> str:
    what = "device" if known.status == "gpu_oom" else "host"
    where = f" in {known.failed_phase}" if known.failed_phase else ""
    return (f"predicted {known.status}: needs at least the {what} memory of trial "
            f"{known.trial_number} ({known.status}{where})")
