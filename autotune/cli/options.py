"""The options every probing command shares, and the ProbeRequest they build.

`autotune probe` and `autotune run` take the same model, device, memory-limit and step
options; this module is their one definition. No torch import.
"""

from __future__ import annotations

from typing import Any

import click

from autotune.errors import ConfigError


def _size_option(name: str, help_text: str) -> Any:
    return click.option(name, default=None, metavar="SIZE", help=help_text)


def probe_options(model_required: bool = True) -> Any:
    """Options shared by every command that runs probes: model, device and memory limits."""
    options = [
        click.option("--model", "model", required=model_required, default=None, metavar="NAME",
                     help="Registry model (see `autotune models`), e.g. qwen2.5-vl-7b."),
        click.option("--model-path", type=click.Path(file_okay=False), default=None,
                     help="Local HF checkpoint or config directory (overrides the registry)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                     show_default=True, help="Where probes run; auto = cuda when present."),
        click.option("--gpus", default=None, metavar="IDS",
                     help="GPU ids to pin probes to, e.g. 0 or 0,1 (default: all visible)."),
        click.option("--threads", "cpu_threads", type=click.IntRange(1), default=None,
                     help="CPU threads per probe (default: torch's choice)."),
        _size_option("--gpu-memory-limit", "Cap on device memory per probe, e.g. 40GiB "
                     "(emulates a smaller GPU; on CPU caps the probe's device RSS)."),
        _size_option("--reserve-gpu-memory", "Device memory left free for a co-located "
                     "process such as a retriever, e.g. 6GiB (default: 0)."),
        _size_option("--host-memory-limit", "Cap on the probe tree's host RSS, e.g. 64GiB; "
                     "past it the probe is killed and classified host_oom."),
        click.option("--probe-timeout", "probe_timeout", default="15m", show_default=True,
                     help="Wall-clock limit per probe: 90s, 15m, 2h."),
        click.option("--nnodes", type=click.IntRange(1), default=None,
                     help="Nodes of the training run being tuned (default 1; with --trainer, "
                          "its base config's)."),
        click.option("--gpus-per-node", type=click.IntRange(1), default=None,
                     help="GPUs per node of that run (default: the GPUs visible here, 1 on a "
                          "CPU): a probe runs one GPU's share of each batch."),
        click.option("--ranks", type=click.Choice(["auto", "real", "emulated"]), default="auto",
                     show_default=True,
                     help="With more than one GPU in the run: real ranks (one process per GPU, "
                          "needs them here) or one emulated rank (exact per-rank memory on one "
                          "device, time without communication); auto: see the README."),
        click.option("--warmup-steps", type=click.IntRange(0), default=1, show_default=True,
                     help="Untimed steps before timing."),
        click.option("--timed-steps", type=click.IntRange(1), default=2, show_default=True,
                     help="Timed steps averaged into the figures."),
        click.option("--engine", type=click.Choice(["auto", "vllm-like", "hf"]),
                     default="auto", show_default=True,
                     help="Rollout engine's memory: vllm-like reserves "
                          "gpu_memory_utilization of the device (EasyR1, verl); hf grows a KV "
                          "cache with the batch (TRL). auto: vllm-like on a GPU, hf for "
                          "--trainer trl and on a CPU."),
        click.option("--dtype", type=click.Choice(["auto", "bf16", "fp32"]), default="auto",
                     show_default=True, help="Compute dtype; auto = bf16 on GPU, fp32 on CPU."),
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed."),
    ]

    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def study_options(command: Any) -> Any:
    """The options of every command that reads a finished or running study."""
    for option in reversed([
        click.option("--study", default=None,
                     help="Study name (default: the latest in --results-dir)."),
        click.option("--results-dir", type=click.Path(file_okay=False), default="results",
                     show_default=True),
        click.option("--storage", default=None, metavar="URL|FILE",
                     help="A shared study's storage (as given to `run --storage`)."),
    ]):
        command = option(command)
    return command


def build_probe_request(options: dict[str, Any], knob_values: dict[str, Any],
                        local: bool = True, check_rules: bool = True,
                        known_model: bool = True) -> Any:
    """A ProbeRequest from the shared probe options and typed knob values, every option
    checked before any probe starts. `local`: probes run on this machine (not a Ray cluster),
    so --device cuda needs a GPU here. `check_rules`: the knobs must pass the batch rules (a
    sweep's template config need not: each trial's config is checked as it is asked).
    `known_model`: --model must be in the registry (a probe of the user's trainer runs the
    model of the trainer's config; --model is then a label)."""
    from pathlib import Path

    from autotune.config import ProbeConfig, make_probe_config, parse_bytes, parse_duration_s
    from autotune.hardware import has_nvidia_gpu
    from autotune.probe.result import ProbeRequest
    from autotune.registry import get_model_spec, read_model_path_config

    if options["model_path"] is None:
        if known_model:
            get_model_spec(options["model"])
    else:
        read_model_path_config(options["model_path"])
    if local and options["device"] == "cuda" and not has_nvidia_gpu():
        raise ConfigError("--device cuda: no NVIDIA GPU is visible on this machine; use "
                          "--device cpu, or run where a GPU is")
    gpu_ids = None
    if options["gpus"]:
        try:
            gpu_ids = tuple(int(x) for x in options["gpus"].split(","))
        except ValueError:
            raise ConfigError(f"--gpus {options['gpus']!r}: expected ids such as 0 or 0,1") \
                from None

    def size(flag: str) -> int | None:
        raw = options[flag.lstrip("-").replace("-", "_")]
        return parse_bytes(raw, flag, allow_zero=flag == "--reserve-gpu-memory") \
            if raw is not None else None

    default_topology(options)
    nnodes, gpus_per_node = options["nnodes"] or 1, options["gpus_per_node"] or 1
    return ProbeRequest(
        model=options["model"] or Path(options["model_path"]).name,
        config=make_probe_config(knob_values, nnodes * gpus_per_node) if check_rules
        else ProbeConfig(**knob_values),
        model_path=options["model_path"], device=options["device"], gpu_ids=gpu_ids,
        cpu_threads=options["cpu_threads"], gpu_memory_limit_bytes=size("--gpu-memory-limit"),
        reserve_gpu_memory_bytes=size("--reserve-gpu-memory") or 0,
        host_memory_limit_bytes=size("--host-memory-limit"),
        timeout_s=parse_duration_s(options["probe_timeout"], "--probe-timeout"),
        warmup_steps=options["warmup_steps"], timed_steps=options["timed_steps"],
        seed=options["seed"], dtype=options["dtype"], nnodes=nnodes,
        gpus_per_node=gpus_per_node,
        emulated=emulate_ranks(options.get("ranks", "auto"), nnodes * gpus_per_node,
                               options["device"], gpu_ids, local))


def engine_knobs(options: dict[str, Any], trainer: str | None = None,
                 space_names: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The rollout engine's knobs --engine sets: an explicit --engine always (as --set
    would); auto only where the space says nothing of the engine. auto is vllm-like on a
    GPU (EasyR1's and verl's vLLM), hf for TRL (HF generation) and on a CPU (a stand-in
    device whose interpreter alone takes a large share of a small cap); verl's vLLM
    (>= 0.8.5) sleeps at level 2, EasyR1's at 1."""
    from autotune.hardware import has_nvidia_gpu

    engine = options.get("engine", "auto")
    if engine == "auto":
        if "rollout_engine" in space_names:
            return {}
        on_cpu = options["device"] == "cpu" or (options["device"] == "auto"
                                                 and not has_nvidia_gpu())
        engine = "hf" if trainer == "trl" or on_cpu else "vllm-like"
    knobs: dict[str, Any] = {"rollout_engine": engine}
    if engine == "vllm-like" and trainer == "verl" and "sleep_level" not in space_names:
        knobs["sleep_level"] = 2
    return knobs


def default_topology(options: dict[str, Any]) -> None:
    """--nnodes and --gpus-per-node both left out: the run is this machine's GPUs (the
    --gpus given, else every visible one), or 1 on a CPU. Fills `options` in place."""
    from autotune.hardware import has_nvidia_gpu, visible_gpu_ids

    if options["nnodes"] is not None or options["gpus_per_node"] is not None:
        return
    options["nnodes"] = 1
    on_gpu = options["device"] == "cuda" or (options["device"] == "auto" and has_nvidia_gpu())
    ids = options["gpus"].split(",") if options.get("gpus") else visible_gpu_ids()
    options["gpus_per_node"] = max(1, len(ids)) if on_gpu else 1


def local_ranks(device: str, gpu_ids: tuple[object, ...] | None) -> int:
    """How many real ranks this machine can run at once: its GPUs, or on a CPU its cores."""
    from autotune.hardware import has_nvidia_gpu, usable_cpu_ids, visible_gpu_ids

    if device == "cpu" or (device == "auto" and not has_nvidia_gpu()):
        return len(usable_cpu_ids())
    return len(gpu_ids) if gpu_ids is not None else len(visible_gpu_ids())


def emulate_ranks(ranks: str, world_size: int, device: str, gpu_ids: tuple[int, ...] | None,
                  local: bool = True) -> bool:
    """Whether probes of a `world_size`-GPU run emulate their rank (--ranks): auto runs real
    ranks when the run's GPUs are all here, and emulates one rank when they are not."""
    if world_size == 1:
        return False
    fits = not local or world_size <= local_ranks(device, gpu_ids)
    if ranks == "real" and not fits:
        where = "cores" if device == "cpu" else "GPUs"
        raise ConfigError(f"--ranks real: the run's {world_size} GPUs need {world_size} "
                          f"{where} here, {local_ranks(device, gpu_ids)} found; use --ranks "
                          "emulated (exact per-rank memory on one device)")
    return ranks == "emulated" or (ranks == "auto" and not fits)
