"""`autotune run`: the sweep command. Parses its options, plans the sweep (sweep/plan.py), says
the plan, runs it (sweep/driver.py), writes the report and prints the outcome."""

from __future__ import annotations

import signal
import sys
from typing import Any

import click

from autotune.cli import options as opt

MAX_FINALISTS = 32  # --finalists and --confirm: configs probed again at the end


@click.command()
@opt.probe_options
@click.option("--space", default=None, metavar="NAME|FILE",
              help="Search space: a file, or a space autotune ships (`autotune spaces`; "
                   "default: grpo on a GPU, cpu-demo on a CPU, the trainer's own with --launch).")
@opt.host_memory
@opt.study
@opt.results_dir
@opt.objective
@opt.headroom
@click.option("--trials", type=click.IntRange(1), default=None,
              help="Stop after N probes in the study (default 40; 12 for the CPU demo).")
@click.option("--timeout", "timeout_s", type=opt.DURATION, default=None, metavar="DURATION",
              help="Start no search probe after this long, e.g. 8h (each run settles one "
                   "trial first; the finalists' repeats follow: --finalists 0 skips them).")
@click.option("--patience", type=click.IntRange(1), default=None,
              help="Stop after K probes without a better feasible config.")
@opt.sampler
@opt.base_config
@click.option("--no-prune", "prune", is_flag=True, flag_value=False, default=True,
              help="Probe even configs that a measured OOM proves cannot fit.")
@click.option("--no-prescreen", "prescreen", is_flag=True, flag_value=False, default=True,
              help="Probe even configs the calibrated memory model puts well past capacity.")
@click.option("--no-trace", "trace", is_flag=True, flag_value=False, default=True,
              help="Pre-screen with the memory model only: do not trace candidates near the "
                   "memory wall with fake tensors first.")
@click.option("--no-stop-slow", "stop_slow", is_flag=True, flag_value=False, default=True,
              help="Run every probe's timed steps, even once what it measured puts it under "
                   "the best config by more than the noise.")
@click.option("--parallel", type=click.IntRange(1), default=None,
              help="Probes at once: on a CPU, split the cores this many ways; on GPUs, at most "
                   "GPUs / --gpus-per-trial (the default); on Ray, what the cluster holds.")
@click.option("--gpus-per-trial", type=click.IntRange(1), default=None,
              help="GPUs pinned to each probe (default 1; real ranks: the run's GPUs).")
@opt.executor
@click.option("--address", default=None, metavar="auto|HOST:PORT",
              help="The Ray cluster for --executor ray (default: start Ray on this machine).")
@opt.storage
@click.option("--heartbeat", "heartbeat_s", type=opt.DURATION, default="10s", hidden=True,
              help="Shared storage: how often a running trial says it is alive.")
@click.option("--confirm", type=click.IntRange(0, MAX_FINALISTS), default=3, show_default=True,
              help="After a sweep of emulated ranks, probe its best K configs again with the "
                   "run's real ranks when they are all on this machine (0: don't).")
@click.option("--finalists", type=click.IntRange(0, MAX_FINALISTS), default=3,
              show_default=True,
              help="When the search stops, probe its best K configs again, round robin, until "
                   "the leader stands apart from the rest beyond the measured noise (at most 3 "
                   "probes each); 0: pick from single probes.")
@opt.trainer
@click.option("--launch", default=None, metavar="'CMD ... {config}'",
              help="With --trainer: probe your own trainer. Each trial runs this launch line "
                   "for a few steps, {config} replaced by the trial's config file "
                   "({overrides}: key=value words instead).")
def run(**given: Any) -> None:
    """Sweep: probe configurations with Optuna until a stop rule, keep the best that fits.

    Without --model it runs an embedded default: on a machine with no NVIDIA GPU, the tiny
    model on the CPU with a 545 MiB device cap so that some configs run out of memory.
    Kill it at any time; the same command resumes it. Writes results/<study>/: study.db,
    trials.csv, logs/, best.yaml and report.html.

    \b
    autotune run
    autotune run --model qwen2.5-vl-7b --trials 60 --timeout 8h
    autotune run --model qwen2.5-7b --gpu-memory-limit 40GiB --objective pareto
    autotune run --model qwen2.5-7b --trainer easyr1 --base-config examples/config.yaml
    autotune run --trainer trl --base-config grpo.yaml --launch "python train.py --config {config}"
    autotune run --model qwen2.5-7b --gpus-per-trial 1          # 8 GPUs: 8 probes at once
    autotune run --model qwen2.5-7b --executor ray --address auto --storage postgresql://db/at
    """
    from autotune.cli.report import write_study_report
    from autotune.cli.text import format_outcome
    from autotune.sweep.driver import run_sweep
    from autotune.sweep.plan import RunOptions, plan_sweep
    from autotune.sweep.progress import make_progress

    probe = opt.take_probe_options(given)
    plan = plan_sweep(RunOptions(probe=probe, **given))
    for line in plan.notes:
        click.echo(line, err=True)
    interrupt_on_sigterm()
    outcome = run_sweep(plan, make_progress(), say=lambda line: click.echo(line, err=True))
    if outcome.interrupted:
        click.echo(f"Interrupted; nothing is lost. Resume with the same command "
                   f"(study {plan.settings.study_name}).", err=True)
        sys.exit(outcome.exit_code)
    report = write_study_report(outcome.study, plan.settings.study_dir)
    out, err = format_outcome(outcome, plan.settings, report)
    click.echo(out)
    if err:
        click.echo(err, err=True)
    sys.exit(outcome.exit_code)


def interrupt_on_sigterm() -> None:
    """SIGTERM ends the command as Ctrl-C does: its probes die, nothing is lost. A connection
    pool's cleanup that a Ctrl-C cuts logs the interrupt's traceback before passing it on;
    the stop is said in one line instead (interrupts.no_interrupt_tracebacks)."""
    from autotune.sweep.execution.interrupts import no_interrupt_tracebacks

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    no_interrupt_tracebacks("sqlalchemy.pool")
