"""ProbeRequest and ProbeResult: the only things that cross a process boundary (plain JSON).

Each owns its JSON: `to_json` writes it and `from_json` reads it back (`to_dict` and
`from_dict` are the same JSON as a dict, for a study's stored attributes); every file, Ray
reply and trial attribute that holds one goes through them. A probe's request and result sit
beside its log under the names `probe_files` gives (trial-7.log -> trial-7.request.json,
trial-7.result.json), so a result written just before a driver died is found again.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.config import ProbeConfig
from autotune.files import JsonObject
from autotune.hardware import Device, usable_bytes

REQUEST_SUFFIX = ".request.json"  # beside a probe's log: what was asked
RESULT_SUFFIX = ".result.json"  # beside a probe's log: what the worker measured


def probe_files(log_path: Path) -> tuple[Path, Path]:
    """The request and result files that go with a probe's log: trial-7.log ->
    trial-7.request.json, trial-7.result.json."""
    return log_path.with_suffix(REQUEST_SUFFIX), log_path.with_suffix(RESULT_SUFFIX)


def json_object(text: str) -> Mapping[str, Any]:
    """The JSON object `text` holds: ValueError when it is not JSON (a torn file), TypeError
    when it is JSON but no object."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise TypeError(f"a JSON object was expected, not {type(data).__name__}")
    return data


def coefficient_of_variation(values: list[float]) -> float | None:
    """Sample standard deviation over the mean; None for fewer than two values."""
    if len(values) < 2 or not sum(values):
        return None
    return statistics.stdev(values) / statistics.fmean(values)


def probe_ranks_text(world_size: int, emulated: bool, split: bool = False) -> str:
    """How a built-in probe of a `world_size`-GPU run ran, for people (the one wording
    `probe`, `show`, best.yaml and the report use): a split probe's two sides, rank 0 of W
    emulated, or W real ranks; "" for one GPU."""
    if split:
        return (f"{world_size} GPUs split: the engine's side and the trainer's, each one "
                "process over emulated ranks (time without communication)")
    if world_size <= 1:
        return ""
    if emulated:
        return (f"rank 0 of {world_size} emulated (memory per rank; time without "
                "communication)")
    return f"{world_size} real ranks"


def study_probes_text(world_size: int, emulated: bool, placements: Iterable[str]) -> str:
    """How a study's built-in probes ran, for each placement its trials probed (a sweep over
    splits probes separate configs as two sides, colocated ones as rank 0 of W)."""
    texts = {p: probe_ranks_text(world_size, emulated, split=p == "separate")
             for p in sorted(set(placements)) or ["colocated"]}
    if len(texts) == 1:
        return next(iter(texts.values())) or "one device"
    return "; ".join(f"{placement}: {text}" for placement, text in texts.items())


class ProbeStatus(str, enum.Enum):
    """How a probe ended. Only the OOM classes mark a configuration infeasible."""

    OK = "ok"
    GPU_OOM = "gpu_oom"  # device memory ran out (on a CPU device: the device-memory limit on RSS)
    HOST_OOM = "host_oom"  # host RAM ran out: our watchdog, the kernel's OOM killer, Ray's monitor
    CACHE_OOM = "cache_oom"  # the rollout engine could not reserve its KV cache (vLLM)
    TIMEOUT = "timeout"
    CRASH = "crash"
    INVALID = "invalid"  # the configuration breaks a rule; nothing was run
    LOST = "lost"  # the probe's node went away (Ray): says nothing about the config; retried once
    KILLED = "killed"  # SIGKILLed from outside with no sign of OOM: as lost, retried once
    SLOW = "slow"  # stopped once its peaks were reached: what it had timed already put it
    # below the sweep's best by more than the noise (ProbeRequest.stop_below); its memory
    # figures are whole, its rate an upper bound

    @classmethod
    def of(cls, value: str | None) -> ProbeStatus | None:
        """The status a stored value names; None for the words a trial uses of its own run
        (interrupted, duplicate) or none at all."""
        try:
            return cls(value)
        except ValueError:
            return None

    @property
    def is_oom(self) -> bool:
        return self in (ProbeStatus.GPU_OOM, ProbeStatus.HOST_OOM, ProbeStatus.CACHE_OOM)

    @property
    def is_device_oom(self) -> bool:
        """Device memory ran out: the allocator, or the rollout engine's reservation."""
        return self in (ProbeStatus.GPU_OOM, ProbeStatus.CACHE_OOM)

    @property
    def reached_peaks(self) -> bool:
        """Every phase ran to its memory peak: the probe's memory figures are whole."""
        return self in (ProbeStatus.OK, ProbeStatus.SLOW)

    @property
    def says_nothing(self) -> bool:
        """The probe ended for a reason outside the config: run it once more elsewhere."""
        return self in (ProbeStatus.LOST, ProbeStatus.KILLED)


@dataclass(frozen=True)
class TrainerCommand:
    """A probe that is a short run of the user's own trainer (probe/launch/command.py runs it).

    `argv` is the user's launch line, split, its placeholders still in: {config} the trial's
    config file, {config_dir} and {config_name} the same for Hydra, {overrides} the
    `key=value` words; TRIAL_DIR_TOKEN, in the config text and the words, is the trial's own
    directory (the trainer's output goes there). Everything else is filled by the driver.
    """

    trainer: str  # easyr1 | verl | trl: whose log format the run prints
    argv: tuple[str, ...]
    config_text: str  # the candidate merged into the user's YAML, short-run settings added
    config_name: str = "config.yaml"
    overrides: tuple[str, ...] = ()  # `key=value` words for {overrides}
    steps: int = 3  # steps the run is told to take; throughput is read from all but the first
    steps_per_cycle: int = 1  # logged steps per rollout (TRL: optimizer steps per generation)
    cwd: str | None = None  # where the launch line is run (the directory `run` was called in)


TRIAL_DIR_TOKEN = "__AUTOTUNE_TRIAL_DIR__"  # plain in YAML and on a command line


@dataclass(frozen=True)
class SlowFloor:
    """When a probe may stop early: once every phase has reached its peak (a whole step has
    run), as soon as what its timed step has measured so far (a lower bound on the step's
    time) puts its rate under this floor. The sweep sets it from its best config's figure
    less the measured noise (sweep/study/objective.py `slow_floor`)."""

    tokens_per_s: float  # the floor: tokens/s, or tokens/s per GiB of the probe's own peak
    per_gib: bool  # the floor is per GiB of peak memory (the throughput_per_memory objective)
    incumbent: int  # the trial whose figure set it
    margin: float  # how far under the incumbent's figure the floor is (the noise allowed)

    def floor_tokens_per_s(self, peak_mem_bytes: int) -> float:
        """The floor in tokens/s for a probe that held `peak_mem_bytes` at its peak."""
        return self.tokens_per_s * peak_mem_bytes / 2**30 if self.per_gib else self.tokens_per_s

    def describe(self) -> str:
        unit = "tok/s/GiB" if self.per_gib else "tok/s"
        return (f"{self.tokens_per_s:,.1f} {unit} (trial {self.incumbent}'s figure less "
                f"{self.margin:.0%} for the noise)")


@dataclass(frozen=True)
class ProbeRequest:
    """What a runner needs to run one probe: the model, the knobs, the device and the limits."""

    model: str
    config: ProbeConfig = field(default_factory=ProbeConfig)
    model_path: str | None = None  # a local HF checkpoint or config directory
    device: Device = field(default_factory=Device)  # its kind, capacity and memory cap
    gpu_ids: tuple[int, ...] | None = None  # pinned through CUDA_VISIBLE_DEVICES
    cpu_threads: int | None = None
    cpu_ids: tuple[int, ...] | None = None  # CPU cores the probe is pinned to (parallel probes)
    host_memory_limit_bytes: int | None = None  # RSS of the whole probe tree
    timeout_s: float = 900.0
    warmup_steps: int = 1
    timed_steps: int = 3
    timed_min_s: float = 0.0  # more timed steps while they add up to less than this
    seed: int = 0
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32
    nnodes: int = 1  # the training run being tuned: nnodes x gpus_per_node ranks share each
    gpus_per_node: int = 1  # batch, and a probe runs one rank's share (config.device_share)
    emulated: bool = False  # W > 1: one rank in this process over a fake process group, not
    # W real processes (real memory per rank; time without communication)
    command: TrainerCommand | None = None  # a short run of the user's trainer, not the
    # built-in step
    env: dict[str, str] = field(default_factory=dict)  # what the trainer sets in its
    # workers' environment (its allocator settings): the probe's process runs under it
    full_steps: bool = False  # every unit of every step; False: a short probe, each loop of
    # units sampled and its step predicted (probe/measure/unit_loops.py)
    stop_below: SlowFloor | None = None  # stop early under this rate, once the peaks are
    # reached (built-in probes; None: run every timed step)
    split_side: str = ""  # one side of a split probe (placement=separate): engine | trainer,
    split_port: int = 0  # and the loopback port the engine's side listens on for the link
    step_cv_prior: float | None = None  # one timed step's spread as the study measured it
    # on this machine (its quiet probes' steps): a short probe's standard error is never
    # under it over sqrt(steps), and one timed step settles the probe when that is within
    # the target (probe/step/training.py); None: the probe's own steps alone
    timed_phases: tuple[str, ...] = ()  # a focused probe (a finalist's repeat): its timed
    # steps run only these phases, each on what the last run of the others left, after
    # whole warm-up steps (one at least); empty: every phase (built-in colocated probes)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def short(self) -> bool:
        """A short probe: the built-in step, each loop of units sampled (command probes run
        the trainer's own steps whole)."""
        return not self.full_steps and self.command is None

    def to_json(self, indent: int | None = 2) -> str:
        """The request as JSON (`indent=None`: on one line)."""
        return json.dumps(dataclasses.asdict(self), indent=indent, sort_keys=True)

    def to_dict(self) -> JsonObject:
        """The request's JSON as a dict (tuples as lists), as a study stores it."""
        data: JsonObject = json.loads(self.to_json(indent=None))
        return data

    @classmethod
    def from_json(cls, text: str) -> ProbeRequest:
        return cls.from_dict(json_object(text))

    @classmethod
    def from_dict(cls, stored: Mapping[str, Any]) -> ProbeRequest:
        """The request `to_dict` gave; TypeError, KeyError or ValueError for one that is not
        whole, or another version's."""
        data = dict(stored)
        data["config"] = ProbeConfig(**data["config"])
        data["device"] = Device(**data["device"])
        if data.get("stop_below") is not None:
            data["stop_below"] = SlowFloor(**data["stop_below"])
        if data.get("command") is not None:
            command = data["command"]
            data["command"] = TrainerCommand(**{**command, "argv": tuple(command["argv"]),
                                                "overrides": tuple(command["overrides"])})
        for name in ("gpu_ids", "cpu_ids", "timed_phases"):
            if data.get(name) is not None:
                data[name] = tuple(data[name])
        return cls(**data)


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured, or how it failed. Figures are per device, bytes and seconds."""

    status: ProbeStatus
    message: str = ""  # one line: the error, or empty when ok
    failed_phase: str | None = None  # the phase running when it failed
    stderr_tail: str = ""
    returncode: int | None = None
    tokens_per_s: float | None = None  # (prompt + response tokens of a step) / step seconds
    samples_per_s: float | None = None  # responses per second
    step_s: float | None = None  # mean seconds of a timed step (training phases, no validation)
    phase_s: dict[str, float] = field(default_factory=dict)  # mean seconds per phase
    step_times_s: list[float] = field(default_factory=list)  # each timed step's seconds
    # (a short probe's: what each step would have taken whole, predicted from its units)
    probe_mode: str = "full"  # full: every unit of every step ran; short: a sample of each
    # loop of units ran (probe/measure/unit_loops.py)
    step_se_s: float | None = None  # the standard error of step_s
    units: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)  # a short
    # probe's units by phase: per loop their count, how many ran, seconds per unit of work
    timed_wall_s: float | None = None  # the seconds the timed steps took, as run
    machine: dict[str, float] = field(default_factory=dict)  # what else the machine did over
    # the timed steps (probe/measure/machine.py: other processes' cores, load, the GPU's others)
    contention: str | None = None  # why the timing is not the probe's own; None: quiet
    peak_mem_bytes: int | None = None  # max over phases of the device figure below
    phase_peak_mem_bytes: dict[str, int] = field(default_factory=dict)  # device memory
    phase_allocator_peak_bytes: dict[str, int] = field(default_factory=dict)  # torch reserved
    phase_tensor_peak_bytes: dict[str, int] = field(default_factory=dict)  # torch allocated
    host_peak_rss_bytes: int | None = None  # peak RSS of the probe's process tree
    host_offload_bytes: int | None = None  # tensors held in host memory by offload
    host_held_peak_bytes: int | None = None  # host memory measured holding them (pinned
    # blocks with the allocator's rounding beside a GPU; shared memory on a CPU device)
    device_name: str | None = None
    device_capacity_bytes: int | None = None
    device_limit_bytes: int | None = None  # the cap the probe ran under, if any
    num_params: int | None = None
    startup_s: float | None = None  # process start and imports
    build_s: float | None = None  # model and optimizer build
    probe_wall_s: float | None = None  # the whole probe, as the runner saw it
    versions: dict[str, str] = field(default_factory=dict)
    share: dict[str, int] = field(default_factory=dict)  # one GPU's share of the step, as run
    world_size: int = 1  # ranks of the run the probe measured (figures above are per rank,
    emulated: bool = False  # the max over ranks; tokens/s the whole run's); emulated: one rank
    failed_rank: int | None = None  # of a real multi-rank probe, the rank that failed first
    rank_peak_mem_bytes: list[int] = field(default_factory=list)  # each real rank's peak
    # a split probe (placement=separate): each side's peak (engine, trainer), and the step
    # config/pipeline.py composes from its phase times, beside step_s, the step as it ran
    side_peak_mem_bytes: dict[str, int] = field(default_factory=dict)
    composed_step_s: float | None = None
    model_state_bytes: dict[str, int] = field(default_factory=dict)  # params, grads, optimizer
    engine_weight_bytes: int | None = None  # the rollout engine's weights on a rank, awake
    engine: dict[str, int] = field(default_factory=dict)  # vllm-like: what the engine
    # reserved at start (reserved, weight, profile, kv_pool bytes; concurrency; start_used)
    probe_kind: str = "builtin"  # builtin | command (a short run of the user's trainer)
    trainer_metrics: dict[str, float] = field(default_factory=dict)  # what the trainer logged
    # itself (its own step time, throughput, memory), means over the steps after the first
    steps_logged: int | None = None  # steps the trainer's log showed (command probes)
    fsdp_strategy: str | None = None  # the FSDP wrapper the ranks ran (None: one GPU)
    num_alloc_retries: int | None = None  # GPU: times torch's allocator freed its cache and
    # retried an allocation under the cap (torch.cuda.memory_stats)
    allocator: dict[str, str] = field(default_factory=dict)  # the CUDA allocator's settings
    # it ran under: the trainer's environment variables, and the phases with expandable
    # segments on
    timed_phases: list[str] = field(default_factory=list)  # a focused probe's timed phases
    # (ProbeRequest.timed_phases): phase_s and step_s are theirs alone until the finalists'
    # re-measure completes them (sweep/pick/focused.py); empty: every phase was timed

    @property
    def ok(self) -> bool:
        return self.status is ProbeStatus.OK

    @property
    def step_cv(self) -> float | None:
        """The timed steps' coefficient of variation (sample standard deviation over the
        mean); None under two steps."""
        return coefficient_of_variation(self.step_times_s)

    @property
    def usable_bytes(self) -> int | None:
        """The device memory the probe could use: the cap it ran under, else the device's."""
        return usable_bytes(self.device_capacity_bytes, self.device_limit_bytes)

    @property
    def fixed_cost_s(self) -> float | None:
        """Seconds before the first step: process start, imports and model build."""
        if self.startup_s is None or self.build_s is None:
            return None
        return self.startup_s + self.build_s

    def replace(self, **changes: Any) -> ProbeResult:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_dict(self) -> JsonObject:
        """Every field as JSON holds it (the status as its value)."""
        data: JsonObject = dataclasses.asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, text: str) -> ProbeResult:
        return cls.from_dict(json_object(text))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProbeResult:
        """The result `to_dict` gave; fields another version added are left out. TypeError,
        KeyError or ValueError for one that is not whole (no status, or an unknown one)."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in data.items() if k in known}
        given["status"] = ProbeStatus(data["status"])
        return cls(**given)
