"""What the best split would give a colocated config, from the models alone (issue 68): the
engine on GPUs of its own (placement=separate), searched over the split, the staleness and
the engine's own knobs, each split's memory from memory/roles.py and its step from the time
model (throughput.py), against the colocated config's step from the same time model.

Each side's own knobs are searched for each split: the engine's utilisation and tensor
parallel (it holds no trainer states), the trainer's checkpointing, offloads and
micro-batches (with GPUs to itself it may not need the offloads; on fewer GPUs it may need
checkpointing); the rest is the config's. A sweep over `rollout_gpus` measures what this only
models. Pure arithmetic.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from autotune.config import Knobs, ProbeConfig, Topology, format_bytes
from autotune.config.pipeline import PipelineStep, pipeline_step
from autotune.config.rules import validate_probe_config
from autotune.config.schema import SYNC_PHASE
from autotune.estimates.throughput import Hardware, TimeModel
from autotune.files import JsonObject
from autotune.memory.roles import role_peak_bytes
from autotune.memory.shape import ModelShape

ENGINE_UTILISATIONS = (0.6, 0.75, 0.9)  # an engine alone on its GPU: vLLM's 0.9 and below
STALENESS = (0, 1)  # 2+ runs at staleness 1's pace in a steady state (config/pipeline.py)
ENGINE_TENSOR_PARALLEL = (1, 2, 4, 8)
TrainerRules = Callable[[ProbeConfig, Topology], list[str]]


@dataclass(frozen=True)
class SplitOption:
    """One split of the run: its config, each role's peak per GPU and its modelled step."""

    config: ProbeConfig
    engine_peak_bytes: int
    trainer_peak_bytes: int
    step: PipelineStep
    tokens_per_s_per_gpu: float

    def changes(self, colocated: ProbeConfig) -> Knobs:
        """The knobs this split sets beside placement, rollout_gpus and staleness."""
        return {k: v for k, v in self.config.as_dict().items()
                if v != colocated.as_dict().get(k)
                and k not in ("placement", "rollout_gpus", "staleness")}


@dataclass(frozen=True)
class SplitAnswer:
    """The colocated config's modelled step against the fastest split that fits the budget."""

    hardware: Hardware
    gpu_how: str  # how the GPU was known: named (the device's name), its memory, or assumed
    colocated_step_s: float
    colocated_tokens_per_s_per_gpu: float
    colocated: ProbeConfig
    options: tuple[SplitOption, ...]  # each split that fits, at each staleness its rules allow
    tried: int  # splits the run's nodes and the rules allow (some knobs of both sides pass)
    fitting: int  # of them, those within the budget on both roles

    @property
    def best(self) -> SplitOption | None:
        """The fastest option (None: no split fits the budget)."""
        return max(self.options, key=lambda o: o.tokens_per_s_per_gpu, default=None)

    @property
    def ratio(self) -> float | None:
        """The best split's tokens/s over the colocated config's."""
        if self.best is None:
            return None
        return self.best.tokens_per_s_per_gpu / self.colocated_tokens_per_s_per_gpu

    def as_dict(self) -> JsonObject:
        best = self.best
        return {"gpu": self.hardware.gpu.name, "gpu_how": self.gpu_how,
                "colocated_step_s": round(self.colocated_step_s, 2),
                "colocated_tokens_per_s_per_gpu": round(self.colocated_tokens_per_s_per_gpu, 1),
                "splits_tried": self.tried, "splits_fitting": self.fitting,
                "best": None if best is None else {
                    "rollout_gpus": best.config.rollout_gpus,
                    "staleness": best.config.staleness,
                    "changes": best.changes(self.colocated),
                    "step_s": round(best.step.step_s, 2),
                    "engine_s": round(best.step.engine_s, 2),
                    "trainer_s": round(best.step.trainer_s, 2),
                    "sync_s": round(best.step.sync_s, 3),
                    "tokens_per_s_per_gpu": round(best.tokens_per_s_per_gpu, 1),
                    "engine_peak_bytes": best.engine_peak_bytes,
                    "trainer_peak_bytes": best.trainer_peak_bytes}}

    def lines(self, budget_bytes: int) -> list[str]:
        """What `estimate` prints under a colocated config's memory."""
        gpu = self.hardware.gpu.name + {"named": "", "memory": ", taken from the capacity"}.get(
            self.gpu_how, ", assumed: no GPU known by that name or memory")
        lines = [f"split placement, from the models (step time: EasyR1's published H100 "
                 f"baselines, on {self.hardware.gpus} x {gpu}; tokens/s over all GPUs):",
                 f"  colocated, as given: {self.colocated_tokens_per_s_per_gpu:,.0f} "
                 f"tokens/s/GPU, step {self.colocated_step_s:.1f} s"]
        best = self.best
        if best is None:
            return lines + [f"  no split fits the {format_bytes(budget_bytes)} budget, whatever "
                            f"its memory knobs ({self.tried} the run's nodes and the rules "
                            "allow)"]
        step, config = best.step, best.config
        changes = ", ".join(f"{k}={v}" for k, v in best.changes(self.colocated).items())
        waits = "taking turns" if not step.overlapped else \
            f"the {step.waiting_side} waits {step.idle_s:.{0 if step.idle_s >= 10 else 1}f} s"
        assert self.ratio is not None
        lines += [f"  best split: {config.rollout_gpus} engine + "
                  f"{self.hardware.gpus - config.rollout_gpus} trainer GPUs, staleness "
                  f"{config.staleness}" + (f", {changes}" if changes else "") +
                  f": {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU (x{self.ratio:.2f}"
                  + (": slower than colocated" if self.ratio < 1 else "") + "), "
                  f"step {step.step_s:.1f} s [engine {step.engine_s:.0f} s, trainer "
                  f"{step.trainer_s:.0f} s, sync {step.sync_s:.2f} s: {waits}]",
                  f"  its GPUs: engine {format_bytes(best.engine_peak_bytes)}, trainer "
                  f"{format_bytes(best.trainer_peak_bytes)} of the "
                  f"{format_bytes(budget_bytes)} budget; {self.fitting} of the {self.tried} "
                  "splits the run's nodes and the rules allow fit; "
                  "`--set placement=separate --set rollout_gpus=N` sizes one, a sweep over "
                  "rollout_gpus measures them"]
        return lines


def engine_variants(config: ProbeConfig) -> list[Knobs]:
    """The engine's own knobs a split may set: its utilisation (it holds no trainer states)
    and tensor parallel (checked against its GPUs by the rules)."""
    utilisations = sorted({config.gpu_memory_utilization, *ENGINE_UTILISATIONS})
    return [{"gpu_memory_utilization": u, "rollout_tensor_parallel": tp}
            for u, tp in itertools.product(utilisations, ENGINE_TENSOR_PARALLEL)]


def trainer_variants(config: ProbeConfig) -> list[Knobs]:
    """The trainer's memory knobs a split may set: checkpointing as given or on, each offload
    on or off, each micro-batch from 1 to twice the config's in powers of two (token budgets
    as given: the time model reads micro-batches). The first is the leanest."""
    def sizes(size: int) -> list[int]:
        return sorted({2 * size, size, *(size >> k for k in range(1, size.bit_length()))})

    budgets = config.max_token_len_update or config.max_token_len_experience
    updates = [config.micro_batch_size_update] if budgets else \
        sizes(config.micro_batch_size_update)
    experiences = [config.micro_batch_size_experience] if budgets else \
        sizes(config.micro_batch_size_experience)
    return [{"gradient_checkpointing": ckpt, "offload_params": params,
             "offload_optimizer": optimizer, "micro_batch_size_update": update,
             "micro_batch_size_experience": experience}
            for ckpt, params, optimizer, update, experience in itertools.product(
                sorted({config.gradient_checkpointing, True}, reverse=True), (True, False),
                (True, False), updates, experiences)]


def best_split(shape: ModelShape, config: ProbeConfig, hardware: Hardware, gpu_how: str,
               budget_bytes: int, topology: Topology, on_gpu: bool = True,
               compute_bytes: int | None = None, times: TimeModel | None = None,
               trainer_rules: TrainerRules | None = None) -> SplitAnswer:
    """The fastest split of a colocated `config` of the run `topology` on `hardware` within
    `budget_bytes` a GPU on both roles, by the time model, against the colocated config's
    modelled step. `trainer_rules` (config, the trainer's GPUs) -> problems: the target
    trainer's own (its recipes' staleness, replica and batch rules).

    Each split the run's nodes allow (whole nodes of a multi-node run) is sized apart: each
    side's fastest knobs that fit (a side's memory and time read only its own knobs, and the
    step grows with each side's time), the engine's first, with the trainer's as given, then
    the trainer's beside them, each side's variants tried fastest first until one fits; a
    split whose leanest trainer does not fit is passed over at once, and a trainer variant
    holding at least as much as one over the budget is not sized (the memory model's sketch
    of the allocator takes tens of milliseconds a config); then each staleness."""
    times = times or TimeModel.calibrated()
    colocated_s = times.step_s(config, shape, hardware)
    base = config.replace(placement="separate")
    options: list[SplitOption] = []
    allowed_splits = fitting_splits = 0

    for gpus in range(1, hardware.gpus):
        trainers = topology.without_engine(gpus)
        if trainers is None:
            continue

        def allowed(candidate: ProbeConfig, trainers: Topology = trainers) -> bool:
            return not validate_probe_config(candidate, hardware.gpus) and not (
                trainer_rules and trainer_rules(candidate, trainers))

        def peak(candidate: ProbeConfig, role: str, gpus: int = gpus) -> int:
            return role_peak_bytes(shape, candidate, hardware.gpus, gpus,
                                   hardware.capacity_bytes, role, on_gpu, compute_bytes)

        def fastest(valid: list[ProbeConfig], role: str) -> tuple[int, ProbeConfig] | None:
            over: list[ProbeConfig] = []  # trainer variants over the budget
            for candidate in sorted(valid, key=lambda option: getattr(
                    side_step(times, option, shape, hardware), f"{role}_s")):
                if role == "trainer" and any(holds_at_least(candidate, o) for o in over):
                    continue
                held = peak(candidate, role)
                if held <= budget_bytes:
                    return held, candidate
                over.append(candidate)
            return None

        split = base.replace(rollout_gpus=gpus, staleness=max(STALENESS))
        engines = [c for c in (split.replace(**v) for v in engine_variants(config))
                   if allowed(c)]
        engine = fastest(engines, "engine") if engines else None
        on = engine[1] if engine else split
        trained = [c for c in (on.replace(**v) for v in trainer_variants(config)) if allowed(c)]
        allowed_splits += bool(engines and trained)
        if engine is None or not trained or peak(trained[0], "trainer") > budget_bytes:
            continue  # nothing fits if the leanest trainer does not
        trainer = fastest(trained, "trainer")
        if trainer is None:
            continue
        fitting_splits += 1
        for staleness in STALENESS:
            candidate = trainer[1].replace(staleness=staleness)
            if not allowed(candidate):
                continue
            step = side_step(times, candidate, shape, hardware)
            options.append(SplitOption(candidate, engine[0], trainer[0], step,
                                       times.step_tokens(candidate) / step.step_s
                                       / hardware.gpus))
    return SplitAnswer(hardware, gpu_how, colocated_s,
                       times.step_tokens(config) / colocated_s / hardware.gpus, config,
                       tuple(options), allowed_splits, fitting_splits)


def holds_at_least(config: ProbeConfig, than: ProbeConfig) -> bool:
    """Whether `config` holds at least as much as `than` on the trainer's GPU by its memory
    knobs alone: checkpointing and each offload no more on, each micro-batch no smaller (the
    allocator's reserve aside: a fragmentation figure is no order along an axis)."""
    return (config.gradient_checkpointing <= than.gradient_checkpointing
            and config.offload_params <= than.offload_params
            and config.offload_optimizer <= than.offload_optimizer
            and config.micro_batch_size_update >= than.micro_batch_size_update
            and config.micro_batch_size_experience >= than.micro_batch_size_experience)


def side_step(times: TimeModel, config: ProbeConfig, shape: ModelShape, hardware: Hardware
              ) -> PipelineStep:
    """A separate config's step by the time model: each side's seconds and the sync's."""
    phase_s = times.phase_seconds(config, shape, hardware)
    return pipeline_step({**phase_s, SYNC_PHASE: times.sync_s(config, shape)}, config.staleness)
