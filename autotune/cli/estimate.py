"""`autotune estimate`: the memory model's answer for one config, before any probe runs.

With `--study` the study's calibration (fitted on its probes, one device) replaces the prior
constants. Pure arithmetic, no torch import, unless `--trace`: then the probe's own step is
traced with fake tensors as one rank of the run (probe/trace.py), seconds to a few minutes
on any CPU, and its per-phase peaks are printed beside the model's.
"""

from __future__ import annotations

import json
from typing import Any

import click

from autotune.cli.options import engine_knobs
from autotune.config import (
    ProbeConfig,
    format_bytes,
    model_problems,
    parse_assignments,
    parse_bytes,
    parse_headroom,
    validate_probe_config,
)
from autotune.errors import ConfigError
from autotune.hardware import gpu_capacity_bytes
from autotune.memory.calibration import Calibration
from autotune.memory.estimate import format_estimate, format_traced, phase_totals
from autotune.memory.model import estimate_memory

DEFAULT_CAPACITY = "80GiB"  # an H100 or A100-80GB, when no NVIDIA GPU is visible here


def load_calibration(study: str, results_dir: str, storage: str | None
                     ) -> tuple[Calibration, dict[str, Any]]:
    """A study's calibration and what it was fitted for (model, device, dtype)."""
    from autotune.sweep.storage import load_study

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


@click.command()
@click.option("--model", default=None, metavar="NAME", help="Registry model, e.g. qwen2.5-7b.")
@click.option("--model-path", type=click.Path(file_okay=False), default=None,
              help="Local checkpoint or config directory (its config.json is read).")
@click.option("--nnodes", type=click.IntRange(1), default=1, show_default=True,
              help="Nodes of the training run.")
@click.option("--gpus-per-node", type=click.IntRange(1), default=None,
              help="GPUs per node: the actor is sharded over all the run's GPUs (FSDP) and "
                   "each takes its share of the batch (default 1).")
@click.option("--gpus", "gpus_shorthand", type=click.IntRange(1), default=None, hidden=True,
              help="Shorthand for --nnodes 1 --gpus-per-node N.")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda",
              show_default=True, help="What the probes run on: GPUs, or the CPU as the device "
                                      "(the CPU demo: RSS is the device memory).")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Set a knob, repeatable: --set micro_batch_size_update=8.")
@click.option("--capacity", default=None, metavar="SIZE",
              help=f"Memory per device (default: this machine's GPU, else {DEFAULT_CAPACITY}; "
                   "host RAM with --device cpu).")
@click.option("--headroom", default="10%", show_default=True, help="Share kept free.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default=None,
              help="Compute dtype of the rollout engine, reference and activations (default: "
                   "bf16 on cuda, fp32 on cpu).")
@click.option("--engine", type=click.Choice(["auto", "vllm-like", "hf"]), default="auto",
              show_default=True,
              help="Rollout engine: vllm-like reserves gpu_memory_utilization of --capacity "
                   "(EasyR1, verl); hf grows a KV cache with the batch (TRL). auto: "
                   "vllm-like on cuda, hf on cpu.")
@click.option("--study", default=None,
              help="Use this study's calibration (its model, device and dtype).")
@click.option("--results-dir", default="results", show_default=True)
@click.option("--storage", default=None, metavar="URL|FILE",
              help="The --study's shared storage (as given to `run --storage`).")
@click.option("--trace", is_flag=True,
              help="Also trace the probe's own step with fake tensors, as rank 0 of the run "
                   "(no GPU, no weights; seconds for small models, about a minute for 7B).")
@click.option("--json", "as_json", is_flag=True, help="Print per-phase bytes as JSON.")
def estimate(model: str | None, model_path: str | None, nnodes: int,
             gpus_per_node: int | None, gpus_shorthand: int | None, device: str,
             assignments: tuple[str, ...], capacity: str | None, headroom: str,
             dtype: str | None, engine: str, study: str | None, results_dir: str,
             storage: str | None, trace: bool, as_json: bool) -> None:
    """Estimate peak memory per GPU and phase, without running anything.

    \b
    autotune estimate --model qwen2.5-7b --gpus-per-node 8
    autotune estimate --model qwen2.5-vl-7b --nnodes 2 --gpus-per-node 8 \\
        --set gradient_checkpointing=true
    autotune estimate --model tiny-qwen2.5 --device cpu --capacity 545MiB
    autotune estimate --trace --model qwen2.5-7b --gpus-per-node 8
    autotune estimate --study tiny-qwen2.5-cpu-demo --set micro_batch_size_experience=16
    """
    from autotune.hardware import host_memory_bytes
    from autotune.memory.model import model_shape

    if gpus_shorthand is not None and gpus_per_node is not None:
        raise ConfigError("--gpus N is short for --gpus-per-node N: give one of them")
    world_size = nnodes * (gpus_per_node or gpus_shorthand or 1)
    calibration, note = None, "prior constants (no probe yet; --study S uses a calibration)"
    fitted: dict[str, Any] = {}
    on_gpu = device == "cuda"
    model_args = {"num_gpus": world_size, "on_gpu": on_gpu,
                  "compute_bytes": {"bf16": 2, "fp32": 4}[dtype or ("bf16" if on_gpu
                                                                   else "fp32")]}
    if study is not None:
        calibration, fitted = load_calibration(study, results_dir, storage)
        if model is not None and model != fitted["model"]:
            raise ConfigError(f"--study {study} was calibrated on model {fitted['model']}, "
                              f"not {model}; leave out --model or pick that model's study")
        model, model_path = fitted["model"], model_path or fitted["model_path"]
        on_gpu = fitted["on_gpu"]
        model_args.update(on_gpu=on_gpu, compute_bytes=fitted["compute_bytes"])
        note = (f"calibrated on {fitted['probes']} probes of study {study} on "
                f"{fitted['device']}")
    elif storage is not None:
        raise ConfigError("--storage: only with --study (the study whose calibration to use)")
    if model is None and model_path is None:
        raise ConfigError("estimate: give --model NAME (see `autotune models`) or "
                          "--model-path DIR")
    shape = model_shape(model or "", model_path)
    knobs = fitted["fixed"] if study is not None else {}  # the study's shapes, then --set
    user = parse_assignments(assignments)
    device_options = {"device": "cuda" if model_args["on_gpu"] else "cpu", "engine": engine}
    values = {**knobs, **engine_knobs(device_options, space_names=frozenset({*knobs, *user})),
              **user}
    batches = ("rollout_batch_size", "global_batch_size")
    if world_size > 1 and not any(k in values for k in batches):  # defaults are one GPU's
        values.update({k: getattr(ProbeConfig(), k) * world_size for k in batches})
        note += (f"; batches: the defaults per GPU, rollout_batch_size="
                 f"{values['rollout_batch_size']} and global_batch_size="
                 f"{values['global_batch_size']} over {world_size} GPUs (--set your run's)")
    config = ProbeConfig(**values)
    problems = validate_probe_config(config, world_size) + model_problems(config, shape.is_vl)
    if problems:
        raise ConfigError(problems)
    if capacity is not None:
        capacity_bytes = parse_bytes(capacity, "--capacity")
    elif on_gpu:
        capacity_bytes = gpu_capacity_bytes() or parse_bytes(DEFAULT_CAPACITY)
    else:
        capacity_bytes = host_memory_bytes()
    model_args["engine_capacity_bytes"] = capacity_bytes
    fraction = parse_headroom(headroom)
    name = model or model_path
    est = estimate_memory(shape, config, **model_args)
    traced = run_trace(model or "", model_path, config, model_args, dtype, nnodes,
                       world_size // nnodes, capacity_bytes, fitted) if trace else None
    if as_json:
        report = {"model": name, "num_params": shape.num_params, "world_size": world_size,
                  "device": device, "capacity_bytes": capacity_bytes,
                  "phase_bytes": phase_totals(est, calibration),
                  "host_offload_bytes": est.host_offload_bytes}
        if traced is not None:
            report["traced"] = {k: traced[k] for k in (
                "phase_peak_mem_bytes", "context_bytes", "host_offload_bytes", "trace_s")}
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(format_estimate(name, shape, config, capacity_bytes, fraction, calibration,
                               note, **model_args))
    if traced is not None:
        what = (f"the probe's own step as rank 0 of {world_size} under fake tensors, build "
                f"and 2 steps in {traced['trace_s']:.1f} s")
        click.echo("")
        click.echo(format_traced(traced["phase_peak_mem_bytes"], traced["context_bytes"],
                                 traced["context_note"], phase_totals(est, calibration),
                                 capacity_bytes, fraction, traced["host_offload_bytes"], what))


def run_trace(model: str, model_path: str | None, config: ProbeConfig,
              model_args: dict[str, Any], dtype: str | None, nnodes: int, gpus_per_node: int,
              capacity_bytes: int, fitted: dict[str, Any]) -> dict[str, Any]:
    """Trace the probe's step in this process (torch is imported here, only for --trace)."""
    import dataclasses

    from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES, TRACE_GPU_CONTEXT_BYTES
    from autotune.probe.result import ProbeRequest
    from autotune.probe.worker import quiet_libraries

    on_gpu = model_args["on_gpu"]
    context, context_note = (TRACE_GPU_CONTEXT_BYTES, "prior (CUDA context, cuBLAS and "
                             "NCCL workspaces, allocator rounding)") if on_gpu else (
        TRACE_CPU_CONTEXT_BYTES, "prior (the interpreter with torch and transformers)")
    fitted_context_bytes = (fitted.get("trace") or {}).get("context_bytes")
    if fitted_context_bytes:
        context = int(fitted_context_bytes)
        context_note = f"fitted on the probes of the study ({fitted['device']})"
    request = ProbeRequest(model=model, model_path=model_path, config=config,
                           device="cuda" if on_gpu else "cpu", dtype=dtype or "auto",
                           nnodes=nnodes, gpus_per_node=gpus_per_node, emulated=True)
    click.echo(f"tracing {model or model_path} as rank 0 of {request.world_size} ...",
               err=True)
    quiet_libraries()
    from autotune.probe.trace import trace_request

    result = dataclasses.asdict(trace_request(request, context, capacity_bytes))
    return {**result, "context_note": f"{format_bytes(context)}, {context_note}"}
