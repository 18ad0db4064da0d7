"""The `autotune` command: thin click commands over the library.

The only place that turns an AutotuneError into one line on stderr and an exit code (2 for
bad input). torch, transformers and ray are imported inside commands, never at import time, so
`autotune --help` is instant.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from autotune import __version__
from autotune.errors import AutotuneError, ConfigError
from autotune.estimate import estimate
from autotune.export import export

_state = {"debug": False}
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _size_option(name: str, help_text: str) -> Any:
    return click.option(name, default=None, metavar="SIZE", help=help_text)


def probe_options(model_required: bool = True, timeout_flag: str = "--timeout") -> Any:
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
        click.option(timeout_flag, "timeout", default="15m", show_default=True,
                     help="Wall-clock limit per probe: 90s, 15m, 2h."),
        click.option("--warmup-steps", type=click.IntRange(0), default=1, show_default=True,
                     help="Untimed steps before timing."),
        click.option("--timed-steps", type=click.IntRange(1), default=2, show_default=True,
                     help="Timed steps averaged into the figures."),
        click.option("--dtype", type=click.Choice(["auto", "bf16", "fp32"]), default="auto",
                     show_default=True, help="Compute dtype; auto = bf16 on GPU, fp32 on CPU."),
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed."),
    ]

    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def build_probe_request(options: dict[str, Any], knob_values: dict[str, Any],
                        timeout_flag: str = "--timeout") -> Any:
    """A ProbeRequest from the shared probe options and typed knob values."""
    from autotune.config import make_probe_config, parse_bytes, parse_duration_s
    from autotune.models import get_model_spec
    from autotune.result import ProbeRequest

    if options["model_path"] is None:
        get_model_spec(options["model"])
    gpu_ids = None
    if options["gpus"]:
        try:
            gpu_ids = tuple(int(x) for x in options["gpus"].split(","))
        except ValueError:
            raise ConfigError(f"--gpus {options['gpus']!r}: expected ids such as 0 or 0,1") \
                from None

    def size(flag: str) -> int | None:
        raw = options[flag.lstrip("-").replace("-", "_")]
        return parse_bytes(raw, flag) if raw is not None else None

    return ProbeRequest(
        model=options["model"], config=make_probe_config(knob_values),
        model_path=options["model_path"], device=options["device"], gpu_ids=gpu_ids,
        cpu_threads=options["cpu_threads"], gpu_memory_limit_bytes=size("--gpu-memory-limit"),
        reserve_gpu_memory_bytes=size("--reserve-gpu-memory") or 0,
        host_memory_limit_bytes=size("--host-memory-limit"),
        timeout_s=parse_duration_s(options["timeout"], timeout_flag),
        warmup_steps=options["warmup_steps"], timed_steps=options["timed_steps"],
        seed=options["seed"], dtype=options["dtype"])


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "--version", prog_name="autotune")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
def cli(debug: bool) -> None:
    """Find the fastest memory-safe configuration for an RL fine-tuning run.

    \b
    autotune run                                     sweep (CPU demo without a GPU)
    autotune run --model qwen2.5-vl-7b --timeout 8h  overnight sweep on this machine's GPUs
    autotune show                                    trials, Pareto front, best config
    autotune estimate --model qwen2.5-7b --gpus 8    memory per phase, before probing
    autotune validate search_spaces/grpo.yaml        check a search space
    autotune models                                  the model registry
    autotune probe --model tiny-qwen2.5              one real GRPO step, measured
    autotune probe --model qwen2.5-0.5b --set micro_batch_size_update=8 --json
    """
    _state["debug"] = debug


@cli.command()
@click.option("--model-path", type=click.Path(file_okay=False), default=None,
              help="Also count a local checkpoint or config directory.")
def models(model_path: str | None) -> None:
    """List the registry: each model's parameter count, built on the meta device.

    \b
    autotune models
    autotune models --model-path ./my-checkpoint
    """
    from autotune.models import REGISTRY, count_params, load_model_config
    from autotune.report import format_table

    rows = []
    for name, spec in REGISTRY.items():
        params = count_params(load_model_config(name))
        card = f"{spec.card_params:.3f}B" if spec.card_params else "-"
        rows.append({"model": name, "kind": spec.kind, "params": f"{params / 1e9:.3f}B",
                     "card": card, "source": spec.hf_id})
    if model_path:
        params = count_params(load_model_config("", model_path))
        rows.append({"model": model_path, "kind": "local", "params": f"{params / 1e9:.3f}B",
                     "card": "-", "source": "--model-path"})
    click.echo(format_table(rows, ["model", "kind", "params", "card", "source"]))


@cli.command()
@probe_options()
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Set a knob, repeatable: --set micro_batch_size_update=8.")
@click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
              help="Keep the probe's full output in this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def probe(assignments: tuple[str, ...], log_path: str | None, as_json: bool,
          **options: Any) -> None:
    """Run one probe: a real GRPO training step in its own process, measured.

    Exit code 0 when it fits, 1 when it failed (OOM, timeout, crash), 2 for bad input.

    \b
    autotune probe --model tiny-qwen2.5
    autotune probe --model qwen2.5-0.5b --set micro_batch_size_update=8 --json
    autotune probe --model qwen2.5-7b --gpu-memory-limit 40GiB --set offload_params=true
    """
    from pathlib import Path

    from autotune.config import parse_assignments
    from autotune.report import format_probe_result
    from autotune.result import ProbeStatus
    from autotune.runners.local import SubprocessRunner

    request = build_probe_request(options, parse_assignments(assignments))
    if log_path is not None and Path(log_path).exists():
        raise ConfigError(f"--log {log_path}: file exists; choose a new path")
    click.echo(f"probing {request.model} on {request.device} ...", err=True)
    result = SubprocessRunner().run(request, Path(log_path) if log_path else None)
    click.echo(result.to_json() if as_json else format_probe_result(result, request.model))
    if result.status is ProbeStatus.INVALID:
        sys.exit(2)
    sys.exit(0 if result.ok else 1)


DEMO = {"model": "tiny-qwen2.5", "space": "cpu-demo", "device": "cpu",
        "gpu_memory_limit": "560MiB", "timed_steps": 1, "trials": 12}
GPU_DEFAULT = {"model": "qwen2.5-0.5b", "space": "grpo", "trials": 40}


def has_nvidia_gpu() -> bool:
    """Whether NVML sees a GPU (no torch import, no CUDA context)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return False


@cli.command()
@probe_options(model_required=False, timeout_flag="--probe-timeout")
@click.option("--space", default=None, metavar="NAME|FILE",
              help="Search space: a file or a name in search_spaces/ (default: grpo on a GPU, "
                   "cpu-demo on a CPU).")
@click.option("--study", default=None, help="Study name (default: MODEL-SPACE); the same name "
              "resumes it.")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results",
              show_default=True, help="Where results/<study>/ goes.")
@click.option("--objective", type=click.Choice(["throughput_per_memory", "throughput", "pareto"]),
              default="throughput_per_memory", show_default=True)
@click.option("--headroom", default="10%", show_default=True,
              help="Device memory kept free in every phase of a feasible config.")
@click.option("--trials", type=click.IntRange(1), default=None,
              help="Stop after N probes in the study (default 40; 12 for the CPU demo).")
@click.option("--timeout", "timeout_total", default=None, metavar="DURATION",
              help="Start no probe after this long, e.g. 8h.")
@click.option("--patience", type=click.IntRange(1), default=None,
              help="Stop after K probes without a better feasible config.")
@click.option("--sampler", type=click.Choice(["tpe", "random"]), default="tpe",
              show_default=True, help="Optuna sampler (seeded with --seed).")
@click.option("--base-config", type=click.Path(dir_okay=False), default=None,
              help="YAML of knobs: fixed ones override the space, searched ones are tried "
                   "right after the safe first config.")
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Fix a knob the space does not search: --set max_response_length=2048.")
@click.option("--no-prune", is_flag=True,
              help="Probe even configs that a measured OOM proves cannot fit.")
@click.option("--no-prescreen", is_flag=True,
              help="Probe even configs the calibrated memory model puts well past capacity.")
@click.pass_context
def run(ctx: click.Context, space: str | None, study: str | None, results_dir: str,
        objective: str, headroom: str, trials: int | None, timeout_total: str | None,
        patience: int | None, sampler: str, base_config: str | None,
        assignments: tuple[str, ...], no_prune: bool, no_prescreen: bool,
        **options: Any) -> None:
    """Sweep: probe configurations with Optuna until a stop rule, keep the best that fits.

    Without --model it runs an embedded default: on a machine with no NVIDIA GPU, the tiny
    model on the CPU with a 560 MiB device cap so that some configs run out of memory.
    Kill it at any time; the same command resumes it. Writes results/<study>/: study.db,
    trials.csv, logs/ and best.yaml.

    \b
    autotune run
    autotune run --model qwen2.5-vl-7b --trials 60 --timeout 8h
    autotune run --model qwen2.5-7b --gpu-memory-limit 40GiB --objective pareto
    """
    import re
    import signal
    from pathlib import Path

    from autotune.config import (
        load_knob_file,
        parse_assignments,
        parse_duration_s,
        parse_headroom,
    )
    from autotune.search_space import load_search_space
    from autotune.tuner import SweepSettings

    def is_default(name: str) -> bool:
        return ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT

    if options["model"] is None and options["model_path"] is None:
        defaults = GPU_DEFAULT if has_nvidia_gpu() and options["device"] != "cpu" else DEMO
        options["model"] = defaults["model"]
        if defaults is DEMO:
            options["device"] = "cpu"
            if options["gpu_memory_limit"] is None:
                options["gpu_memory_limit"] = DEMO["gpu_memory_limit"]
            if is_default("timed_steps"):
                options["timed_steps"] = DEMO["timed_steps"]
        space = space or defaults["space"]
        trials = trials if trials or timeout_total or patience else defaults["trials"]
        click.echo(f"no --model: running the embedded default, {options['model']} on "
                   f"{options['device']} over search space {space}", err=True)
    options["model"] = options["model"] or Path(options["model_path"]).name
    if trials is None and timeout_total is None and patience is None:
        trials = GPU_DEFAULT["trials"]
    if space is None:  # GRPO's real shapes take minutes per probe on a CPU
        on_cpu = options["device"] == "cpu" or (options["device"] == "auto"
                                                 and not has_nvidia_gpu())
        space = DEMO["space"] if on_cpu else GPU_DEFAULT["space"]
    base = load_knob_file(base_config) if base_config is not None else {}
    search_space, base_params = load_search_space(space).with_user_values(
        parse_assignments(assignments), base, base_config)
    name = study or f"{options['model']}-{search_space.name}"
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(f"--study {name!r}: use letters, digits, '.', '_' and '-'")
    settings = SweepSettings(
        study_name=name, study_dir=Path(results_dir) / name, space=search_space,
        request=build_probe_request(options, {}, "--probe-timeout"), objective=objective,
        headroom=parse_headroom(headroom), max_trials=trials,
        timeout_s=parse_duration_s(timeout_total, "--timeout") if timeout_total else None,
        patience=patience, seed=options["seed"], sampler=sampler, base_params=base_params,
        prune_dominated=not no_prune, prescreen=not no_prescreen)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    sys.exit(run_sweep(settings))


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_sweep(settings: Any) -> int:
    """Run a sweep with live progress and artifacts; print the outcome; the exit code."""
    from autotune.artifacts import write_artifacts
    from autotune.progress import make_progress
    from autotune.report import format_study
    from autotune.runners.local import SubprocessRunner
    from autotune.tuner import Sweep

    sweep = Sweep(settings, SubprocessRunner(), make_progress(),
                  on_trial=lambda study: write_artifacts(study, settings.study_dir))
    try:
        study = sweep.run()
    except KeyboardInterrupt:
        click.echo(f"Interrupted; nothing is lost. Resume with the same command "
                   f"(study {settings.study_name}).", err=True)
        return 130
    best = write_artifacts(study, settings.study_dir)
    click.echo(format_study(study, brief=True))
    click.echo(f"\nresults in {settings.study_dir}/ (trials.csv, logs/, study.db"
               f"{', best.yaml' if best else ''})")
    if best is None:
        click.echo("no feasible configuration found: widen the space (offload, checkpointing,"
                   " smaller micro-batches), lower --headroom or use more memory", err=True)
        return 1
    return 0


@cli.command()
@click.option("--study", default=None, help="Study name (default: the latest in --results-dir).")
@click.option("--results-dir", type=click.Path(file_okay=False), default="results",
              show_default=True)
def show(study: str | None, results_dir: str) -> None:
    """Print a study's trials, its Pareto front and its best configuration.

    \b
    autotune show
    autotune show --study qwen2.5-7b-grpo
    """
    from autotune.report import format_study, load_study

    click.echo(format_study(load_study(results_dir, study)))


@cli.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
def validate(files: tuple[str, ...]) -> None:
    """Check search-space files; report every problem with its file and key.

    \b
    autotune validate search_spaces/grpo.yaml
    """
    from autotune.search_space import check_search_space

    failed = False
    for path in files:
        try:
            space, problems = check_search_space(path)
        except ConfigError as err:
            space, problems = None, err.problems
        for problem in problems:
            click.echo(problem, err=True)
        if problems or space is None:
            failed = True
            continue
        valid = space.valid_grid()
        count = f"{len(valid)} valid of {space.grid_size}" if valid is not None else \
            f"{space.grid_size} (too many to list)"
        click.echo(f"{path}: ok, {len(space.params)} searched knobs, {count} configs, "
                   f"hash {space.space_hash}")
    sys.exit(2 if failed else 0)


cli.add_command(estimate)
cli.add_command(export)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command, turning known errors into one line and an exit code."""
    try:
        cli.main(args=argv, prog_name="autotune", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except AutotuneError as err:
        if _state["debug"]:
            raise
        click.echo(f"Error: {err}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
