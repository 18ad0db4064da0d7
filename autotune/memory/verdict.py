"""The memory model's answer for one config as people read it: the per-phase table, the
phase that binds, and the largest micro-batches that fit (the node's host memory is
memory/host.py's).

Pure arithmetic over memory/model.py (and a calibration when a study has one): no torch.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from autotune.batching import BUDGET_KNOB, MICRO_KNOB
from autotune.config import (
    DTYPE_BYTES,
    Knobs,
    ProbeConfig,
    budget_bytes,
    compute_bytes,
    format_bytes,
    sequence_parallel_problems,
)
from autotune.memory.calibration import Calibration
from autotune.memory.model import MemoryEstimate, ModelArgs, estimate_memory
from autotune.memory.shape import ModelShape

if TYPE_CHECKING:
    from typing_extensions import Unpack

MAX_MICRO_BATCH = 1 << 16
PHASE_COLUMN = 15  # the widest phase name, critic_update, and two spaces
DTYPE_OF_WIDTH = {width: dtype for dtype, width in DTYPE_BYTES.items()}


def headroom_budget(capacity_bytes: int, headroom: float) -> int:
    """The budget `headroom` leaves of a known capacity (config.budget_bytes)."""
    budget = budget_bytes(capacity_bytes, headroom)
    assert budget is not None  # a known capacity always leaves one
    return budget


def phase_totals(estimate: MemoryEstimate, calibration: Calibration | None) -> dict[str, int]:
    if calibration is None:
        return {name: p.total_bytes for name, p in estimate.phases.items()}
    return calibration.phase_bytes(estimate)


# the memory switches `estimate` weighs for a config that has them off: the logits' and the
# entropy's (the entropy's change a phase only where the config takes an entropy:
# entropy_metric in experience, entropy_coeff in the update, where chunks kept for the
# backward cost one more fp32 copy than the whole)
SAVING_SWITCHES = ("fused_logprob", "entropy_chunking", "entropy_checkpointing")


def switch_savings(shape: ModelShape, config: ProbeConfig, calibration: Calibration | None,
                   **model_args: Unpack[ModelArgs]) -> dict[str, dict[str, int]]:
    """Per switch of SAVING_SWITCHES that `config` has off: what turning it on would take
    off each phase's total (negative where it adds; the phases it changes; a switch that
    changes none is left out)."""
    now = phase_totals(estimate_memory(shape, config, **model_args), calibration)
    savings = {}
    for switch in SAVING_SWITCHES:
        if getattr(config, switch):
            continue
        on = phase_totals(estimate_memory(shape, config.replace(**{switch: True}),
                                          **model_args), calibration)
        saved = {phase: now[phase] - on[phase] for phase in now if now[phase] != on[phase]}
        if saved:
            savings[switch] = saved
    return savings


def fitting_changes(shape: ModelShape, config: ProbeConfig, budget: int,
                    calibration: Calibration | None, **model_args: Unpack[ModelArgs]
                    ) -> list[tuple[Knobs, int]]:
    """For a config whose peak is over `budget`: the changes that would bring it within,
    with the peak each gives (memory model), fewest changes first: each of LoRA (rank 64),
    Ulysses sequence parallelism (each size the run's GPUs and the model's heads allow),
    gradient checkpointing and fused_logprob alone, then in pairs. Empty when it fits, or
    when nothing here would make it."""
    def peak(changes: Knobs) -> int:
        return max(phase_totals(estimate_memory(shape, config.replace(**changes),
                                                **model_args), calibration).values())

    if peak({}) <= budget:
        return []
    world = model_args.get("num_gpus", 1)
    options: list[Knobs] = [{"lora_rank": 64}] if not config.uses_lora else []
    options += [{"ulysses_sequence_parallel_size": sp} for sp in range(2, world + 1)
                if not world % sp and sp > config.ulysses_sequence_parallel_size
                and not sequence_parallel_problems(sp, shape.heads, shape.kv_heads)
                and not shape.is_vl and not config.has_critic and not config.fused_logprob]
    options += [{k: True} for k in ("gradient_checkpointing", "fused_logprob")
                if not getattr(config, k)]
    for size in (1, 2):
        found = []
        for picked in itertools.combinations(options, size):
            changes: Knobs = {k: v for option in picked for k, v in option.items()}
            if len(changes) == sum(len(o) for o in picked):  # one value a knob
                if (config.ulysses_sequence_parallel_size > 1
                        or "ulysses_sequence_parallel_size" in changes) \
                        and changes.get("fused_logprob"):
                    continue  # the probe runs SP's log-probs unfused
                if (at := peak(changes)) <= budget:
                    found.append((changes, at))
        if found:
            return sorted(found, key=lambda item: item[1])
    return []


def format_fitting_changes(changes: list[tuple[Knobs, int]]) -> list[str]:
    """One line naming the changes that would fit, each with its peak."""
    if not changes:
        return []
    return ["would fit with: " + "; ".join(
        ", ".join(f"{k}={str(v).lower()}" for k, v in knobs.items())
        + f" (peak {format_bytes(at)})" for knobs, at in changes) + " (memory model)"]


def format_savings(savings: dict[str, dict[str, int]]) -> list[str]:
    """One line per switch: what it would save (or add), phase by phase."""
    return [f"{switch}=true would " + ", ".join(
        f"{'save' if saved > 0 else 'add'} {format_bytes(abs(saved))} in {phase}"
        for phase, saved in by_phase.items()) + " (memory model)"
        for switch, by_phase in savings.items()]


def largest_micro_batch(shape: ModelShape, config: ProbeConfig, knob: str, budget_bytes: int,
                        calibration: Calibration | None,
                        **model_args: Unpack[ModelArgs]) -> tuple[int, int]:
    """The largest value of micro-batch `knob` whose phase fits `budget_bytes` (0: not even
    1), searched past the batch, and how many responses the batch gives one GPU there."""
    share = config.share(model_args.get("num_gpus", 1))
    phase = {micro: phase for phase, micro in MICRO_KNOB.items()}[knob]
    per_gpu = share.responses_per_step if phase == "experience" \
        else share.responses_per_minibatch
    # the critic's micro-batch also cuts its value forwards, in the experience phase
    phases = (phase, "experience") if phase == "critic_update" else (phase,)

    def fits(micro: int) -> bool:  # `micro` full-length responses in the largest micro-batch
        trial = config.replace(dynamic_batching=False, **{knob: micro})
        totals = phase_totals(estimate_memory(shape, trial, **model_args), calibration)
        return all(totals[p] <= budget_bytes for p in phases)

    low, high = 0, MAX_MICRO_BATCH  # memory grows with the micro-batch: bisect
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low, per_gpu


def format_estimate(name: str, shape: ModelShape, config: ProbeConfig, capacity_bytes: int,
                    headroom: float, calibration: Calibration | None, calibration_note: str,
                    **model_args: Unpack[ModelArgs]) -> str:
    estimate = estimate_memory(shape, config, **model_args)
    totals = phase_totals(estimate, calibration)
    budget = headroom_budget(capacity_bytes, headroom)
    binding = max(totals, key=lambda phase: totals[phase])
    num_gpus, on_gpu = model_args.get("num_gpus", 1), model_args.get("on_gpu", True)
    compute = DTYPE_OF_WIDTH[model_args.get("compute_bytes") or compute_bytes("auto", on_gpu)]
    where = (f"{num_gpus} GPU{'s' if num_gpus > 1 else ''} (FSDP)"
             if on_gpu else "the CPU as the device")
    lines = [f"{name}: {shape.num_params / 1e9:.3f}B params, {where}, {compute} compute; "
             f"capacity {format_bytes(capacity_bytes)} per device, budget "
             f"{format_bytes(budget)} at {headroom:.0%} headroom",
             f"memory model: {calibration_note}", "",
             f"{'phase':<{PHASE_COLUMN}}{'model states':>14}{'transient':>12}{'context':>11}"
             f"{'total':>12}"
             f"{'of capacity':>13}"]
    for phase, part in estimate.phases.items():
        transient, context = part.transient_bytes, part.context_bytes
        if calibration is not None:
            transient, context = calibration.split(phase, part)
        mark = "  <- binds" if phase == binding else ""
        lines.append(f"{phase:<{PHASE_COLUMN}}{format_bytes(part.states_bytes):>14}"
                     f"{format_bytes(transient):>12}{format_bytes(context):>11}"
                     f"{format_bytes(totals[phase]):>12}{totals[phase] / capacity_bytes:>12.0%}"
                     f"{mark}")
    terms = ", ".join(f"{k} {format_bytes(v)}" for k, v in estimate.phases[binding].parts.items()
                      if v)
    verdict = "fits" if totals[binding] <= budget else (
        "over the headroom budget" if totals[binding] <= capacity_bytes else "does not fit")
    lines += ["", f"binding phase: {binding} ({verdict}); prior terms: {terms}"]
    if config.has_critic:
        lines.append("critic (ppo), per GPU: " + ", ".join(
            f"{phase} {format_bytes(estimate.critic_bytes(phase))}" for phase in estimate.phases
            if estimate.critic_bytes(phase)) + " (its states, and its activations where it "
            "runs: the value forward in experience, its own update)")
    for phase in config.batched_phases:
        knob = MICRO_KNOB[phase]
        fits, per_gpu = largest_micro_batch(shape, config, knob, budget, calibration,
                                            **model_args)
        what = "per step" if phase == "experience" else "per optimizer step"
        if config.dynamic_batching:
            budget_knob = BUDGET_KNOB[phase]
            tokens = fits * config.sequence_length
            lines.append(f"largest {budget_knob} within the budget: " + (
                f"{tokens:,} tokens ({fits} whole sequences of {config.sequence_length}; the "
                "peak holds whatever lengths the responses reach)" if fits else
                "none, not even one whole sequence fits"))
            continue
        if fits == 0:
            lines.append(f"largest {knob} within the budget: none, even 1 does not fit")
        else:
            usable = max(m for m in range(1, min(fits, per_gpu) + 1) if per_gpu % m == 0)
            lines.append(f"largest {knob} within the budget: {fits} (this batch gives each "
                         f"GPU {per_gpu} responses {what}; largest divisor that fits: "
                         f"{usable})")
    return "\n".join(lines)


def format_traced(traced_phase_bytes: dict[str, int], phase_context_bytes: dict[str, int],
                  context_note: str, model_totals: dict[str, int], capacity_bytes: int,
                  headroom: float, host_offload_bytes: int, what: str,
                  phase_tensor_bytes: dict[str, int] | None = None,
                  fits_under_bytes: int | None = None) -> str:
    """The traced estimate (probe/trace.py) as a table beside the memory model's totals: per
    phase the live tensors, what the caching allocator reserves beyond them (a GPU's, the
    trace's allocations replayed), the fixed term, and their total."""
    budget = headroom_budget(capacity_bytes, headroom)
    binding = max(traced_phase_bytes, key=lambda phase: traced_phase_bytes[phase])
    tensors_of = phase_tensor_bytes or {}
    lines = [f"traced: {what}", "",
             f"{'phase':<{PHASE_COLUMN}}{'tensors':>12}{'allocator':>12}{'fixed term':>12}"
             f"{'total':>12}{'of capacity':>13}"
             f"{'memory model':>14}{'model - traced':>16}"]
    for phase, total in traced_phase_bytes.items():
        model = model_totals.get(phase)
        mark = "  <- binds" if phase == binding else ""
        context_bytes = phase_context_bytes[phase]
        torch_bytes = total - context_bytes
        tensors = tensors_of.get(phase, torch_bytes)
        slack = torch_bytes - tensors
        lines.append(f"{phase:<{PHASE_COLUMN}}{format_bytes(tensors):>12}"
                     f"{format_bytes(slack) if slack else '-':>12}"
                     f"{format_bytes(context_bytes):>12}{format_bytes(total):>12}"
                     f"{total / capacity_bytes:>12.0%}"
                     f"{format_bytes(model) if model else '-':>14}"
                     f"{(model - total) / total if model else 0:>+15.1%}{mark}")
    peak = traced_phase_bytes[binding]
    verdict = "fits" if peak <= budget else (
        "over the headroom budget" if peak <= capacity_bytes else "does not fit")
    lines += ["", f"traced binding phase: {binding} ({verdict}); fixed term: {context_note}"]
    if fits_under_bytes is not None:
        context = max(phase_context_bytes.values())
        lines.append(f"allocator: the peaks are torch's reserve, the trace's allocations "
                     f"replayed through the CUDA caching allocator; under a cap it frees its "
                     f"cache and retries, so the step runs in "
                     f"{format_bytes(fits_under_bytes + context)} at least")
    lines.append(f"host memory for offload and engine sleep (traced): "
                 f"{format_bytes(host_offload_bytes)} per GPU")
    return "\n".join(lines)
