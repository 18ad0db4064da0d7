"""`estimate`: the memory model's answer for one config of a run, before any probe runs, as a
typed object (the CLI prints it, a notebook reads it).

The per-phase peaks per GPU (calibrated on a study's probes where one is given), the length
headroom, the node's host memory, the constraint the config is closest to, what each memory
switch would save, the trainer's own figures and, with `trace`, the probe's step traced with
fake tensors beside the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from autotune.config import (
    DEFAULT_HEADROOM,
    DTYPE_BYTES,
    Knobs,
    ProbeConfig,
    Topology,
    budget_bytes,
    compute_dtype,
)
from autotune.errors import ConfigError
from autotune.estimates.planning import EstimatePlan, plan_estimate
from autotune.estimates.split import SplitAnswer, best_split
from autotune.estimates.throughput import Hardware, gpu_spec
from autotune.estimates.tracing import (
    TracedEstimate,
    bisection_traces,
    length_step,
    run_trace,
    traced_headroom,
    traced_length,
)
from autotune.files import JsonObject
from autotune.hardware import gpu_capacity_bytes, gpu_name
from autotune.memory.host import NodeHost, format_node_host
from autotune.memory.length import LengthHeadroom, length_headroom
from autotune.memory.model import MemoryEstimate, ModelArgs, allocator_reserve, estimate_memory
from autotune.memory.roles import PlacementEstimate, estimate_placement, format_placement
from autotune.memory.trainer_figures import TrainerFigure, trainer_figures
from autotune.memory.verdict import (
    fitting_changes,
    format_estimate,
    format_fitting_changes,
    format_savings,
    format_traced,
    phase_totals,
    switch_savings,
)
from autotune.sweep.feasibility.prescreen import memory_model_args
from autotune.sweep.plan import ProbeOptions


@dataclass(frozen=True)
class Budgeted:
    """An answer for one planned config under a headroom: what a GPU may use."""

    plan: EstimatePlan
    headroom: float

    @property
    def budget_bytes(self) -> int:
        """What a GPU may use under the headroom."""
        budget = budget_bytes(self.plan.capacity_bytes, self.headroom)
        assert budget is not None
        return budget


@dataclass(frozen=True)
class Estimate(Budgeted):
    """The answer for one planned config (`plan`): every figure `autotune estimate` prints."""

    model_args: ModelArgs  # what the memory model was asked with (the allocator's reserve held)
    memory: MemoryEstimate  # the model's terms per phase
    phase_bytes: dict[str, int]  # each phase's total per GPU (calibrated where there is one)
    length: LengthHeadroom
    node_host: NodeHost
    binding_constraint: str
    switch_savings: dict[str, dict[str, int]]
    fitting_changes: list[tuple[Knobs, int]]  # what would bring an over-budget config within
    trainer_figures: list[TrainerFigure] = field(default_factory=list)
    traced: TracedEstimate | None = None
    traced_fits_up_to: int | None = None  # tokens; None: not traced
    traced_bisected: bool = False  # the traced headroom bisected by traces, not the model's
    split: SplitAnswer | None = None  # the best split's modelled step (GPU runs of W >= 2)

    def as_dict(self) -> JsonObject:
        """The --json document."""
        request, host, config = self.plan.request, self.node_host, self.plan.request.config
        node: JsonObject = {
            "phase_bytes": {p: host.total(p) for p in host.phases}, "terms": host.phases,
            "host_bytes": host.host_bytes, "threshold": host.threshold,
            "kill_bytes": host.kill_bytes, "rank_bytes": host.rank_bytes,
            "host_oom": host.host_oom}
        report: JsonObject = {
            "model": self.plan.name, "num_params": self.plan.shape.num_params,
            "world_size": request.world_size, "device": request.device.kind,
            "capacity_bytes": self.plan.capacity_bytes, "phase_bytes": dict(self.phase_bytes),
            "algorithm": config.algorithm,
            "critic_phase_bytes": {p: self.memory.critic_bytes(p) for p in self.memory.phases}
            if config.has_critic else {},
            "host_offload_bytes": self.memory.host_offload_bytes,
            "response_tokens": config.max_response_length,
            "length_headroom": self.length.as_dict(),
            "node_host": node, "binding_constraint": self.binding_constraint,
            "switch_savings": self.switch_savings,
            "fitting_changes": [{"changes": changes, "peak_bytes": at}
                                for changes, at in self.fitting_changes],
            "trainer_figures": {f.metric: {"label": f.label, "bytes": f.value_bytes,
                                           "gib": round(f.value_gib, 2), "how": f.how}
                                for f in self.trainer_figures}}
        if self.traced is not None:
            report["traced"] = {**self.traced.as_dict(),
                                "fits_up_to_response_tokens": self.traced_fits_up_to}
        if self.split is not None:
            report["split"] = self.split.as_dict()
        return report

    def text(self) -> str:
        """What `autotune estimate` prints: the model's table, the length headroom, the
        switches, the node's host memory, the binding constraint, the trainer's figures and
        the trace."""
        plan, request = self.plan, self.plan.request
        lines = [format_estimate(plan.name, plan.shape, request.config, plan.capacity_bytes,
                                 self.headroom, plan.calibration, plan.note, **self.model_args),
                 f"length headroom: {self.length.describe('on this card')} (memory model, "
                 "everything else held)", *format_savings(self.switch_savings),
                 *format_fitting_changes(self.fitting_changes), "",
                 format_node_host(self.node_host, request.gpus_per_node),
                 self.binding_constraint]
        if self.trainer_figures:
            lines += ["", f"{plan.trainer}'s own figures, as it logs them (GiB, the mean over "
                          "ranks):"]
            lines += [f"  {f.metric} ({f.label}): {f.value_gib:.1f} ({f.how})"
                      for f in self.trainer_figures]
        if self.split is not None:
            lines += ["", *self.split.lines(self.budget_bytes)]
        if self.traced is not None:
            lines += ["", self.traced_text()]
        return "\n".join(lines)

    def traced_text(self) -> str:
        """The trace's table beside the model's, and its length headroom."""
        traced, world = self.traced, self.plan.request.world_size
        assert traced is not None
        what = (f"the probe's own step as rank 0 of {world} under fake tensors, build and 2 "
                f"steps in {traced.trace_s:.1f} s")
        step = length_step(self.length.searched_to)
        how = (f"trace bisection, to {step} tokens" if self.traced_bisected else
               "the memory model's growth with the length from the traced peaks; "
               "--bisect-length traces it")
        reach = (f"traced length headroom: fits up to {self.traced_fits_up_to:,}-token "
                 f"responses within the budget ({how})"
                 if self.traced_fits_up_to else "traced length headroom: not even "
                 f"{step if self.traced_bisected else 1}-token responses fit within the "
                 f"budget ({how})")
        return "\n".join([format_traced(
            traced.phase_peak_mem_bytes, traced.phase_context_bytes, traced.context_note,
            self.phase_bytes, self.plan.capacity_bytes, self.headroom,
            traced.host_offload_bytes, what, traced.phase_tensor_bytes,
            traced.fits_under_bytes), reach])


def estimate(options: ProbeOptions, capacity_bytes: int | None = None,
             headroom: float = DEFAULT_HEADROOM, study: str | None = None,
             results_dir: str = "results", storage: str | None = None,
             response_length: int | None = None, host_memory_bytes: int | None = None,
             trainer: str | None = None, trace: bool = False, bisect_length: bool = False,
             say: Callable[[str], None] = lambda line: None) -> Estimate | PlacementAnswer:
    """The memory model's answer for the run `options` describe, on a device of
    `capacity_bytes` (default: this machine's GPU, else 80 GiB; host RAM on a CPU), under
    `headroom`; with `study`, calibrated on its probes (estimates/planning.py says how the run
    is planned). `trace` also traces the probe's step with fake tensors (torch is imported;
    `say` hears what is being traced); its length headroom comes from that one trace and the
    model, or with `bisect_length` from a bisection of further traces.

    Raises:
        ConfigError: no model, a study without a calibration or of another model, or a config
            that breaks a rule.
    """
    plan = plan_estimate(options, capacity_bytes, study, results_dir, storage, response_length,
                         host_memory_bytes, trainer)
    request = plan.request
    if request.config.separate:
        return estimate_separate(plan, headroom, trace)
    model_args = memory_model_args(request)
    # the allocator's reserve at this config, held while the searches move one knob (a
    # length, a micro-batch); a switch's saving is two configs', each with its own
    held: ModelArgs = {**model_args,
                       "reserve_bytes": allocator_reserve(plan.shape, request.config,
                                                          **model_args)}
    memory = estimate_memory(plan.shape, request.config, **held)
    totals = phase_totals(memory, plan.calibration)
    budget = budget_bytes(plan.capacity_bytes, headroom)
    assert budget is not None

    def peaks(config: ProbeConfig) -> dict[str, int]:
        return phase_totals(estimate_memory(plan.shape, config, **held), plan.calibration)

    reach = length_headroom(request.config, peaks, budget, plan.shape.context_tokens,
                            request.world_size)
    host = plan.node_host()
    if trace and bisect_length:
        say(f"--bisect-length: after the trace, up to {bisection_traces(reach.searched_to)} "
            "more traces of about as long each")
    traced = run_trace(plan, say) if trace else None
    traced_reach = None
    if traced is not None:
        traced_reach = traced_length(plan, traced, budget, reach, say) if bisect_length \
            else traced_headroom(plan, traced, peaks, budget)
    return Estimate(
        plan=plan, headroom=headroom, model_args=held, memory=memory, phase_bytes=totals,
        length=reach, node_host=host,
        binding_constraint=plan.binding_constraint(max(totals.values()), host, headroom),
        switch_savings=switch_savings(plan.shape, request.config, plan.calibration,
                                      **model_args),
        fitting_changes=fitting_changes(plan.shape, request.config, budget, plan.calibration,
                                        **model_args),
        trainer_figures=trainer_figures(plan.trainer, memory, host)
        if request.device.on_gpu else [],
        traced=traced, traced_fits_up_to=traced_reach, traced_bisected=bisect_length,
        split=split_answer(plan, budget))


def split_answer(plan: EstimatePlan, budget_bytes: int) -> SplitAnswer | None:
    """For a colocated GRPO config of a GPU run of 2 or more GPUs with a served engine, what
    the best split would give (split.py), within the target trainer's rules; None elsewhere
    (EasyR1 has no separate placement; the time model has no critic, so not for PPO)."""
    from autotune.trainers import get_adapter

    request = plan.request
    config = request.config
    if not request.device.on_gpu or request.world_size < 2 or not config.engine_reserves \
            or config.has_critic or plan.trainer == "easyr1":
        return None
    name = gpu_name() if gpu_capacity_bytes() == plan.capacity_bytes else None
    spec, how = gpu_spec(name, plan.capacity_bytes)
    adapter = get_adapter(plan.trainer) if plan.trainer else None
    return best_split(plan.shape, config, Hardware(spec, request.world_size,
                                                   plan.capacity_bytes),
                      how, budget_bytes, Topology(request.nnodes, request.gpus_per_node),
                      compute_bytes=memory_model_args(request)["compute_bytes"],
                      trainer_rules=adapter.check if adapter else None)


@dataclass(frozen=True)
class PlacementAnswer(Budgeted):
    """The answer for a config whose engine has GPUs of its own: each role's GPU."""

    placed: PlacementEstimate
    compute: str  # the compute dtype

    def as_dict(self) -> JsonObject:
        """The --json document: each role's phases per GPU and which binds."""
        request, placed = self.plan.request, self.placed
        roles: JsonObject = {
            role: {"gpus": gpus, "phase_bytes": {p: e.total_bytes
                                                 for p, e in memory.phases.items()},
                   "terms": {p: dict(e.parts) for p, e in memory.phases.items()},
                   "peak_bytes": memory.peak_bytes,
                   "host_offload_bytes": memory.host_offload_bytes}
            for role, memory, gpus in (("engine", placed.engine, placed.rollout_gpus),
                                       ("trainer", placed.trainer, placed.trainer_gpus))}
        return {"model": self.plan.name, "num_params": self.plan.shape.num_params,
                "world_size": request.world_size, "device": request.device.kind,
                "capacity_bytes": self.plan.capacity_bytes, "budget_bytes": self.budget_bytes,
                "placement": "separate", "roles": roles, "binding_role": placed.binding_role}

    def text(self) -> str:
        return format_placement(self.plan.name, self.plan.shape, self.plan.request.config,
                                self.placed, self.plan.capacity_bytes, self.budget_bytes,
                                self.headroom, self.compute)


def estimate_separate(plan: EstimatePlan, headroom: float, trace: bool) -> PlacementAnswer:
    """The memory model's answer for each role of a separate placement (memory/roles.py);
    the length headroom, the switches, the node's host memory and the trace are the
    colocated answer's so far."""
    if trace:
        raise ConfigError("--trace with placement=separate: the trace follows the colocated "
                          "step only so far (a split probe measures each side, on a CPU: "
                          "`autotune probe --set placement=separate ...`); drop --trace")
    request = plan.request
    args = memory_model_args(request)
    width = args.get("compute_bytes") or DTYPE_BYTES[compute_dtype("auto",
                                                                   request.device.on_gpu)]
    placed = estimate_placement(plan.shape, request.config, request.world_size,
                                request.config.rollout_gpus, plan.capacity_bytes,
                                on_gpu=request.device.on_gpu, compute_bytes=width)
    compute = next(dtype for dtype, size in DTYPE_BYTES.items() if size == width)
    return PlacementAnswer(plan, headroom, placed, compute)
