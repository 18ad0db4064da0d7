"""What `autotune estimate` asks the memory model: the run planned as a probe would run it.

The options are a probe's (the model, the device and its limits, the run's topology, the
engine, the dtype, --set) plus the device's size to plan for; with a study, its calibration
(fitted on its probes, one device) and its shapes replace the prior constants and the
defaults. The plan is a ProbeRequest with its Device, so the memory model, the trace and the
verdicts read the capacity as every other command does (hardware.usable_bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autotune.config import (
    DTYPE_BYTES,
    Knobs,
    ProbeConfig,
    algorithm_defaults,
    budget_bytes,
    format_bytes,
    model_problems,
    validate_probe_config,
)
from autotune.errors import ConfigError
from autotune.files import JsonObject
from autotune.hardware import Device, device_kind, gpu_capacity_bytes, host_memory_bytes
from autotune.memory.calibration import Calibration
from autotune.memory.host import NodeHost, NodeRun, node_host
from autotune.memory.shape import ModelShape, model_shape
from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.execution.placement import default_topology
from autotune.sweep.feasibility.prescreen import memory_model_args
from autotune.sweep.plan import (
    ProbeOptions,
    check_memory_flags,
    engine_knobs,
    probe_request,
    trainer_knobs,
)

DEFAULT_GPU_BYTES = 80 * 2**30  # an H100 or A100-80GB, when no NVIDIA GPU is visible here


@dataclass(frozen=True)
class EstimatePlan:
    """One config of a run to estimate: the probe that would measure it, the model's shape,
    the calibration to use (None: the prior) and what it says about its constants."""

    name: str
    shape: ModelShape
    request: ProbeRequest
    calibration: Calibration | None
    note: str
    fitted: JsonObject  # the study's calibration record ({} without --study)
    host_bytes: int = 0  # one node's RAM, for the node's host-memory verdict
    trainer: str | None = None  # whose run holds the node's host memory (None: the probe's)

    def node_host(self) -> NodeHost:
        """The node's host memory for this plan's config (memory/host.py)."""
        request = self.request
        run = NodeRun(request.gpus_per_node, request.world_size, request.device.on_gpu,
                      memory_model_args(request)["compute_bytes"], self.trainer)
        return node_host(self.shape, request.config, run, self.host_bytes)

    def binding_constraint(self, gpu_peak_bytes: int, host: NodeHost, headroom: float) -> str:
        """Which constraint the config is closest to (or past): the GPU's budget, the node's
        RAM where its OOM killer acts (`host`: node_host()), or --host-memory-limit on one
        rank's host memory."""
        budget = budget_bytes(self.capacity_bytes, headroom)
        shares = {f"the GPU's budget ({gpu_peak_bytes / budget:.0%} of "
                  f"{format_bytes(budget)})": gpu_peak_bytes / budget,
                  f"the node's host memory ({host.peak_bytes / host.kill_bytes:.0%} of the "
                  f"{format_bytes(host.kill_bytes)} {host.killer} allows)":
                  host.peak_bytes / host.kill_bytes}
        limit = self.request.host_memory_limit_bytes
        if limit is not None:
            rank = host.rank_bytes
            shares[f"--host-memory-limit on one rank ({rank / limit:.0%} of "
                   f"{format_bytes(limit)})"] = rank / limit
        binding = max(shares, key=lambda name: shares[name])
        past = shares[binding] > 1
        return f"{'past' if past else 'closest'} constraint: {binding}"

    @property
    def fitted_trace(self) -> JsonObject:
        """What the study's traced pre-screen fitted ({} without one)."""
        trace = self.fitted.get("trace") or {}
        assert isinstance(trace, dict)
        return trace

    @property
    def capacity_bytes(self) -> int:
        """What a probe may use of the planned device."""
        usable = self.request.device.usable_bytes
        assert usable is not None
        return usable


def load_calibration(study: str, results_dir: str, storage: str | None
                     ) -> tuple[Calibration, JsonObject]:
    """A study's calibration and what it was fitted for (model, device, dtype, shapes)."""
    from autotune.sweep.study.storage import load_study

    loaded = load_study(results_dir, study, storage)
    stored = loaded.user_attrs.get("memory_calibration")
    if not stored:
        raise ConfigError(f"study {study}: no calibration yet (it needs one successful probe); "
                          "run the sweep first, or leave out --study for the prior")
    identity = loaded.user_attrs.get("identity", {})
    fixed = loaded.user_attrs.get("search_space", {}).get("fixed", {})
    return Calibration.from_dict(stored["phases"]), {
        **stored, "model": identity.get("model"), "model_path": identity.get("model_path"),
        "fixed": fixed}


@dataclass(frozen=True)
class Calibrated:
    """What `--study` gives an estimate: the options on its model, the device kind and dtype
    its probes ran, its calibration, what was fitted, and the note that says so."""

    options: ProbeOptions
    kind: str
    dtype: str
    calibration: Calibration | None
    fitted: JsonObject
    note: str
    fixed: Knobs = field(default_factory=dict)  # the study's shapes


def calibrated_options(options: ProbeOptions, study: str | None, results_dir: str,
                       storage: str | None) -> Calibrated:
    """With `study`: its calibration and the options on its model; without, the prior.

    Raises:
        ConfigError: a study of another model than --model, or --storage without --study.
    """
    if study is None:
        if storage is not None:
            raise ConfigError("--storage: only with --study (the study whose calibration to "
                              "use)")
        return Calibrated(options, device_kind(options.device, gpu_here=True), options.dtype,
                          None, {}, "prior constants (no probe yet; --study S uses a "
                          "calibration)")
    calibration, fitted = load_calibration(study, results_dir, storage)
    if options.model is not None and options.model != fitted["model"]:
        raise ConfigError(f"--study {study} was calibrated on model {fitted['model']}, "
                          f"not {options.model}; leave out --model or pick that model's "
                          "study")
    stored_path = fitted["model_path"]
    options = dataclasses.replace(options, model=str(fitted["model"]),
                                  model_path=options.model_path or (
                                      str(stored_path) if stored_path else None))
    dtype = next(name for name, width in DTYPE_BYTES.items()
                 if width == fitted["compute_bytes"])
    fixed = fitted.get("fixed") or {}
    assert isinstance(fixed, dict)
    return Calibrated(options, "cuda" if fitted["on_gpu"] else "cpu", dtype, calibration,
                      fitted, f"calibrated on {fitted['probes']} probes of study {study} on "
                      f"{fitted['device']}", fixed)


def estimate_config(options: ProbeOptions, fixed: Knobs, on_gpu: bool, trainer: str | None,
                    world: int) -> tuple[ProbeConfig, str]:
    """The config an estimate plans: a study's shapes (`fixed`), the engine's and the trainer's
    defaults where nothing names them, then --set; with W > 1 and no batch given, the default
    batches per GPU times W (and the note that says so)."""
    named = frozenset({*fixed, *options.knobs})
    values = {**fixed, **engine_knobs(options.engine, on_gpu, trainer, named),
              **trainer_knobs(trainer, on_gpu, named),
              **algorithm_defaults({**fixed, **options.knobs}), **options.knobs}
    batches = ("rollout_batch_size", "global_batch_size")
    note = ""
    if world > 1 and not any(k in values for k in batches):  # defaults are one GPU's
        values.update({k: getattr(ProbeConfig(), k) * world for k in batches})
        note = (f"; batches: the defaults per GPU, rollout_batch_size="
                f"{values['rollout_batch_size']} and global_batch_size="
                f"{values['global_batch_size']} over {world} GPUs (--set your run's)")
    return ProbeConfig.from_knobs(values), note


def plan_estimate(options: ProbeOptions, capacity_bytes: int | None = None,
                  study: str | None = None, results_dir: str = "results",
                  storage: str | None = None,
                  response_length: int | None = None, host_bytes: int | None = None,
                  trainer: str | None = None) -> EstimatePlan:
    """The estimate of the options' run: on a GPU of `capacity_bytes` (default: this
    machine's, else 80 GiB) unless --device cpu; with `study`, calibrated on its probes; with
    `response_length`, at responses of that length (the run's max_response_length, checked
    first, is where they may grow to).

    Raises:
        ConfigError: no model, a study without a calibration or of another model, or a config
            that breaks a rule.
    """
    calibrated = calibrated_options(options, study, results_dir, storage)
    options, kind, dtype = calibrated.options, calibrated.kind, calibrated.dtype
    note, fitted = calibrated.note, calibrated.fitted
    if options.model is None and options.model_path is None:
        raise ConfigError("estimate: give --model NAME (see `autotune models`) or "
                          "--model-path DIR")
    name = options.model or options.model_path or ""
    shape = model_shape(options.model or "", options.model_path)
    capacity_given = capacity_bytes is not None
    if capacity_bytes is None:
        capacity_bytes = (gpu_capacity_bytes() or DEFAULT_GPU_BYTES) if kind == "cuda" \
            else host_memory_bytes()
    device = Device(kind, capacity_bytes, options.gpu_memory_limit_bytes,
                    options.reserve_gpu_memory_bytes)
    check_memory_flags(device, "--capacity" if capacity_given else
                       "this GPU's" if gpu_capacity_bytes() else "the default --capacity",
                       options.host_memory_limit_bytes)
    topology = default_topology(options.nnodes, options.gpus_per_node, device, None)
    world = topology.world_size
    config, batches_note = estimate_config(options, calibrated.fixed, device.on_gpu, trainer,
                                           world)
    note += batches_note
    heads = (shape.heads, shape.kv_heads)
    problems = validate_probe_config(config, world) + model_problems(config, shape.is_vl, heads)
    if problems:
        raise ConfigError(problems)
    if response_length is not None:
        if response_length > config.max_response_length:
            raise ConfigError(f"--response-length {response_length}: longer than "
                              f"max_response_length={config.max_response_length}, where the "
                              "run stops responses; --set max_response_length too")
        note += (f"; at {response_length}-token responses (max_response_length="
                 f"{config.max_response_length} is the worst case)")
        config = dataclasses.replace(config, max_response_length=response_length)
    request = probe_request(dataclasses.replace(options, dtype=dtype), options.model or name,
                            device, topology, config, emulated=world > 1, trainer=trainer)
    return EstimatePlan(name, shape, request, calibrated.calibration, note, fitted,
                        host_bytes or host_memory_bytes(), trainer)
