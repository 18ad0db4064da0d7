"""SweepSettings: everything that defines a sweep, and what of it a resumed study must share."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from autotune.config import DEFAULT_HEADROOM, Knobs
from autotune.files import JsonObject
from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.execution.command_probe import CommandTemplate
from autotune.sweep.execution.parallel import Slot
from autotune.sweep.space.search_space import Candidate, SearchSpace
from autotune.sweep.study.sharing import HEARTBEAT_S

SAMPLERS = ("tpe", "random")  # Optuna's samplers a sweep may use, seeded (--sampler)


@dataclass(frozen=True)
class SweepSettings:
    """Everything that defines a sweep; the study stores what must not change on resume."""

    study_name: str
    study_dir: Path  # results/<study>/
    space: SearchSpace
    request: ProbeRequest  # the template: model, device, limits; config replaced per trial
    objective: str = "throughput_per_memory"
    headroom: float = DEFAULT_HEADROOM
    max_trials: int | None = None  # probes run in the study, resumed runs included
    timeout_s: float | None = None  # no new probe starts after this many seconds of this run
    patience: int | None = None  # stop after this many probes without a better feasible one
    seed: int = 0
    sampler: str = "tpe"
    n_startup_trials: int = 5
    base_params: Knobs | None = None  # queued after the safe config (--base-config)
    prune_dominated: bool = True  # record configs a measured OOM proves infeasible, unrun
    prescreen: bool = True  # also those the calibrated memory model puts well past capacity
    trace: bool = False  # trace candidates near the wall (traced.py): `run` on, --no-trace off
    stop_slow: bool = False  # built-in probes stop once they measure themselves under the
    # best by more than the noise (ProbeStatus.SLOW): `run` on, --no-stop-slow off
    storage: str | None = None  # --storage: a database URL or a journal file; None: SQLite
    trainer: str | None = None  # "easyr1 on 1x8 GPUs": its rules decide which configs are valid
    slots: tuple[Slot, ...] = (Slot(),)  # one probe per slot at a time (parallel.py)
    heartbeat_s: float = HEARTBEAT_S  # shared storage: how often running trials say alive
    confirm: int = 0  # emulated sweeps: probe the best K again with real ranks at the end
    finalists: int = 0  # probe the best K again, round robin, before the pick (finalists.py)
    command: CommandTemplate | None = None  # probes are short runs of the user's trainer
    node_host_bytes: int | None = None  # --host-memory: one node's RAM; configs the node
    # cannot hold are skipped (None: stated for this machine's RAM, never skipped)
    node_trainer: str | None = None  # whose run holds the node's host memory (memory/host.py)

    @property
    def probe_kind(self) -> str:
        """builtin, or command:<trainer>:<hash of the launch line and base config>."""
        return self.command.identity if self.command is not None else "builtin"

    def request_for(self, candidate: Candidate) -> ProbeRequest:
        """The probe of one trial: the template with the trial's config (and the command of
        the trainer's own keys)."""
        command = self.command.command_for(candidate.config, candidate.trainer_values) \
            if self.command is not None else None
        return dataclasses.replace(self.request, config=candidate.config, command=command)

    def identity(self) -> JsonObject:
        """What a resumed study must share with the run that created it: anything that changes
        what a probe measures or what counts as feasible (not GPU ids, threads or timeouts)."""
        request = self.request
        return {"model": request.model, "model_path": request.model_path,
                "objective": self.objective, "headroom": self.headroom,
                "search_space_hash": self.space.space_hash, "device": request.device.kind,
                "gpu_memory_limit_bytes": request.device.limit_bytes,
                "reserve_gpu_memory_bytes": request.device.reserve_bytes,
                "host_memory_limit_bytes": request.host_memory_limit_bytes,
                "dtype": request.dtype, "warmup_steps": request.warmup_steps,
                "timed_steps": request.timed_steps, "timed_min_s": request.timed_min_s,
                "full_steps": request.full_steps,
                "trainer": self.trainer,
                "nnodes": request.nnodes, "gpus_per_node": request.gpus_per_node,
                "emulated": request.emulated, "probe": self.probe_kind}
