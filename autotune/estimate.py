"""`autotune estimate`: the memory model's answer for one config, before any probe runs.

Prints per phase the exact model states, the transient part, the context and the total
against the capacity; the phase that binds and its terms; host memory offload needs; and the
largest micro-batches that fit. With `--study` the study's calibration (fitted on its probes,
one device) replaces the prior constants. Pure arithmetic: no torch import.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import click

from autotune.calibration import Calibration
from autotune.config import (
    ProbeConfig,
    format_bytes,
    parse_assignments,
    parse_bytes,
    parse_headroom,
    validate_probe_config,
)
from autotune.errors import ConfigError
from autotune.memory import MemoryEstimate, ModelShape, estimate_memory

DEFAULT_CAPACITY = "80GiB"  # an H100 or A100-80GB, when no NVIDIA GPU is visible here
MAX_MICRO_BATCH = 1 << 16


def phase_totals(estimate: MemoryEstimate, calibration: Calibration | None) -> dict[str, int]:
    if calibration is None:
        return {name: p.total_bytes for name, p in estimate.phases.items()}
    return calibration.phase_bytes(estimate)


def largest_micro_batch(shape: ModelShape, config: ProbeConfig, knob: str, budget_bytes: int,
                        calibration: Calibration | None, **model_args: Any) -> tuple[int, int]:
    """The largest value of micro-batch `knob` whose phase fits `budget_bytes` (0: not even
    1), searched past the batch, and how many responses the batch gives one GPU there."""
    prompts = config.global_batch_size if knob == "micro_batch_size_update" \
        else config.rollout_batch_size
    per_gpu = max(1, prompts * config.rollout_n // model_args.get("num_gpus", 1))
    phase = "update" if knob == "micro_batch_size_update" else "experience"

    def fits(micro: int) -> bool:
        trial = dataclasses.replace(config, **{knob: micro})
        totals = phase_totals(estimate_memory(shape, trial, **model_args), calibration)
        return totals[phase] <= budget_bytes

    low, high = 0, MAX_MICRO_BATCH  # memory grows with the micro-batch: bisect
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low, per_gpu


def format_estimate(name: str, shape: ModelShape, config: ProbeConfig, capacity_bytes: int,
                    headroom: float, calibration: Calibration | None, calibration_note: str,
                    **model_args: Any) -> str:
    estimate = estimate_memory(shape, config, **model_args)
    totals = phase_totals(estimate, calibration)
    budget = int((1 - headroom) * capacity_bytes)
    binding = max(totals, key=lambda phase: totals[phase])
    num_gpus = model_args.get("num_gpus", 1)
    compute = {2: "bf16", 4: "fp32"}.get(model_args.get("compute_bytes") or 2, "bf16")
    where = (f"{num_gpus} GPU{'s' if num_gpus > 1 else ''} (FSDP)"
             if model_args.get("on_gpu", True) else "the CPU as the device")
    lines = [f"{name}: {shape.num_params / 1e9:.3f}B params, {where}, {compute} compute; "
             f"capacity {format_bytes(capacity_bytes)} per device, budget "
             f"{format_bytes(budget)} at {headroom:.0%} headroom",
             f"memory model: {calibration_note}", "",
             f"{'phase':<12}{'model states':>14}{'transient':>12}{'context':>11}{'total':>12}"
             f"{'of capacity':>13}"]
    for phase, part in estimate.phases.items():
        transient, context = part.transient_bytes, part.context_bytes
        if calibration is not None:
            fit = calibration.phases.get(phase, calibration.fallback())
            transient, context = int(fit.transient_scale * transient), fit.context_bytes
        mark = "  <- binds" if phase == binding else ""
        lines.append(f"{phase:<12}{format_bytes(part.states_bytes):>14}"
                     f"{format_bytes(transient):>12}{format_bytes(context):>11}"
                     f"{format_bytes(totals[phase]):>12}{totals[phase] / capacity_bytes:>12.0%}"
                     f"{mark}")
    terms = ", ".join(f"{k} {format_bytes(v)}" for k, v in estimate.phases[binding].parts.items()
                      if v)
    verdict = "fits" if totals[binding] <= budget else (
        "over the headroom budget" if totals[binding] <= capacity_bytes else "does not fit")
    lines += ["", f"binding phase: {binding} ({verdict}); prior terms: {terms}"]
    if estimate.host_offload_bytes:
        lines.append(f"host memory for offload: {format_bytes(estimate.host_offload_bytes)} per "
                     f"GPU, {format_bytes(estimate.host_offload_bytes * num_gpus)} for "
                     f"{num_gpus} GPU{'s' if num_gpus > 1 else ''}")
    else:
        lines.append("host memory for offload: none (offload_params and offload_optimizer off)")
    for knob in ("micro_batch_size_update", "micro_batch_size_experience"):
        fits, per_gpu = largest_micro_batch(shape, config, knob, budget, calibration,
                                            **model_args)
        what = "per optimizer step" if knob == "micro_batch_size_update" else "per step"
        if fits == 0:
            lines.append(f"largest {knob} within the budget: none, even 1 does not fit")
        else:
            usable = max(m for m in range(1, min(fits, per_gpu) + 1) if per_gpu % m == 0)
            lines.append(f"largest {knob} within the budget: {fits} (this batch gives each "
                         f"GPU {per_gpu} responses {what}; largest divisor that fits: "
                         f"{usable})")
    return "\n".join(lines)


def load_calibration(study: str, results_dir: str) -> tuple[Calibration, dict[str, Any]]:
    """A study's calibration and what it was fitted for (model, device, dtype)."""
    from autotune.report import load_study

    loaded = load_study(results_dir, study)
    stored = loaded.user_attrs.get("memory_calibration")
    if not stored:
        raise ConfigError(f"study {study}: no calibration yet (it needs one successful probe); "
                          "run the sweep first, or leave out --study for the prior")
    identity = loaded.user_attrs.get("identity", {})
    fixed = loaded.user_attrs.get("search_space", {}).get("fixed", {})
    return Calibration.from_dict(stored["phases"]), {
        **stored, "model": identity.get("model"), "model_path": identity.get("model_path"),
        "fixed": fixed}


@click.command()
@click.option("--model", default=None, metavar="NAME", help="Registry model, e.g. qwen2.5-7b.")
@click.option("--model-path", type=click.Path(file_okay=False), default=None,
              help="Local checkpoint or config directory (its config.json is read).")
@click.option("--gpus", "num_gpus", type=click.IntRange(1), default=1, show_default=True,
              help="GPUs the actor is sharded over (FSDP).")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Set a knob, repeatable: --set micro_batch_size_update=8.")
@click.option("--capacity", default=None, metavar="SIZE",
              help=f"Memory per GPU (default: this machine's GPU, else {DEFAULT_CAPACITY}).")
@click.option("--headroom", default="10%", show_default=True, help="Share kept free.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Compute dtype of the rollout engine, reference and activations.")
@click.option("--study", default=None,
              help="Use this study's calibration (its model, device and dtype).")
@click.option("--results-dir", default="results", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print per-phase bytes as JSON.")
def estimate(model: str | None, model_path: str | None, num_gpus: int,
             assignments: tuple[str, ...], capacity: str | None, headroom: str, dtype: str,
             study: str | None, results_dir: str, as_json: bool) -> None:
    """Estimate peak memory per GPU and phase, without running anything.

    \b
    autotune estimate --model qwen2.5-7b --gpus 8
    autotune estimate --model qwen2.5-vl-7b --gpus 8 --set gradient_checkpointing=true
    autotune estimate --study tiny-qwen2.5-cpu-demo --capacity 560MiB \\
        --set micro_batch_size_experience=16
    """
    from autotune.models import model_shape

    calibration, note = None, "prior constants (no probe yet; --study S uses a calibration)"
    fitted: dict[str, Any] = {}
    model_args = {"num_gpus": num_gpus, "on_gpu": True,
                  "compute_bytes": 2 if dtype == "bf16" else 4}
    if study is not None:
        calibration, fitted = load_calibration(study, results_dir)
        if model is not None and model != fitted["model"]:
            raise ConfigError(f"--study {study} was calibrated on model {fitted['model']}, "
                              f"not {model}; leave out --model or pick that model's study")
        model, model_path = fitted["model"], model_path or fitted["model_path"]
        model_args.update(on_gpu=fitted["on_gpu"], compute_bytes=fitted["compute_bytes"])
        note = (f"calibrated on {fitted['probes']} probes of study {study} on "
                f"{fitted['device']}")
    if model is None and model_path is None:
        raise ConfigError("estimate: give --model NAME (see `autotune models`) or "
                          "--model-path DIR")
    shape = model_shape(model or "", model_path)
    knobs = fitted["fixed"] if study is not None else {}  # the study's shapes, then --set
    config = ProbeConfig(**{**knobs, **parse_assignments(assignments)})
    problems = validate_probe_config(config)
    if problems:
        raise ConfigError(problems)
    if capacity is not None:
        capacity_bytes = parse_bytes(capacity, "--capacity")
    else:
        capacity_bytes = gpu_capacity_bytes() or parse_bytes(DEFAULT_CAPACITY)
    fraction = parse_headroom(headroom)
    name = model or model_path
    if as_json:
        est = estimate_memory(shape, config, **model_args)
        click.echo(json.dumps({"model": name, "num_params": shape.num_params,
                               "capacity_bytes": capacity_bytes,
                               "phase_bytes": phase_totals(est, calibration),
                               "host_offload_bytes": est.host_offload_bytes}, indent=2))
        return
    click.echo(format_estimate(name, shape, config, capacity_bytes, fraction, calibration,
                               note, **model_args))


def gpu_capacity_bytes() -> int | None:
    """Memory of GPU 0 per NVML, or None without an NVIDIA GPU (no torch import)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
