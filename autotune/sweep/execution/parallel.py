"""Probes side by side: which GPUs or cores each parallel probe gets.

A slot is one probe's share of the machine. With G GPUs and `--gpus-per-trial g` there are
G // g slots of g GPUs each (CUDA_VISIBLE_DEVICES); on a CPU, `--parallel N` splits the cores
this process may use into N disjoint groups, each probe pinned to its group (sched_setaffinity)
with as many threads as cores, so parallel probes do not fight over cores. GPU slots side by
side get a core group each as well (a probe's Python drives its GPU). The sweep's trace
process runs on the cores of a free slot (traced.py), so it never shares a running probe's.
On Ray the cluster places each probe, so a slot there carries no ids, only the thread count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypedDict, TypeVar

from autotune.errors import ConfigError
from autotune.hardware import NO_GPU_HERE, usable_cpu_ids, visible_gpu_ids
from autotune.probe.measure.result import ProbeRequest, ProbeResult
from autotune.runners import Runner

Tag = TypeVar("Tag")  # what the caller attaches to a probe, given back with its result


class SlotFields(TypedDict, total=False):
    """The ProbeRequest fields a slot sets."""

    gpu_ids: tuple[int, ...]
    cpu_ids: tuple[int, ...]
    cpu_threads: int


@dataclass(frozen=True)
class Slot:
    """The resources of one probe running alongside others."""

    gpu_ids: tuple[int, ...] | None = None
    cpu_ids: tuple[int, ...] | None = None
    cpu_threads: int | None = None

    def request_fields(self) -> SlotFields:
        """The ProbeRequest fields this slot sets (those it leaves None keep the template's)."""
        fields = SlotFields()
        if self.gpu_ids is not None:
            fields["gpu_ids"] = self.gpu_ids
        if self.cpu_ids is not None:
            fields["cpu_ids"] = self.cpu_ids
        if self.cpu_threads is not None:
            fields["cpu_threads"] = self.cpu_threads
        return fields

    def describe(self) -> str:
        if self.gpu_ids is not None:
            return f"GPU {','.join(map(str, self.gpu_ids))}"
        if self.cpu_ids is not None:
            return f"cores {','.join(map(str, self.cpu_ids))}"
        return "any"


def gpu_slots(gpu_ids: tuple[int, ...], gpus_per_trial: int) -> list[Slot]:
    """Disjoint groups of `gpus_per_trial` GPUs, in id order; GPUs left over stay idle."""
    if gpus_per_trial < 1:
        raise ConfigError(f"--gpus-per-trial {gpus_per_trial}: must be at least 1")
    if len(gpu_ids) < gpus_per_trial:
        raise ConfigError(f"--gpus-per-trial {gpus_per_trial}: only {len(gpu_ids)} GPU(s) "
                          f"visible ({','.join(map(str, gpu_ids)) or 'none'}); lower it or "
                          "pass --gpus")
    count = len(gpu_ids) // gpus_per_trial
    return [Slot(gpu_ids=tuple(gpu_ids[i * gpus_per_trial:(i + 1) * gpus_per_trial]))
            for i in range(count)]


def cpu_slots(parallel: int, cpu_ids: tuple[int, ...],
              threads_per_probe: int | None = None) -> list[Slot]:
    """`parallel` disjoint groups of cores, each probe pinned to its group. More probes than
    cores would share cores and measure each other, so that is refused."""
    if parallel < 1:
        raise ConfigError(f"--parallel {parallel}: must be at least 1")
    if parallel > len(cpu_ids):
        raise ConfigError(f"--parallel {parallel}: this machine lets autotune use "
                          f"{len(cpu_ids)} core(s), and probes side by side need one each at "
                          f"least; use --parallel {len(cpu_ids)} or less")
    if parallel == 1:
        return [Slot(cpu_threads=threads_per_probe)]
    size = len(cpu_ids) // parallel
    groups = [cpu_ids[i * size:(i + 1) * size] for i in range(parallel)]
    return [Slot(cpu_ids=group, cpu_threads=threads_per_probe or len(group)) for group in groups]


def plan_slots(device: str, gpus: tuple[int, ...] | None, gpus_per_trial: int,
               parallel: int | None, threads_per_probe: int | None) -> list[Slot]:
    """The slots of a local sweep: GPU groups when probes run on GPUs, core groups on CPU."""
    gpu_ids = gpus if gpus is not None else visible_gpu_ids() if device != "cpu" else ()
    if device != "cpu" and gpu_ids:
        slots = gpu_slots(gpu_ids, gpus_per_trial)
        if parallel is not None:
            if parallel > len(slots):
                raise ConfigError(f"--parallel {parallel}: {len(gpu_ids)} GPU(s) at "
                                  f"{gpus_per_trial} per trial hold {len(slots)} probe(s) at "
                                  "once; lower --parallel or --gpus-per-trial")
            slots = slots[:parallel]
        # side by side, each probe gets cores of its own too (one slot keeps them all): a
        # trace then runs on a free slot's cores, never on a running probe's
        cores = cpu_slots(min(len(slots), len(usable_cpu_ids())), usable_cpu_ids(),
                          threads_per_probe)
        return [Slot(gpu_ids=s.gpu_ids, cpu_ids=cores[i % len(cores)].cpu_ids,
                     cpu_threads=cores[i % len(cores)].cpu_threads or threads_per_probe)
                for i, s in enumerate(slots)]
    if device == "cuda":
        raise ConfigError(NO_GPU_HERE)
    return cpu_slots(parallel or 1, usable_cpu_ids(), threads_per_probe)


class ProbePool(Generic[Tag]):
    """Probes in flight, one per slot, each on a thread that only waits for its runner call
    (the runner isolates the probe itself: a subprocess, or a Ray task); each carries the
    caller's tag."""

    def __init__(self, runner: Runner, slots: list[Slot]) -> None:
        self.runner, self.slots = runner, slots
        self.executor = futures.ThreadPoolExecutor(max_workers=len(slots),
                                                   thread_name_prefix="probe")
        # each probe's future -> (its slot's index, its tag)
        self.in_flight: dict[futures.Future[ProbeResult], tuple[int, Tag]] = {}

    def __len__(self) -> int:
        return len(self.in_flight)

    def full(self) -> bool:
        return len(self.in_flight) >= len(self.slots)

    def tags(self) -> list[Tag]:
        return [tag for _, tag in self.in_flight.values()]

    def free_slot(self) -> Slot | None:
        """The first slot no probe holds now (None: every one is busy)."""
        used = {index for index, _ in self.in_flight.values()}
        free = [slot for index, slot in enumerate(self.slots) if index not in used]
        return free[0] if free else None

    def start(self, request: ProbeRequest, log_path: Path, tag: Tag) -> Slot:
        """Run `request` on a free slot (its GPUs or cores); `tag` comes back with the result."""
        slot = self.free_slot()
        assert slot is not None, "start() on a full pool"
        index = self.slots.index(slot)
        request = dataclasses.replace(request, **slot.request_fields())
        self.in_flight[self.executor.submit(self.runner.run, request, log_path)] = (index, tag)
        return slot

    def finished(self, only: set[futures.Future[ProbeResult]] | None = None
                 ) -> Iterator[tuple[Tag, ProbeResult]]:
        """(tag, result) of each probe that ended. A runner that raised re-raises here, and its
        probe stays in flight so that whoever handles the error still sees it."""
        for future in [f for f in self.in_flight if f.done() and (only is None or f in only)]:
            result = future.result()
            yield self.in_flight.pop(future)[1], result

    def wait(self, timeout_s: float) -> None:
        futures.wait(self.in_flight, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)

    def stop(self, timeout_s: float = 30.0
             ) -> tuple[set[futures.Future[ProbeResult]], list[Tag]]:
        """Kill every probe in flight. Returns the probes that had ended cleanly before (to
        settle with `finished(only=...)`) and the tags of all the others."""
        ended = {f for f in self.in_flight if f.done() and f.exception() is None}
        self.runner.stop()
        futures.wait(self.in_flight, timeout=timeout_s)
        cut = [tag for f, (_, tag) in self.in_flight.items() if f not in ended]
        return ended, cut

    def close(self) -> None:
        self.executor.shutdown(wait=True)
