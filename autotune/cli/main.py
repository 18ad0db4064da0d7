"""The `autotune` command: thin click commands over the library.

The only place that turns an AutotuneError into one line on stderr and an exit code (2 for
bad input). torch, transformers and ray are imported inside commands, never at import time, so
`autotune --help` is instant.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from autotune.cli import options as opt
from autotune.cli.estimate import estimate
from autotune.cli.export import export
from autotune.cli.report import report
from autotune.cli.run import run
from autotune.errors import AutotuneError, ConfigError
from autotune.version import __version__

_state = {"debug": False}
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "--version", prog_name="autotune")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
def cli(debug: bool) -> None:
    """Find the fastest memory-safe configuration for an RL fine-tuning run.

    \b
    autotune run                                     sweep (CPU demo without a GPU)
    autotune run --model qwen2.5-vl-7b --timeout 8h  overnight sweep on this machine's GPUs
    autotune show                                    trials, Pareto front, best config
    autotune report                                  the study as one HTML page of plots
    autotune estimate --model qwen2.5-7b --gpus-per-node 8   memory per phase, no probe
    autotune spaces                                  the search spaces autotune ships
    autotune validate grpo                           check a search space
    autotune models                                  the model registry
    autotune probe --model tiny-qwen2.5              one real GRPO step, measured
    autotune probe --model qwen2.5-0.5b --set micro_batch_size_update=8 --json
    """
    _state["debug"] = debug


@cli.command()
@opt.model_path
def models(model_path: str | None) -> None:
    """List the registry: each model's parameter count, built on the meta device.

    \b
    autotune models
    autotune models --model-path ./my-checkpoint
    """
    from autotune.cli.text import format_table
    from autotune.probe.modeling.models import count_params, load_model_config
    from autotune.registry import REGISTRY

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
@opt.probe_options
@click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
              help="Keep the probe's full output in this file.")
@opt.as_json
def probe(log_path: str | None, as_json: bool, **given: Any) -> None:
    """Run one probe: a real GRPO training step in its own process, measured.

    Exit code 0 when it fits, 1 when it failed (OOM, timeout, crash), 2 for bad input.

    \b
    autotune probe --model tiny-qwen2.5
    autotune probe --model qwen2.5-0.5b --set micro_batch_size_update=8 --json
    autotune probe --model qwen2.5-7b --gpu-memory-limit 40GiB --set offload_params=true
    """
    from pathlib import Path

    from autotune.cli.run import interrupt_on_sigterm
    from autotune.cli.text import format_probe_result
    from autotune.probe.measure.result import ProbeStatus, probe_files
    from autotune.runners.local import SubprocessRunner
    from autotune.sweep.plan import plan_probe

    request = plan_probe(opt.take_probe_options(given))
    if log_path is not None:
        for path in (Path(log_path), *probe_files(Path(log_path))):
            if path.exists():
                raise ConfigError(f"--log {log_path}: {path} exists; choose a new path")
        if not Path(log_path).parent.is_dir():
            raise ConfigError(f"--log {log_path}: folder {Path(log_path).parent} does not "
                              "exist; create it first")
    interrupt_on_sigterm()  # the probe dies with this command
    click.echo(f"probing {request.model} on {request.device.kind} ...", err=True)
    result = SubprocessRunner().run(request, Path(log_path) if log_path else None)
    click.echo(result.to_json() if as_json else format_probe_result(result, request.model))
    if result.status is ProbeStatus.INVALID:
        sys.exit(2)
    sys.exit(0 if result.ok else 1)


@cli.command()
@opt.study_options
def show(study: str | None, results_dir: str, storage: str | None) -> None:
    """Print a study's trials, its Pareto front and its best configuration (read-only).

    \b
    autotune show
    autotune show --study qwen2.5-7b-grpo
    autotune show --study shared --storage /mnt/shared/study.journal
    """
    from pathlib import Path

    from autotune.cli.text import format_study
    from autotune.report import REPORT_NAME
    from autotune.sweep.study.storage import load_study

    loaded = load_study(results_dir, study, storage)
    click.echo(format_study(loaded))
    page = Path(results_dir) / loaded.study_name / REPORT_NAME
    click.echo(f"\nreport: {page}" if page.is_file() else
               f"\nno report yet: `autotune report --study {loaded.study_name}` writes one")


@cli.command()
@click.argument("files", nargs=-1, required=True, metavar="NAME|FILE...")
def validate(files: tuple[str, ...]) -> None:
    """Check search spaces (files, or names of those autotune ships); report every problem
    with its file and key.

    \b
    autotune validate grpo
    autotune validate my_space.yaml
    """
    from autotune.sweep.space.search_space import check_search_space

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


@cli.command()
def spaces() -> None:
    """List the search spaces autotune ships: each one's name, what it searches, its size.

    \b
    autotune spaces
    autotune run --space grpo-search-n
    """
    from autotune.cli.text import format_table
    from autotune.sweep.space.search_space import load_search_space, shipped_spaces

    rows = []
    for name in shipped_spaces():
        space = load_search_space(name)
        rows.append({"space": name, "searched": ", ".join(space.params),
                     "configs": space.grid_size, "file": space.source})
    click.echo(format_table(rows, ["space", "configs", "searched", "file"]))


cli.add_command(run)
cli.add_command(estimate)
cli.add_command(export)
cli.add_command(report)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command, turning every error into one line and an exit code (2
    for bad input, 1 for the environment: a full or read-only disk, a broken database). Only
    --debug shows a traceback."""
    try:
        cli.main(args=argv, prog_name="autotune", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.UsageError as err:  # one line, not click's usage block
        where = f" (see `{err.ctx.command_path} --help`)" if err.ctx is not None else ""
        message = " ".join(err.format_message().split())
        click.echo(f"Error: {message}{where}", err=True)
        sys.exit(err.exit_code)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    except Exception as err:
        if _state["debug"]:
            raise
        line, code = one_line(err)
        click.echo(f"Error: {line}", err=True)
        sys.exit(code)


def one_line(err: Exception) -> tuple[str, int]:
    """What to tell the user about an error that ended a command, and the exit code."""
    from autotune.files import describe_os_error

    cause = err.__cause__  # Optuna wraps the database's own error in a vaguer one
    if type(err).__name__ == "StorageInternalError" and isinstance(cause, Exception):
        err = cause
    if isinstance(err, AutotuneError):
        return str(err), err.exit_code
    if isinstance(err, OSError):
        return describe_os_error(err), 1
    if type(err).__module__.startswith("sqlalchemy"):  # the study's database refused
        text = str(getattr(err, "orig", err)).strip().splitlines()
        first = text[0] if text else type(err).__name__
        advice = {"database or disk is full": "free some space, then run the same command "
                  "again (nothing is lost)",
                  "attempt to write a readonly database": "the study is on a read-only disk "
                  "or file; copy it somewhere writable, or pass --results-dir",
                  "unable to open database file": "its folder is missing or not writable; "
                  "pass --results-dir to a writable folder"}
        hint = next((a for key, a in advice.items() if key in first), "")
        return f"the study's database: {first}" + (f"; {hint}" if hint else ""), 1
    text = str(err).strip().splitlines()
    return (f"internal error, {type(err).__name__}: {text[0] if text else ''} (run with --debug "
            "for the traceback, and please report it)"), 1
