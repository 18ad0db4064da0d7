"""Dominance over measured OOMs: a config at least as demanding as one that ran out of memory
must run out too, and is never run.

Peak device memory is monotone along known axes (config.MEMORY_DIRECTION): larger
micro-batches, batch sizes, rollout_n and lengths need more; gradient checkpointing and
offload need less. So once config A has run out of device memory in phase P, any config B at
least as demanding as A on every axis that moves P's peak (memory.PHASE_KNOBS: the update
does not care about the log-prob micro-batch) must too. On a GPU the update's knobs that
size the segments its first step leaves held in the caching allocator (memory.carried_knobs:
the log-prob forwards, a colocated rollout and the validation find them) have no order in
those phases, and must be equal there.

Host RAM runs the other way on the offload axes: offload moves tensors into host memory. A
config that offloads at least what a host-OOM config offloaded, and is at least as demanding
on every other axis, exhausts host RAM too.

Cache OOM (the rollout engine's KV-cache reservation) is two-sided in the engine's memory
share and is never used for dominance.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autotune.batching import ROW_COUNT_KNOBS
from autotune.config import MEMORY_DIRECTION, Knobs, KnobValue
from autotune.memory.phases import PHASE_KNOBS, carried_knobs
from autotune.probe.measure.result import ProbeStatus
from autotune.sweep.space.params import value_order

OFFLOAD_KNOBS = ("offload_params", "offload_optimizer", "critic_offload_params",
                 "critic_offload_optimizer")
LEARNED = (ProbeStatus.GPU_OOM, ProbeStatus.HOST_OOM)  # the OOMs dominance reasons from


@dataclass(frozen=True)
class KnownOOM:
    """A measured OOM that later configs are compared with."""

    trial_number: int
    params: Knobs
    status: ProbeStatus  # gpu_oom | host_oom
    failed_phase: str | None
    separate: bool = False  # its rollout on GPUs of its own (placement=separate)

    @property
    def reason(self) -> str:
        """Why a config at least as demanding cannot fit, in one line."""
        what = "host" if self.status is ProbeStatus.HOST_OOM else "device"
        where = f" in {self.failed_phase}" if self.failed_phase else ""
        return (f"predicted {self.status.value}: needs at least the {what} memory of trial "
                f"{self.trial_number} ({self.status.value}{where})")


def at_least_as_demanding(candidate: Mapping[str, KnobValue], known: Mapping[str, KnobValue],
                          host: bool = False, phase: str | None = None,
                          directions: dict[str, int] | None = None,
                          token_batched: bool = False, on_gpu: bool = False,
                          separate: bool = False) -> bool:
    """Whether `candidate` needs at least the memory `known` needed, on every axis.

    Device memory (host=False) follows MEMORY_DIRECTION; host memory (host=True) flips the
    offload axes. Knobs without a monotone effect must be equal. Both configs must share the
    same knob names (those of one search space; fixed knobs are equal by construction).
    With `phase` (where `known` ran out of device memory), only the knobs that move that
    phase's peak (memory.PHASE_KNOBS) are compared: the candidate reaches that phase and
    needs at least as much there. `on_gpu` (a caching allocator): the knobs that phase reads
    through the segments the first update left (memory.carried_knobs; none in a rollout on
    GPUs of its own, `separate`) must be equal too.
    `directions` adds the directions a search space declares for a trainer's own keys. With
    `token_batched` (dynamic batching on), the knobs that count the responses cut into
    micro-batches must be equal (batching.ROW_COUNT_KNOBS).
    """
    directions = directions or MEMORY_DIRECTION
    moving = PHASE_KNOBS
    carried = carried_knobs(phase, separate) if on_gpu else frozenset()
    for name, known_value in known.items():
        counts_rows = token_batched and name in ROW_COUNT_KNOBS and \
            (phase != "rollout" or name in carried)
        if phase in moving and name not in moving[phase] | carried and not counts_rows:
            continue
        value = candidate[name]
        direction = 0 if counts_rows or name in carried else directions.get(name, 0)
        if host and name in OFFLOAD_KNOBS:
            direction = -direction
        if direction > 0 and value_order(value) < value_order(known_value):
            return False
        if direction < 0 and value_order(value) > value_order(known_value):
            return False
        if direction == 0 and value != known_value:
            return False
    return True


class Dominance:
    """The measured OOMs of a sweep, and the configs they prove cannot fit."""

    def __init__(self, directions: dict[str, int] | None = None,
                 token_batched: bool = False, on_gpu: bool = False) -> None:
        self.directions = directions  # the space's, its trainer keys included
        self.token_batched = token_batched  # dynamic batching on in some config
        self.on_gpu = on_gpu  # probes on a GPU: its caching allocator carries segments
        self.known: list[KnownOOM] = []

    def record(self, trial_number: int, params: Mapping[str, KnobValue], status: ProbeStatus,
               failed_phase: str | None, separate: bool = False) -> None:
        """Learn from a measured probe: a GPU or host OOM is kept, anything else ignored.
        `separate`: its config's rollout ran on GPUs of its own (a fixed placement is not
        in `params`)."""
        if status in LEARNED and params:
            self.known.append(KnownOOM(trial_number, dict(params), status, failed_phase,
                                       separate))

    def proof(self, params: Mapping[str, KnobValue]) -> KnownOOM | None:
        """The measured OOM that proves `params` cannot fit, or None."""
        for known in self.known:
            host = known.status is ProbeStatus.HOST_OOM  # host RSS is the whole process
            phase = None if host else known.failed_phase
            if at_least_as_demanding(params, known.params, host=host, phase=phase,
                                     directions=self.directions,
                                     token_batched=self.token_batched, on_gpu=self.on_gpu,
                                     separate=known.separate):
                return known
        return None
