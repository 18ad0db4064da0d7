"""`autotune run`: the sweep command, its embedded defaults, and the run it drives.

Without --model it runs an embedded default (the tiny model on the CPU under a 545 MiB cap
when no NVIDIA GPU is visible). With --trainer it samples only configs that trainer accepts
for the given nodes and GPUs, seeds the trainer's starting config as a trial, and writes
results/<study>/best.<trainer>.yaml next to best.yaml.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import click

from autotune.cli.launch import command_defaults, command_ranks, command_setup
from autotune.cli.options import (
    build_probe_request,
    default_topology,
    engine_knobs,
    probe_options,
)
from autotune.errors import ConfigError
from autotune.hardware import has_nvidia_gpu

DEMO = {"model": "tiny-qwen2.5", "space": "cpu-demo", "device": "cpu",
        "gpu_memory_limit": "545MiB", "timed_steps": 1, "trials": 12}
GPU_DEFAULT = {"model": "qwen2.5-0.5b", "space": "grpo", "trials": 40}


@click.command()
@probe_options(model_required=False)
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
@click.option("--no-trace", is_flag=True,
              help="Pre-screen with the memory model only: do not trace candidates near the "
                   "memory wall with fake tensors first.")
@click.option("--parallel", type=click.IntRange(1), default=None,
              help="Probes at once: on a CPU, split the cores this many ways; on GPUs, at most "
                   "GPUs / --gpus-per-trial (the default); on Ray, what the cluster holds.")
@click.option("--gpus-per-trial", type=click.IntRange(1), default=1, show_default=True,
              help="GPUs pinned to each probe (CUDA_VISIBLE_DEVICES); G GPUs run G/g at once.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="Where probes run: subprocesses here, or Ray tasks on a "
                                      "Ray cluster (pip install 'autotune[ray]').")
@click.option("--address", default=None, metavar="auto|HOST:PORT",
              help="The Ray cluster for --executor ray (default: start Ray on this machine).")
@click.option("--storage", default=None, metavar="URL|FILE",
              help="Where the study lives when several drivers share it: a PostgreSQL URL or "
                   "a journal file on a shared disk (default: SQLite in results/<study>/).")
@click.option("--heartbeat", "heartbeat", default="10s", hidden=True,
              help="Shared storage: how often a running trial says it is alive.")
@click.option("--confirm", type=click.IntRange(0), default=3, show_default=True,
              help="After a sweep of emulated ranks, probe its best K configs again with the "
                   "run's real ranks when they are all on this machine (0: don't).")
@click.option("--trainer", type=click.Choice(["easyr1", "verl", "trl"]), default=None,
              help="Sample only configs this trainer accepts, start from its config "
                   "(--base-config is then its YAML), write best.<trainer>.yaml.")
@click.option("--launch", default=None, metavar="'CMD ... {config}'",
              help="With --trainer: probe your own trainer. Each trial runs this launch line "
                   "for a few steps, {config} replaced by the trial's config file "
                   "({overrides}: key=value words instead).")
@click.pass_context
def run(ctx: click.Context, space: str | None, study: str | None, results_dir: str,
        objective: str, headroom: str, trials: int | None, timeout_total: str | None,
        patience: int | None, sampler: str, base_config: str | None,
        assignments: tuple[str, ...], no_prune: bool, no_prescreen: bool, no_trace: bool,
        parallel: int | None, gpus_per_trial: int, executor: str, address: str | None,
        storage: str | None, heartbeat: str, confirm: int, trainer: str | None, launch: str | None,
        **options: Any) -> None:
    """Sweep: probe configurations with Optuna until a stop rule, keep the best that fits.

    Without --model it runs an embedded default: on a machine with no NVIDIA GPU, the tiny
    model on the CPU with a 545 MiB device cap so that some configs run out of memory.
    Kill it at any time; the same command resumes it. Writes results/<study>/: study.db,
    trials.csv, logs/ and best.yaml.

    \b
    autotune run
    autotune run --model qwen2.5-vl-7b --trials 60 --timeout 8h
    autotune run --model qwen2.5-7b --gpu-memory-limit 40GiB --objective pareto
    autotune run --model qwen2.5-7b --trainer easyr1 --base-config examples/config.yaml
    autotune run --trainer trl --base-config grpo.yaml --launch "python train.py --config {config}"
    autotune run --model qwen2.5-7b --gpus-per-trial 1          # 8 GPUs: 8 probes at once
    autotune run --model qwen2.5-7b --executor ray --address auto --storage postgresql://db/at
    """
    import signal

    from autotune.config import (
        Topology,
        load_knob_file,
        parse_assignments,
        parse_duration_s,
        parse_headroom,
    )
    from autotune.sweep.preflight import check_model_on_device
    from autotune.sweep.search_space import load_search_space
    from autotune.sweep.settings import SweepSettings
    from autotune.sweep.storage import check_storage, check_study_name

    if address is not None and executor != "ray":
        raise ConfigError("--address: only with --executor ray")
    if storage is not None:  # a bad --storage is refused before anything is said or made
        check_storage(storage)
    if launch is not None:
        space = command_defaults(trainer, options, space)
    note, space, trials = embedded_default(ctx, options, space, trials, timeout_total,
                                           patience)
    loaded = load_search_space(space)
    if loaded.trainer_keys and launch is None:
        raise ConfigError(f"{loaded.source}: searches the trainer's own keys "
                          f"({', '.join(loaded.trainer_keys)}); only a run of your trainer can "
                          "apply them: add --trainer and --launch")
    if trainer is None:  # with --trainer, its base config's topology is the default
        default_topology(options)
    export_to, topology = None, Topology(options["nnodes"] or 1, options["gpus_per_node"] or 1)
    if trainer is not None:
        export_to, base, loaded = trainer_setup(trainer, base_config, loaded, options)
        topology = export_to[2]
    else:
        base = load_knob_file(base_config) if base_config is not None else {}
    loaded = loaded.for_world(topology.world_size)
    user = parse_assignments(assignments)
    named = frozenset({*loaded.params, *loaded.fixed, *user, *base})
    search_space, base_params = loaded.with_user_values(
        {**engine_knobs(options, trainer, named), **user}, base, base_config or trainer)
    if export_to is not None and base_params is None:
        base_params = search_space.safe_params()  # the trainer's start is the safest config
    name = check_study_name(study if study is not None else
                            f"{options['model']}-{search_space.name}")
    options.update(nnodes=topology.nnodes, gpus_per_node=topology.gpus_per_node)
    command = None
    if launch is not None:
        ranks_note, confirm, gpus_per_trial = command_ranks(ctx, options, topology,
                                                            gpus_per_trial)
        command = command_setup(export_to, launch, search_space, options)
    else:
        ranks_note, confirm, gpus_per_trial = plan_ranks(ctx, options, executor, confirm,
                                                         gpus_per_trial)
    safe = search_space.config_for(search_space.safe_params())  # the template's config
    request = build_probe_request(options, safe.as_dict(), local=executor == "local",
                                  check_rules=False, known_model=command is None)
    if command is None:
        check_model_on_device(request, safe, device_checks=executor == "local")
    runner, slots = make_runner(executor, address, request, parallel, gpus_per_trial)
    settings = SweepSettings(
        study_name=name, study_dir=Path(results_dir) / name, space=search_space,
        request=request, objective=objective,
        headroom=parse_headroom(headroom), max_trials=trials,
        timeout_s=parse_duration_s(timeout_total, "--timeout") if timeout_total else None,
        patience=patience, seed=options["seed"], sampler=sampler, base_params=base_params,
        prune_dominated=not no_prune, prescreen=not no_prescreen, trace=not no_trace,
        trainer=f"{trainer} on {topology.nnodes}x{topology.gpus_per_node} GPUs"
        if export_to else None, storage=storage, slots=tuple(slots),
        heartbeat_s=parse_duration_s(heartbeat, "--heartbeat"), confirm=confirm,
        command=command)
    for line in (note, ranks_note):
        if line:
            click.echo(line, err=True)
    if len(slots) > 1:
        click.echo(f"{len(slots)} probes at a time ({executor}): "
                   f"{' | '.join(slot.describe() for slot in slots)}", err=True)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    sys.exit(run_sweep(settings, export_to, runner))


def embedded_default(ctx: click.Context, options: dict[str, Any], space: str | None,
                     trials: int | None, timeout_total: str | None, patience: int | None
                     ) -> tuple[str | None, str, int | None]:
    """Without --model, the embedded default: the tiny model on the CPU under a 545 MiB cap
    where no NVIDIA GPU is visible, qwen2.5-0.5b on the GPU otherwise. Fills `options` in
    place; returns the note to print once the sweep starts, the space and the budget."""
    note = None
    if options["model"] is None and options["model_path"] is None:
        if options["device"] == "cuda" and not has_nvidia_gpu():
            raise ConfigError("--device cuda: no NVIDIA GPU is visible on this machine; use "
                              "--device cpu (the CPU demo), or run where a GPU is")
        defaults = GPU_DEFAULT if has_nvidia_gpu() and options["device"] != "cpu" else DEMO
        options["model"] = defaults["model"]
        if defaults is DEMO:
            options["device"] = "cpu"
            if options["gpu_memory_limit"] is None:
                options["gpu_memory_limit"] = DEMO["gpu_memory_limit"]
            if ctx.get_parameter_source("timed_steps") == click.core.ParameterSource.DEFAULT:
                options["timed_steps"] = DEMO["timed_steps"]
        space = space or defaults["space"]
        trials = trials if trials or timeout_total or patience else defaults["trials"]
        note = (f"no --model: running the embedded default, {options['model']} on "
                f"{options['device']} over search space {space}")
    options["model"] = options["model"] or Path(options["model_path"]).name
    if trials is None and timeout_total is None and patience is None:
        trials = GPU_DEFAULT["trials"]
    if space is None:  # GRPO's real shapes take minutes per probe on a CPU (a model that is
        # not tiny, on a CPU it found by itself, is refused by the preflight in its own words)
        from autotune.registry import REGISTRY

        tiny = options["model_path"] is None and options["model"] in REGISTRY and \
            REGISTRY[options["model"]].tiny
        on_cpu = options["device"] == "cpu" or (options["device"] == "auto"
                                                 and not has_nvidia_gpu() and tiny)
        space = DEMO["space"] if on_cpu else GPU_DEFAULT["space"]
    return note, space, trials


def plan_ranks(ctx: click.Context, options: dict[str, Any], executor: str, confirm: int,
               gpus_per_trial: int) -> tuple[str | None, int, int]:
    """How a sweep of a W-GPU run probes: --ranks auto searches with emulated ranks (one
    device per probe, probes side by side) and confirms the best with real ones when the W
    GPUs are all here; real ranks take W GPUs a probe. Returns a note, --confirm in force and
    --gpus-per-trial."""
    from autotune.cli.options import local_ranks

    world = (options["nnodes"] or 1) * (options["gpus_per_node"] or 1)
    if world == 1:
        return None, 0, gpus_per_trial
    given = tuple(options["gpus"].split(",")) if options["gpus"] else None
    here = local_ranks(options["device"], given)
    fits = executor == "local" and world <= here
    if options["ranks"] == "real":
        if options["device"] != "cpu" and \
                ctx.get_parameter_source("gpus_per_trial") == click.core.ParameterSource.DEFAULT:
            gpus_per_trial = world
        return f"probes run the run's {world} ranks for real, one probe at a time", 0, \
            gpus_per_trial
    options["ranks"] = "emulated"
    if not fits:
        return (f"probes emulate one rank of the run's {world} GPUs (exact per-rank memory, "
                f"time without communication): its ranks are not all on this machine "
                f"({here} {'cores' if options['device'] == 'cpu' else 'GPUs'} here), so "
                "nothing can be confirmed with real ranks"), 0, gpus_per_trial
    confirm_note = f"; the best {confirm} are then probed with {world} real ranks" \
        if confirm else ""
    return (f"probes emulate one rank of the run's {world} GPUs (exact per-rank memory, time "
            f"without communication){confirm_note}"), confirm, gpus_per_trial


def trainer_setup(trainer: str, base_config: str | None, loaded: Any,
                  options: dict[str, Any]) -> tuple[tuple[Any, Any, Any], dict[str, Any], Any]:
    """--trainer: its rules on the space, its starting config, and where best.<trainer>.yaml
    comes from: (adapter, the user's trainer YAML or None, topology), the start, the space."""
    from autotune.trainers import get_adapter
    from autotune.trainers.export import dotted_get, trainer_start
    from autotune.trainers.plan import refused_settings

    adapter = get_adapter(trainer)
    trainer_base, topology, start = trainer_start(adapter, base_config, options["nnodes"],
                                                  options["gpus_per_node"])
    refused = refused_settings(adapter, trainer_base[0]) if trainer_base else []
    if refused:
        raise ConfigError([f"--base-config {base_config}: {line}" for line in refused])
    if trainer_base is None:  # the trainer's defaults seed the searched knobs only
        start = {k: v for k, v in start.items() if k in loaded.params}
    start, notes = loaded.snapped(start)
    for note in notes:
        click.echo(f"{trainer} starting config: {note}", err=True)
    tree = trainer_base[0] if trainer_base else {}
    loaded = loaded.with_rules(lambda config: adapter.check(
        config.as_dict(), topology, lambda key, default: dotted_get(tree, key, default)))
    return (adapter, trainer_base, topology), start, loaded


def make_runner(executor: str, address: str | None, request: Any, parallel: int | None,
                gpus_per_trial: int) -> tuple[Any, list[Any]]:
    """The runner for --executor and the slots its probes run in side by side."""
    from autotune.runners import get_runner
    from autotune.sweep.parallel import Slot, plan_slots

    if executor == "local":
        return get_runner("local"), plan_slots(request.device, request.gpu_ids, gpus_per_trial,
                                               parallel, request.cpu_threads)
    runner = get_runner("ray", address=address, num_cpus_per_probe=request.cpu_threads or 1,
                        num_gpus_per_probe=0 if request.device == "cpu" else gpus_per_trial)
    if runner.num_gpus_per_probe and not runner.cluster_gpus():
        if request.device == "cuda":
            runner.close()
            raise ConfigError("--device cuda: the Ray cluster has no GPUs; use --device cpu "
                              "or start Ray on GPU nodes")
        runner.num_gpus_per_probe = 0  # --device auto on a CPU cluster: probes on CPUs
    count = parallel or runner.probe_slots()
    return runner, [Slot(cpu_threads=request.cpu_threads) for _ in range(count)]


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run_sweep(settings: Any, export_to: tuple[Any, Any, Any] | None = None,
              runner: Any = None) -> int:
    """Run a sweep with live progress and artifacts; print the outcome; the exit code."""
    from autotune.cli.report import write_study_report
    from autotune.cli.text import format_study
    from autotune.runners.local import SubprocessRunner
    from autotune.sweep.artifacts import write_artifacts, write_trainer_export
    from autotune.sweep.confirm import confirm_best
    from autotune.sweep.progress import make_progress
    from autotune.sweep.tuner import Sweep

    def artifacts(study: Any) -> Any:
        best = write_artifacts(study, settings.study_dir)
        if export_to is not None:
            write_trainer_export(study, settings.study_dir, *export_to)
        return best

    runner = runner or SubprocessRunner()
    sweep = Sweep(settings, runner, make_progress(), on_trial=artifacts)
    try:
        study = sweep.run()
        if settings.confirm and sweep.nothing_fits is None:
            confirm_best(study, settings, runner, sweep.feasibility.capacity_bytes,
                         say=lambda line: click.echo(line, err=True))
    except KeyboardInterrupt:
        if sweep.study is not None:  # the files agree with the study as it was left
            with contextlib.suppress(Exception):
                artifacts(sweep.study)
        click.echo(f"Interrupted; nothing is lost. Resume with the same command "
                   f"(study {settings.study_name}).", err=True)
        return 130
    finally:
        if hasattr(runner, "close"):
            runner.close()  # a Ray runner disconnects (and stops a Ray it started)
    best = artifacts(study)  # rewritten from the storage, other drivers' trials included
    click.echo(format_study(study, brief=True))
    click.echo(f"\n{write_study_report(study, settings.study_dir)}")
    exported = f", best.{export_to[0].name}.yaml" if export_to and best else ""
    files = f"trials.csv, logs/{', best.yaml' if best else ''}{exported}"
    if settings.storage is None:
        click.echo(f"\nresults in {settings.study_dir}/ ({files}, study.db)")
    else:
        others = sweep.others_running
        still = f"; {others} probe(s) of other drivers still running in it" if others else ""
        click.echo(f"\nstudy {settings.study_name} lives in {sweep.where}, shared by every "
                   f"driver on it{still}. {settings.study_dir}/ holds this driver's logs and "
                   f"{files}, rewritten from the study as it stood when this driver stopped; "
                   f"`autotune show --study {settings.study_name} --storage {sweep.where}` "
                   "reads it as it stands")
    if best is None:
        click.echo(sweep.nothing_fits or "no feasible configuration found: widen the space "
                   "(offload, checkpointing, smaller micro-batches), lower --headroom or use "
                   "more memory", err=True)
        return 1
    return 0
