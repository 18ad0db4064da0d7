"""`autotune report`: a study as one HTML page; and the report `run` writes when a sweep ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from autotune.cli import options as opt
from autotune.errors import AutotuneError


@click.command()
@opt.study_options
@opt.out_path
def report(study: str | None, results_dir: str, storage: str | None,
           out_path: str | None) -> None:
    """Write a study's report: one self-contained HTML page of plots (opens offline).

    Throughput against peak memory with the OOM wall, per-phase memory of the best configs,
    the sweep over time, knob importances and slices, the memory model against measurement.
    Needs plotly: pip install 'autotune[report]'.

    \b
    autotune report
    autotune report --study qwen2.5-7b-grpo --out ~/qwen-report.html
    """
    from autotune.report import REPORT_NAME, require_plotly, write_report
    from autotune.sweep.study.storage import load_study

    require_plotly()
    loaded = load_study(results_dir, study, storage)
    if out_path is None:
        path = Path(results_dir) / loaded.study_name / REPORT_NAME
        path.parent.mkdir(parents=True, exist_ok=True)  # a shared study read from elsewhere
    else:
        path = Path(out_path).expanduser()
    click.echo(str(write_report(loaded, path)))


def write_study_report(study: Any, study_dir: Path) -> str:
    """At the end of a sweep: write results/<study>/report.html; the line that says where, or
    why not (the sweep's own results are already safe, so this never fails the run)."""
    from autotune.report import REPORT_NAME, write_report

    try:
        return f"report: {write_report(study, study_dir / REPORT_NAME)}"
    except AutotuneError as err:
        return f"no report: {err}"
    except Exception as err:  # a bug in the report must not cost the sweep its exit code
        return (f"no report: {type(err).__name__}: {err} (run `autotune --debug report "
                f"--study {study.study_name}` for the traceback, and please report it)")
