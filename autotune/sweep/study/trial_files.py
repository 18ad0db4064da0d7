"""A trial's files under results/<study>/logs/, and reading a finished probe back at resume.

Each probed trial has `trial-00007.log` (the probe's output), `trial-00007.request.json` (what
was asked) and `trial-00007.result.json` (what the worker measured, written atomically by the
worker itself, then again by the driver with the runner's figures added); the names beside
the log are probe.result's (probe_files), the trial's own name is `trial_name`. A driver killed
between the worker's write and its own tell loses nothing: the next run finds the result here
and tells it. A result is only trusted when its request matches the trial's config.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.probe.measure.result import ProbeRequest, ProbeResult, probe_files

LOGS_DIR = "logs"  # under the study's folder: every trial's files


def trial_name(number: int) -> str:
    """What a trial's files are named by: trial-00007."""
    return f"trial-{number:05d}"


def log_path(study_dir: Path, number: int) -> Path:
    return Path(study_dir) / LOGS_DIR / f"{trial_name(number)}.log"


def request_path(study_dir: Path, number: int) -> Path:
    return probe_files(log_path(study_dir, number))[0]


def result_path(study_dir: Path, number: int) -> Path:
    return probe_files(log_path(study_dir, number))[1]


def read_saved_result(study_dir: Path, number: int, config: ProbeConfig) -> ProbeResult | None:
    """The result a probe of trial `number` left, if it is whole and was a probe of `config`
    (a request written for another config, by a study of the same name that was deleted and
    started again, never lends its result)."""
    saved = result_path(study_dir, number)
    try:
        result = ProbeResult.from_json(saved.read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None  # no result, or a torn or foreign file: the trial is probed again
    asked = request_path(study_dir, number)
    if asked.exists():
        try:
            if ProbeRequest.from_json(asked.read_text()).config != config:
                return None
        except (OSError, ValueError, TypeError, KeyError):
            return None
    return result


def remove_partial_files(study_dir: Path, number: int) -> None:
    """Temporary files a killed write of trial `number` left (`.trial-00007.*.tmp`)."""
    logs = Path(study_dir) / LOGS_DIR
    with contextlib.suppress(OSError):
        for tmp in logs.glob(f".{trial_name(number)}.*.tmp"):
            tmp.unlink(missing_ok=True)

