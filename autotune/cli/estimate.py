"""`autotune estimate`: the memory model's answer for one config, before any probe runs.

With `--study` the study's calibration (fitted on its probes, one device) replaces the prior
constants. Pure arithmetic, no torch import, unless `--trace`: then the probe's own step is
traced with fake tensors as one rank of the run (probe/trace.py) and its per-phase peaks are
printed beside the model's.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import click

from autotune.cli import options as opt
from autotune.config import format_bytes

if TYPE_CHECKING:
    from autotune.estimate.planning import EstimatePlan
    from autotune.memory.length import LengthHeadroom


@click.command()
@opt.model
@opt.model_path
@opt.nnodes
@opt.gpus_per_node
@opt.device
@opt.algorithm
@opt.set_knobs
@click.option("--capacity", "capacity_bytes", type=opt.SIZE, default=None, metavar="SIZE",
              help="Memory of the device planned for (default: this machine's GPU, else "
                   "80GiB; host RAM with --device cpu).")
@opt.gpu_memory_limit
@opt.reserve_gpu_memory
@opt.host_memory
@opt.host_memory_limit
@opt.trainer
@opt.headroom
@opt.dtype
@opt.engine
@opt.study
@opt.results_dir
@opt.storage
@click.option("--response-length", type=click.IntRange(1, 2**24), default=None, metavar="N",
              help="Answer at responses of N tokens, the length the run's responses reach "
                   "now (max_response_length is the worst case they may grow to).")
@click.option("--trace", is_flag=True,
              help="Also trace the probe's own step with fake tensors, as rank 0 of the run "
                   "(no GPU, no weights; seconds for small models, about a minute for 7B).")
@opt.as_json
def estimate(capacity_bytes: int | None, host_memory_bytes: int | None, headroom: float,
             study: str | None, results_dir: str, storage: str | None,
             response_length: int | None, trace: bool, as_json: bool, **given: Any) -> None:
    """Estimate peak memory per GPU and phase, without running anything.

    \b
    autotune estimate --model qwen2.5-7b --gpus-per-node 8
    autotune estimate --model qwen2.5-vl-7b --nnodes 2 --gpus-per-node 8 \\
        --set gradient_checkpointing=true
    autotune estimate --model tiny-qwen2.5 --device cpu --capacity 545MiB
    autotune estimate --trace --model qwen2.5-7b --gpus-per-node 8
    autotune estimate --study tiny-qwen2.5-cpu-demo --set micro_batch_size_experience=16
    autotune estimate --model qwen2.5-7b --gpus-per-node 8 --set max_response_length=2048 \
        --response-length 512
    autotune estimate --model qwen2.5-vl-7b --gpus-per-node 8 --trainer easyr1 \
        --host-memory 760GB --set offload_params=true --set offload_optimizer=true
    """
    from autotune.estimate.planning import plan_estimate
    from autotune.memory.host import format_node_host
    from autotune.memory.length import length_headroom
    from autotune.memory.model import allocator_reserve, estimate_memory
    from autotune.memory.trainer_figures import trainer_figures
    from autotune.memory.verdict import (
        format_estimate,
        format_savings,
        format_traced,
        phase_totals,
        switch_savings,
    )
    from autotune.sweep.prescreen import memory_model_args

    plan = plan_estimate(opt.take_probe_options(given), capacity_bytes, study, results_dir,
                         storage, response_length, host_memory_bytes, given["trainer"])
    request, capacity = plan.request, plan.capacity_bytes
    model_args = memory_model_args(request)
    # the allocator's reserve at this config, held while the searches move one knob (a
    # length, a micro-batch); a switch's saving is two configs', each with its own
    held = {**model_args,
            "reserve_bytes": allocator_reserve(plan.shape, request.config, **model_args)}
    est = estimate_memory(plan.shape, request.config, **held)
    totals = phase_totals(est, plan.calibration)
    budget = int((1 - headroom) * capacity)
    reach = length_headroom(request.config, lambda config: phase_totals(
        estimate_memory(plan.shape, config, **held), plan.calibration), budget,
        plan.shape.context_tokens, request.world_size)
    host = plan.node_host()
    figures = trainer_figures(plan.trainer, est, host) if request.device.on_gpu else []
    binding = plan.binding_constraint(max(totals.values()), host, headroom)
    savings = switch_savings(plan.shape, request.config, plan.calibration, **model_args)
    traced = run_trace(plan) if trace else None
    traced_reach = traced_length(plan, traced, budget, reach) if traced else None
    if as_json:
        report: dict[str, Any] = {
            "model": plan.name, "num_params": plan.shape.num_params,
            "world_size": request.world_size, "device": request.device.kind,
            "capacity_bytes": capacity, "phase_bytes": totals,
            "algorithm": request.config.algorithm,
            "critic_phase_bytes": {p: est.critic_bytes(p) for p in est.phases}
            if request.config.has_critic else {},
            "host_offload_bytes": est.host_offload_bytes,
            "response_tokens": request.config.max_response_length,
            "length_headroom": reach.as_dict(),
            "node_host": {"phase_bytes": {p: host.total(p) for p in host.phases},
                          "terms": host.phases, "host_bytes": host.host_bytes,
                          "threshold": host.threshold, "kill_bytes": host.kill_bytes,
                          "rank_bytes": host.rank_bytes, "host_oom": host.host_oom},
            "binding_constraint": binding, "switch_savings": savings,
            "trainer_figures": {f.metric: {"label": f.label, "bytes": f.value_bytes,
                                           "gib": round(f.value_gib, 2), "how": f.how}
                                for f in figures}}
        if traced is not None:
            report["traced"] = {k: traced[k] for k in (
                "phase_peak_mem_bytes", "context_bytes", "phase_context_bytes",
                "phase_tensor_bytes", "phase_reserved_bytes", "fits_under_bytes",
                "allocator", "host_offload_bytes", "trace_s")}
            report["traced"]["fits_up_to_response_tokens"] = traced_reach
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(format_estimate(plan.name, plan.shape, request.config, capacity, headroom,
                               plan.calibration, plan.note, **held))
    click.echo(f"length headroom: {reach.describe('on this card')} (memory model, everything "
               f"else held)")
    for line in format_savings(savings):
        click.echo(line)
    click.echo("")
    click.echo(format_node_host(host, request.gpus_per_node))
    click.echo(binding)
    if figures:
        click.echo("")
        click.echo(f"{plan.trainer}'s own figures, as it logs them (GiB, the mean over ranks):")
        for figure in figures:
            click.echo(f"  {figure.metric} ({figure.label}): {figure.value_gib:.1f} "
                       f"({figure.how})")
    if traced is not None:
        what = (f"the probe's own step as rank 0 of {request.world_size} under fake tensors, "
                f"build and 2 steps in {traced['trace_s']:.1f} s")
        click.echo("")
        click.echo(format_traced(traced["phase_peak_mem_bytes"], traced["phase_context_bytes"],
                                 traced["context_note"], totals, capacity, headroom,
                                 traced["host_offload_bytes"], what,
                                 traced["phase_tensor_bytes"], traced["fits_under_bytes"]))
        click.echo(f"traced length headroom: fits up to {traced_reach:,}-token responses "
                   f"within the budget (trace bisection, to {length_step(reach.searched_to)} "
                   "tokens)" if traced_reach else "traced length headroom: not even "
                   f"{length_step(reach.searched_to)}-token responses fit within the budget")


def run_trace(plan: EstimatePlan) -> dict[str, Any]:
    """Trace the plan's probe in this process (torch is imported here, only for --trace). On
    a GPU each phase is torch's reserved peak, the trace's allocations replayed through the
    caching allocator, plus what lives outside torch (the CUDA context the study's probes
    measured, else the prior, and NCCL's buffers for the run's real ranks); on a CPU the
    tensors plus the fixed term the study fitted, else the prior."""
    from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES
    from autotune.memory.outside_torch import outside_torch
    from autotune.probe.worker import quiet_libraries

    request = plan.request
    fitted_trace = plan.fitted.get("trace") or {}
    fitted = fitted_phase_terms(fitted_trace)
    if request.device.on_gpu:
        measured = fitted_trace.get("outside_torch_bytes")
        outside = outside_torch(request.world_size, False,
                                request.config.rollout_tensor_parallel, measured)
        context = outside.total_bytes
        context_note = (f"outside torch {format_bytes(context)}: CUDA context "
                        f"{format_bytes(outside.cuda_context_bytes)} ("
                        + (f"measured by the study's probes on {plan.fitted['device']}"
                           if measured is not None else "prior, measured on an H200") +
                        f"), NCCL {format_bytes(outside.nccl_bytes)}")
        fitted = {}
    else:
        context, context_note = TRACE_CPU_CONTEXT_BYTES, \
            "prior (the interpreter with torch and transformers)"
        if fitted:
            context = min(fitted.values())
            context_note = f"fitted per phase on the probes of the study ({plan.fitted['device']})"
        context_note = f"{format_bytes(context)}, {context_note}" if not fitted else \
            context_note
    click.echo(f"tracing {plan.name} as rank 0 of {request.world_size} ...", err=True)
    quiet_libraries()
    from autotune.probe.trace import trace_request

    result = dataclasses.asdict(trace_request(request, context))
    peaks = result["phase_peak_mem_bytes"]
    terms = {phase: fitted.get(phase, context) for phase in peaks}
    result["phase_peak_mem_bytes"] = {p: v - context + terms[p] for p, v in peaks.items()}
    return {**result, "phase_context_bytes": terms, "context_note": context_note}


def fitted_phase_terms(trace: dict[str, Any]) -> dict[str, int]:
    """The fixed term per phase a study's traced pre-screen fitted (a study from before the
    terms were per phase stored one for all phases: it has no phase names, so none is used)."""
    return {phase: int(value) for phase, value in (trace.get("phase_context_bytes") or {}).items()}


def length_step(longest: int) -> int:
    """The trace bisection's resolution: 1/64 of the longest length looked at, 16 at least."""
    return max(16, longest // 64)


def traced_length(plan: EstimatePlan, traced: dict[str, Any], budget_bytes: int,
                  reach: LengthHeadroom) -> int:
    """The longest response length whose traced peak (with the same fixed term) stays within
    `budget_bytes`, in steps of length_step, everything else held: bisected where the peak
    grows with the length; with a token budget (a saw of falling rows, memory/length.py) the
    traces check the model's answer and the step above it instead."""
    from autotune.memory.length import at_length, longest_fitting, longest_fitting_near, row_breaks
    from autotune.probe.trace import trace_request

    request, step = plan.request, length_step(reach.searched_to)

    def fits(steps: int) -> bool:
        tokens = steps * step
        click.echo(f"tracing at {tokens:,}-token responses ...", err=True)
        at = dataclasses.replace(request, config=at_length(request.config, tokens))
        peaks = trace_request(at, traced["context_bytes"]).phase_peak_mem_bytes
        extra = {p: term - traced["context_bytes"]
                 for p, term in traced["phase_context_bytes"].items()}
        return max(v + extra.get(p, 0) for p, v in peaks.items()) <= budget_bytes

    if row_breaks(request.config, request.world_size, reach.searched_to):
        answer = reach.fits_up_to // step
        if not fits(answer):
            return longest_fitting(fits, max(0, answer - 1)) * step
        return (answer + 1 if answer * step < reach.searched_to and fits(answer + 1)
                else answer) * step
    return longest_fitting_near(fits, reach.fits_up_to // step, reach.searched_to // step) * step
