"""A split probe (placement=separate): the engine's side and the trainer's, two processes.

The worker of a probe whose config puts the engine on GPUs of its own becomes this launcher (no
torch import): it checks the config against the whole run, writes one request per side (the
engine's share of the rollout on `rollout_gpus` GPUs, the trainer's share of the trained
phases on the rest; each side one process over its own emulated ranks, on its own cores),
starts both with a loopback port for their link (probe/step/split_step.py says what they do), and
watches them as the launcher watches ranks: the first side that fails ends the probe, named.
When both succeed, the result is the pipeline's: the measured step (sync to sync, the trainer's
clock), the engine's rollout and weight sync beside the trainer's phases, each phase's peak
from the side that ran it, and `composed_step_s`, what config/pipeline.py composes from those
phase times, so the composition is held to the step as it ran.

CPU only so far (config/rules.py refuses it on a GPU): the sides' GPUs are not assigned yet.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from autotune.config import SYNC_PHASE, ProbeConfig, Topology, validate_probe_config
from autotune.config.pipeline import step_seconds
from autotune.probe.launch.launcher import free_port, read_result, run_workers
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus
from autotune.process_tag import PROBE_TAG_ENV

SIDES = ("engine", "trainer")


def side_config(config: ProbeConfig) -> ProbeConfig:
    """What a side runs: the config as one role of it, checked on that role's GPUs (the
    placement knobs' rules were checked on the run's; staleness stays: it orders the step)."""
    return dataclasses.replace(config, placement="colocated", rollout_gpus=0)


def side_requests(request: ProbeRequest, port: int) -> dict[str, ProbeRequest] | None:
    """Each side's request: its GPUs' share, its cores and threads, every step whole (the
    pipeline's step is its wall time), no early stop or extra steps (both sides run the same
    steps in lockstep); None where the split has no such topology."""
    run, gpus = Topology(request.nnodes, request.gpus_per_node), request.config.rollout_gpus
    trainers, engine = run.without_engine(gpus), run.engine_of(gpus)
    if trainers is None or engine is None:
        return None
    cores = sorted(request.cpu_ids or os.sched_getaffinity(0))
    engine_cores = max(1, round(len(cores) * gpus / run.world_size))
    groups = {"engine": tuple(cores[:engine_cores]),
              "trainer": tuple(cores[engine_cores:]) or tuple(cores)} if len(cores) > 1 else \
        dict.fromkeys(SIDES, tuple(cores))
    base = dataclasses.replace(request, config=side_config(request.config), full_steps=True,
                               stop_below=None, timed_min_s=0.0, emulated=True,
                               split_port=port)
    return {side: dataclasses.replace(
        base, nnodes=topology.nnodes, gpus_per_node=topology.gpus_per_node,
        cpu_ids=groups[side], cpu_threads=len(groups[side]), split_side=side)
        for side, topology in (("engine", engine), ("trainer", trainers))}


def side_paths(result_path: str, side: str) -> tuple[Path, Path]:
    """trial-7.result.json -> trial-7.engine.request.json, trial-7.engine.result.json."""
    base = Path(result_path)
    stem = base.name.removesuffix(".json").removesuffix(".result")
    return (base.with_name(f"{stem}.{side}.request.json"),
            base.with_name(f"{stem}.{side}.result.json"))


def launch_split(request: ProbeRequest, result_path: str) -> ProbeResult:
    """Run both sides of `request`; the pipeline's result, or the first failure's."""
    problems = validate_probe_config(request.config, request.world_size)
    port = free_port()
    requests = side_requests(request, port) if not problems else None
    if requests is None:
        return ProbeResult(status=ProbeStatus.INVALID, world_size=request.world_size,
                           message="; ".join(problems) or "placement=separate: no split of "
                           "this run's GPUs")
    paths = [side_paths(result_path, side) for side in SIDES]
    # each side counts the other as its own probe's, not as contention (MachineWatch): both
    # carry the probe's tag, the runner's or, started alone, one of this launcher's
    os.environ.setdefault(PROBE_TAG_ENV, f"split.{os.getpid()}")
    failure = run_workers([requests[side] for side in SIDES], paths, port)
    if failure is not None:
        index, result = failure
        return result.replace(world_size=request.world_size,
                              message=f"{SIDES[index]}'s side: {result.message}")
    engine, trainer = (read_result(result) for _, result in paths)
    if engine is None or trainer is None:
        return ProbeResult(status=ProbeStatus.CRASH, world_size=request.world_size,
                           message="a side of the split probe wrote no result")
    return merge_sides(request.config, engine, trainer, request.world_size)


def merge_sides(config: ProbeConfig, engine: ProbeResult, trainer: ProbeResult,
                world_size: int) -> ProbeResult:
    """The pipeline's figures: the trainer's clock for the step (both sides meet at each
    sync), each phase's time and peak from the side that ran it, and the step composed from
    those phase times (config/pipeline.py) beside it."""
    phase_s = {**engine.phase_s, **trainer.phase_s}

    def both(field: str) -> dict[str, int]:
        """Each phase's figure from the side that runs it: the engine's rollout (its
        receiving end of the sync inside it, as memory/roles.py sizes the engine's GPU),
        the trainer's sync and trained phases."""
        engine_side = getattr(engine, field)
        rollout = {"rollout": max(engine_side.get("rollout", 0),
                                  engine_side.get(SYNC_PHASE, 0))} if engine_side else {}
        return {**rollout, **getattr(trainer, field)}  # none on a CPU: no allocator here

    peaks = both("phase_peak_mem_bytes")

    return trainer.replace(
        phase_s=phase_s,
        composed_step_s=step_seconds(phase_s, True, config.staleness),
        peak_mem_bytes=max(peaks.values(), default=0), phase_peak_mem_bytes=peaks,
        phase_allocator_peak_bytes=both("phase_allocator_peak_bytes"),
        phase_tensor_peak_bytes=both("phase_tensor_peak_bytes"),
        host_peak_rss_bytes=(engine.host_peak_rss_bytes or 0)
        + (trainer.host_peak_rss_bytes or 0),
        engine=dict(engine.engine), engine_weight_bytes=engine.engine_weight_bytes,
        side_peak_mem_bytes={"engine": engine.peak_mem_bytes or 0,
                             "trainer": trainer.peak_mem_bytes or 0},
        contention="; ".join(sorted({r.contention for r in (engine, trainer)
                                     if r.contention})) or None,
        startup_s=max(engine.startup_s or 0.0, trainer.startup_s or 0.0),
        build_s=max(engine.build_s or 0.0, trainer.build_s or 0.0),
        world_size=world_size, emulated=True)
