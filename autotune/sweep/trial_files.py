"""A trial's files under results/<study>/logs/, and reading a finished probe back at resume.

Each probed trial has `trial-00007.log` (the probe's output), `trial-00007.request.json` (what
was asked) and `trial-00007.result.json` (what the worker measured, written atomically by the
worker itself, then again by the driver with the runner's figures added). A driver killed
between the worker's write and its own tell loses nothing: the next run finds the result here
and tells it. A result is only trusted when its request matches the trial's config.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.probe.result import ProbeRequest, ProbeResult


def log_path(study_dir: Path, number: int) -> Path:
    return Path(study_dir) / "logs" / f"trial-{number:05d}.log"


def request_path(study_dir: Path, number: int) -> Path:
    return log_path(study_dir, number).with_suffix(".request.json")


def result_path(study_dir: Path, number: int) -> Path:
    return log_path(study_dir, number).with_suffix(".result.json")


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
    logs = Path(study_dir) / "logs"
    with contextlib.suppress(OSError):
        for tmp in logs.glob(f".trial-{number:05d}.*.tmp"):
            tmp.unlink(missing_ok=True)

