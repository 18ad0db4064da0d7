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
from dataclasses import dataclass

from autotune.config import Knobs, ProbeConfig, format_bytes
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
    gpu_from_name: bool  # the GPU named by the device; else taken from the capacity
    colocated_step_s: float
    colocated_tokens_per_s_per_gpu: float
    colocated: ProbeConfig
    best: SplitOption | None  # None: no split fits the budget
    tried: int  # splits of the run's GPUs (1 to W - 1 for the engine)
    fitting: int  # of them, those with knobs the rules allow within the budget on both roles

    @property
    def ratio(self) -> float | None:
        """The best split's tokens/s over the colocated config's."""
        if self.best is None:
            return None
        return self.best.tokens_per_s_per_gpu / self.colocated_tokens_per_s_per_gpu

    def as_dict(self) -> JsonObject:
        best = self.best
        return {"gpu": self.hardware.gpu.name, "gpu_from_name": self.gpu_from_name,
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
        gpu = self.hardware.gpu.name + ("" if self.gpu_from_name else
                                        ", taken from the capacity")
        lines = [f"split placement, from the models (step time: EasyR1's published H100 "
                 f"baselines, on {self.hardware.gpus} x {gpu}; tokens/s over all GPUs):",
                 f"  colocated, as given: {self.colocated_tokens_per_s_per_gpu:,.0f} "
                 f"tokens/s/GPU, step {self.colocated_step_s:.1f} s"]
        best = self.best
        if best is None:
            return lines + [f"  no split of the {self.tried + 1} GPUs fits the "
                            f"{format_bytes(budget_bytes)} budget, whatever its memory knobs"]
        step, config = best.step, best.config
        changes = ", ".join(f"{k}={v}" for k, v in best.changes(self.colocated).items())
        waits = "taking turns" if not step.overlapped else \
            f"the {step.waiting_side} waits {step.idle_s:.{0 if step.idle_s >= 10 else 1}f} s"
        assert self.ratio is not None
        lines += [f"  best split: {config.rollout_gpus} engine + "
                  f"{self.hardware.gpus - config.rollout_gpus} trainer GPUs, staleness "
                  f"{config.staleness}" + (f", {changes}" if changes else "") +
                  f": {best.tokens_per_s_per_gpu:,.0f} tokens/s/GPU (x{self.ratio:.2f}), "
                  f"step {step.step_s:.1f} s [engine {step.engine_s:.0f} s, trainer "
                  f"{step.trainer_s:.0f} s, sync {step.sync_s:.2f} s: {waits}]",
                  f"  its GPUs: engine {format_bytes(best.engine_peak_bytes)}, trainer "
                  f"{format_bytes(best.trainer_peak_bytes)} of the "
                  f"{format_bytes(budget_bytes)} budget; {self.fitting} of {self.tried} "
                  "splits fit; "
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


def best_split(shape: ModelShape, config: ProbeConfig, hardware: Hardware, gpu_from_name: bool,
               budget_bytes: int, on_gpu: bool = True, compute_bytes: int | None = None,
               times: TimeModel | None = None) -> SplitAnswer:
    """The fastest split of a colocated `config` on `hardware` within `budget_bytes` a GPU on
    both roles, by the time model, against the colocated config's modelled step.

    For each split of the GPUs each side's fastest knobs that fit are chosen apart (a side's
    memory and time read only its own knobs, and the step grows with each side's time): the
    engine's first, with the trainer's as given, then the trainer's beside them, each side's
    variants tried fastest first until one fits (a split whose leanest trainer does not fit
    is passed over at once: the memory model's sketch of the allocator takes tens of
    milliseconds a config); then each staleness."""
    times = times or TimeModel.calibrated()
    colocated_s = times.step_s(config, shape, hardware)
    base = config.replace(placement="separate")
    options, splits = [], 0

    def role_peak(config: ProbeConfig, gpus: int, role: str) -> int:
        return role_peak_bytes(shape, config, hardware.gpus, gpus, hardware.capacity_bytes,
                               role, on_gpu, compute_bytes)

    for gpus in range(1, hardware.gpus):
        def first_fitting(variants: list[Knobs], role: str, on: ProbeConfig,
                          gpus: int = gpus) -> tuple[int, ProbeConfig] | None:
            valid = [c for c in (on.replace(**v) for v in variants)
                     if not validate_probe_config(c, hardware.gpus)]
            if not valid:
                return None
            if role == "trainer" and role_peak(valid[0], gpus, role) > budget_bytes:
                return None  # nothing fits if the leanest does not
            over: list[ProbeConfig] = []  # a variant holding as much as one of these is over
            for candidate in sorted(valid, key=lambda c: getattr(
                    side_step(times, c, shape, hardware), f"{role}_s")):
                if any(holds_at_least(candidate, o) for o in over):
                    continue
                peak = role_peak(candidate, gpus, role)
                if peak <= budget_bytes:
                    return peak, candidate
                over.append(candidate)
            return None

        split = base.replace(rollout_gpus=gpus, staleness=max(STALENESS))
        engine = first_fitting(engine_variants(config), "engine", split)
        trainer = first_fitting(trainer_variants(config), "trainer", engine[1]) \
            if engine else None
        if engine is None or trainer is None:
            continue
        splits += 1
        for staleness in STALENESS:
            candidate = trainer[1].replace(staleness=staleness)
            step = side_step(times, candidate, shape, hardware)
            options.append(SplitOption(candidate, engine[0], trainer[0], step,
                                       times.step_tokens(candidate) / step.step_s
                                       / hardware.gpus))
    best = max(options, key=lambda o: o.tokens_per_s_per_gpu, default=None)
    return SplitAnswer(hardware, gpu_from_name, colocated_s,
                       times.step_tokens(config) / colocated_s / hardware.gpus, config, best,
                       hardware.gpus - 1, splits)


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
