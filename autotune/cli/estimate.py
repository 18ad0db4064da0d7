"""`autotune estimate`: the memory model's answer for one config, before any probe runs.

With `--study` the study's calibration (fitted on its probes, one device) replaces the prior
constants. Pure arithmetic: no torch import.
"""

from __future__ import annotations

import json
from typing import Any

import click

from autotune.config import (
    ProbeConfig,
    parse_assignments,
    parse_bytes,
    parse_headroom,
    validate_probe_config,
)
from autotune.errors import ConfigError
from autotune.hardware import gpu_capacity_bytes
from autotune.memory.calibration import Calibration
from autotune.memory.estimate import format_estimate, phase_totals
from autotune.memory.model import estimate_memory

DEFAULT_CAPACITY = "80GiB"  # an H100 or A100-80GB, when no NVIDIA GPU is visible here


def load_calibration(study: str, results_dir: str) -> tuple[Calibration, dict[str, Any]]:
    """A study's calibration and what it was fitted for (model, device, dtype)."""
    from autotune.sweep.storage import load_study

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
    from autotune.memory.model import model_shape

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
