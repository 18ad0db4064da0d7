"""`estimate --trace`: the probe's own step traced with fake tensors in this process, as rank
0 of the run (probe/trace.py), with what a process holds outside torch, and the longest
response length whose traced peak stays in the budget: from the one trace, the memory model's
growth with the length moved onto the traced peaks (traced_headroom), or with
`--bisect-length` a bisection of further traces (traced_length, several times one trace).
Either answer agrees with the trace: at least the traced length when the trace fits the
budget, below it when it does not.

torch is imported inside these functions only: `autotune estimate` without --trace never
loads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from autotune.config import ProbeConfig, format_bytes
from autotune.estimates.planning import EstimatePlan
from autotune.files import JsonObject
from autotune.memory.length import LengthHeadroom, PhasePeaks, length_headroom


@dataclass(frozen=True)
class TracedEstimate:
    """One rank's traced peaks per phase (the fixed term included: each phase's own where a
    study fitted them) and what went into them."""

    phase_peak_mem_bytes: dict[str, int]
    context_bytes: int  # the fixed term the trace ran with
    phase_context_bytes: dict[str, int]  # the fixed term per phase in the peaks
    context_note: str  # where the fixed term comes from, in words
    phase_tensor_bytes: dict[str, int]
    phase_reserved_bytes: dict[str, int]
    fits_under_bytes: int | None
    allocator: dict[str, bool]
    host_offload_bytes: int
    trace_s: float

    def as_dict(self) -> JsonObject:
        """The --json document's `traced` block (without its length)."""
        return {
            "phase_peak_mem_bytes": dict(self.phase_peak_mem_bytes),
            "context_bytes": self.context_bytes,
            "phase_context_bytes": dict(self.phase_context_bytes),
            "phase_tensor_bytes": dict(self.phase_tensor_bytes),
            "phase_reserved_bytes": dict(self.phase_reserved_bytes),
            "fits_under_bytes": self.fits_under_bytes, "allocator": dict(self.allocator),
            "host_offload_bytes": self.host_offload_bytes, "trace_s": self.trace_s}


def fixed_term(plan: EstimatePlan) -> tuple[int, dict[str, int], str]:
    """The fixed term a trace of `plan` adds (one for the trace, per phase where a study
    fitted them) and where it comes from: on a GPU what lives outside torch (the CUDA context
    the study's probes measured, else the prior, and NCCL's buffers for the run's real ranks);
    on a CPU the interpreter's, fitted on the study's probes where there are some."""
    from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES
    from autotune.memory.outside_torch import outside_torch

    request = plan.request
    fitted_trace = plan.fitted_trace
    if request.device.on_gpu:
        measured = fitted_trace.get("outside_torch_bytes")
        outside = outside_torch(request.world_size, False,
                                request.config.rollout_tensor_parallel,
                                int(measured) if isinstance(measured, (int, float)) else None)
        where = (f"measured by the study's probes on {plan.fitted['device']}"
                 if measured is not None else "prior, measured on an H200")
        return outside.total_bytes, {}, (
            f"outside torch {format_bytes(outside.total_bytes)}: CUDA context "
            f"{format_bytes(outside.cuda_context_bytes)} ({where}), NCCL "
            f"{format_bytes(outside.nccl_bytes)}")
    fitted = fitted_phase_terms(fitted_trace)
    if fitted:
        return min(fitted.values()), fitted, \
            f"fitted per phase on the probes of the study ({plan.fitted['device']})"
    return TRACE_CPU_CONTEXT_BYTES, {}, (f"{format_bytes(TRACE_CPU_CONTEXT_BYTES)}, prior (the "
                                         "interpreter with torch and transformers)")


def run_trace(plan: EstimatePlan, say: Callable[[str], None]) -> TracedEstimate:
    """Trace the plan's probe in this process (torch is imported here, only for --trace). On
    a GPU each phase is torch's reserved peak, the trace's allocations replayed through the
    caching allocator, plus the fixed term (fixed_term)."""
    from autotune.probe.worker import quiet_libraries

    request = plan.request
    context, fitted, context_note = fixed_term(plan)
    say(f"tracing {plan.name} as rank 0 of {request.world_size} ...")
    quiet_libraries()
    from autotune.probe.trace import trace_request

    result = trace_request(request, context)
    peaks = result.phase_peak_mem_bytes
    terms = {phase: fitted.get(phase, context) for phase in peaks}
    return TracedEstimate(
        phase_peak_mem_bytes={p: v - context + terms[p] for p, v in peaks.items()},
        context_bytes=result.context_bytes, phase_context_bytes=terms,
        context_note=context_note, phase_tensor_bytes=result.phase_tensor_bytes,
        phase_reserved_bytes=result.phase_reserved_bytes,
        fits_under_bytes=result.fits_under_bytes, allocator=result.allocator,
        host_offload_bytes=result.host_offload_bytes, trace_s=result.trace_s)


def fitted_phase_terms(trace: JsonObject) -> dict[str, int]:
    """The fixed term per phase a study's traced pre-screen fitted (a study from before the
    terms were per phase stored one for all phases: it has no phase names, so none is used)."""
    terms = trace.get("phase_context_bytes") or {}
    assert isinstance(terms, dict)
    return {phase: int(value) for phase, value in terms.items()
            if isinstance(value, (int, float))}


def traced_headroom(plan: EstimatePlan, traced: TracedEstimate, peaks: PhasePeaks,
                    budget_bytes: int) -> int:
    """The longest response length whose peaks stay within `budget_bytes`, from the one trace:
    each phase's traced peak at the traced length, grown with the length as the memory model
    (`peaks`) grows it (the model's peak at each length, moved by what the trace found more or
    less than the model at the traced length). No further trace."""
    request = plan.request
    modelled = peaks(request.config)
    moved = {p: v - modelled.get(p, 0) for p, v in traced.phase_peak_mem_bytes.items()}

    def shifted(config: ProbeConfig) -> dict[str, int]:
        at = peaks(config)
        return {p: at.get(p, 0) + by for p, by in moved.items()}

    reach = length_headroom(request.config, shifted, budget_bytes,
                            plan.shape.context_tokens, request.world_size)
    return agreeing(reach.fits_up_to, traced, request.config.max_response_length,
                    budget_bytes)


def agreeing(fits_up_to: int, traced: TracedEstimate, traced_tokens: int,
             budget_bytes: int) -> int:
    """A length headroom that agrees with the trace's own verdict: at least the traced length
    `traced_tokens` when the traced peak fits the budget, below it when it does not (a
    headroom of 0 beside a trace that fits was a contradiction)."""
    if max(traced.phase_peak_mem_bytes.values()) <= budget_bytes:
        return max(fits_up_to, traced_tokens)
    return min(fits_up_to, traced_tokens - 1)


def bisection_traces(searched_to: int) -> int:
    """The most traces a length bisection takes (`longest_fitting_near`: about 2 log2 of its
    miss, steps of length_step up to `searched_to`), said up front."""
    return 2 * max(1, (searched_to // length_step(searched_to)).bit_length())


def length_step(longest: int) -> int:
    """The trace bisection's resolution: 1/64 of the longest length looked at, 16 at least."""
    return max(16, longest // 64)


def traced_length(plan: EstimatePlan, traced: TracedEstimate, budget_bytes: int,
                  reach: LengthHeadroom, say: Callable[[str], None]) -> int:
    """The longest response length whose traced peak (with the same fixed term) stays within
    `budget_bytes`, in steps of length_step, everything else held: bisected where the peak
    grows with the length; with a token budget (a saw of falling rows, memory/length.py) the
    traces check the model's answer and the step above it instead."""
    from autotune.memory.length import at_length, longest_fitting, longest_fitting_near, row_breaks
    from autotune.probe.trace import trace_request

    request, step = plan.request, length_step(reach.searched_to)
    extra = {p: term - traced.context_bytes for p, term in traced.phase_context_bytes.items()}

    def fits(steps: int) -> bool:
        tokens = steps * step
        say(f"tracing at {tokens:,}-token responses ...")
        at = dataclasses.replace(request, config=at_length(request.config, tokens))
        peaks = trace_request(at, traced.context_bytes).phase_peak_mem_bytes
        return max(v + extra.get(p, 0) for p, v in peaks.items()) <= budget_bytes

    if row_breaks(request.config, request.world_size, reach.searched_to):
        answer = reach.fits_up_to // step
        if not fits(answer):
            found = longest_fitting(fits, max(0, answer - 1)) * step
        else:
            found = (answer + 1 if answer * step < reach.searched_to and fits(answer + 1)
                     else answer) * step
    else:
        found = longest_fitting_near(fits, reach.fits_up_to // step,
                                     reach.searched_to // step) * step
    return agreeing(found, traced, request.config.max_response_length, budget_bytes)
