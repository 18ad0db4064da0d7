"""Where a sweep's probes run: the training run's topology, how its ranks are probed (real or
emulated), the runner, and the slots probes take side by side.

A probe of a W-GPU run is rank 0 of W emulated on one device (exact per-rank memory, time
without communication) or the W ranks for real (W GPUs, or core groups on a CPU, on this
machine). A sweep searches with emulated ranks, probes side by side, and confirms its best
with real ranks when they are all here (confirm.py); a probe of the user's own trainer runs
the trainer's own ranks, all of them per probe.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import Topology
from autotune.errors import ConfigError
from autotune.hardware import Device, usable_cpu_ids, visible_gpu_ids
from autotune.probe.measure.result import ProbeRequest
from autotune.process_tag import tag_scope
from autotune.runners import Runner, connect_ray, get_runner
from autotune.sweep.execution.parallel import Slot, plan_slots


def default_topology(nnodes: int | None, gpus_per_node: int | None, device: Device,
                     gpus: tuple[int, ...] | None) -> Topology:
    """--nnodes and --gpus-per-node, or when both are left out this machine's GPUs (the
    --gpus given, else every visible one), 1 on a CPU."""
    if nnodes is not None or gpus_per_node is not None:
        return Topology(nnodes or 1, gpus_per_node or 1)
    ids = gpus if gpus is not None else visible_gpu_ids()
    return Topology(1, max(1, len(ids)) if device.on_gpu else 1)


def local_ranks(device: Device, gpus: tuple[int, ...] | None) -> int:
    """How many real ranks this machine can run at once: its GPUs, or on a CPU its cores."""
    if not device.on_gpu:
        return len(usable_cpu_ids())
    return len(gpus) if gpus is not None else len(visible_gpu_ids())


def emulate_ranks(ranks: str, world_size: int, device: Device, gpus: tuple[int, ...] | None,
                  local: bool = True) -> bool:
    """Whether probes of a `world_size`-GPU run emulate their rank (--ranks): auto runs real
    ranks when the run's GPUs are all here, and emulates one rank when they are not."""
    if world_size == 1:
        return False
    here = local_ranks(device, gpus)
    fits = not local or world_size <= here
    if ranks == "real" and not fits:
        where = "GPUs" if device.on_gpu else "cores"
        raise ConfigError(f"--ranks real: the run's {world_size} GPUs need {world_size} "
                          f"{where} here, {here} found; use --ranks emulated (exact per-rank "
                          "memory on one device)")
    return ranks == "emulated" or (ranks == "auto" and not fits)


@dataclass(frozen=True)
class RankPlan:
    """How a sweep probes the run's ranks: emulated or real, the confirmations with real
    ranks at the end, the GPUs each probe holds, and the line that says so."""

    emulated: bool
    confirm: int  # the best configs probed again with real ranks (0: none)
    gpus_per_trial: int
    note: str | None


def plan_ranks(topology: Topology, device: Device, ranks: str, gpus: tuple[int, ...] | None,
               local: bool, confirm: int, gpus_per_trial: int | None) -> RankPlan:
    """A sweep of a W-GPU run searches with emulated ranks (one device per probe, probes side
    by side) and confirms the best with real ones when the W GPUs are all here; --ranks real
    takes W GPUs (by default) a probe, one probe at a time."""
    world = topology.world_size
    if world == 1:
        return RankPlan(False, 0, gpus_per_trial or 1, None)
    if ranks == "real":
        emulate_ranks("real", world, device, gpus, local)  # refused when they are not here
        held = gpus_per_trial or (world if device.on_gpu else 1)
        return RankPlan(False, 0, held, f"probes run the run's {world} ranks for real, one "
                        "probe at a time")
    what = (f"probes emulate one rank of the run's {world} GPUs (exact per-rank memory, time "
            "without communication)")
    here = local_ranks(device, gpus)
    if not (local and world <= here):
        return RankPlan(True, 0, gpus_per_trial or 1,
                        f"{what}: its ranks are not all on this machine ({here} "
                        f"{'GPUs' if device.on_gpu else 'cores'} here), so nothing can be "
                        "confirmed with real ranks")
    confirming = f"; the best {confirm} are then probed with {world} real ranks" \
        if confirm else ""
    return RankPlan(True, confirm, gpus_per_trial or 1, what + confirming)


def plan_command_ranks(topology: Topology, device: Device, gpus: tuple[int, ...] | None,
                       steps: int, gpus_per_trial: int | None) -> RankPlan:
    """A probe of the user's trainer runs the trainer's own ranks: all the run's GPUs per
    probe, so they must all be on this machine."""
    here = local_ranks(device, gpus)
    if topology.world_size > here:
        where = "GPUs" if device.on_gpu else "CPU cores"
        raise ConfigError(
            f"--launch: the run spans {topology.nnodes}x{topology.gpus_per_node} GPUs and a "
            f"probe of your trainer runs all of them, but {here} {where} are here; run autotune "
            "on a machine that holds the whole run, or tune a one-node shape of it "
            "(--nnodes 1 --gpus-per-node N)")
    held = gpus_per_trial or (topology.world_size if device.on_gpu else 1)
    return RankPlan(False, 0, held, f"each probe is a {steps}-step run of your trainer's "
                    "launch line on the run's own GPUs")


def make_runner(executor: str, address: str | None, request: ProbeRequest,
                parallel: int | None, gpus_per_trial: int,
                study_name: str = "") -> tuple[Runner, list[Slot]]:
    """The runner for --executor, and the slots its probes run in side by side: GPU or core
    groups of this machine, or as many probes as the Ray cluster holds (--parallel caps).
    A local runner's probes are tagged with the study's scope: its first probe cleans up
    after a driver of the same study that was killed, and nothing else."""
    if executor == "local":
        runner = get_runner("local", scope=tag_scope(study_name) if study_name else "")
        return runner, plan_slots(request.device.kind, request.gpu_ids, gpus_per_trial,
                                  parallel, request.cpu_threads)
    runner = connect_ray(address, num_cpus_per_probe=request.cpu_threads or 1,
                         num_gpus_per_probe=gpus_per_trial if request.device.on_gpu else 0)
    held = parallel or runner.probe_slots()
    return runner, [Slot(cpu_threads=request.cpu_threads) for _ in range(held)]
