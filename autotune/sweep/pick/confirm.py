"""Search wide, confirm real: the best configs of an emulated sweep probed again, real ranks.

An emulated probe measures one rank's memory exactly but leaves communication out of its
time. When the run's W GPUs are all on this machine, the sweep's best K feasible configs are
probed once more as real W-rank probes (one at a time: each takes every GPU of the run), and
each confirmation is stored in the study (user attr `confirmations`, by trial number), so
best.yaml carries both figures and a config whose real probe does not fit is never the best.
A confirmation already stored is never run again; one whose probe finished before the driver
died is read back from `logs/trial-00007.confirm.result.json`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from autotune.probe.measure.result import ProbeResult
from autotune.runners import Runner
from autotune.sweep.execution import interrupts
from autotune.sweep.pick.artifacts import ranked_feasible
from autotune.sweep.study import trial_files
from autotune.sweep.study.objective import score
from autotune.sweep.study.settings import SweepSettings

if TYPE_CHECKING:
    from optuna import Study

CONFIRMATIONS = "confirmations"  # study user attr: {"7": {...}, ...}


class Confirmation(TypedDict):
    """A confirming probe as the study keeps it (by trial number)."""

    status: str
    feasible: bool
    reason: str
    world_size: int
    tokens_per_s: float | None
    peak_mem_bytes: int | None
    phase_peak_mem_bytes: dict[str, int]
    rank_peak_mem_bytes: list[int]
    failed_rank: int | None
    failed_phase: str | None
    message: str


def confirm_log_path(study_dir: Path, number: int) -> Path:
    return trial_files.log_path(study_dir, number).with_suffix(".confirm.log")


def record(result: ProbeResult, settings: SweepSettings, capacity_bytes: int | None
           ) -> Confirmation:
    """What best.yaml and `show` need of a confirming probe."""
    scored = score(result, settings.objective, settings.headroom, capacity_bytes)
    return {"status": result.status.value, "feasible": scored.feasible,
            "reason": scored.reason, "world_size": result.world_size,
            "tokens_per_s": result.tokens_per_s, "peak_mem_bytes": result.peak_mem_bytes,
            "phase_peak_mem_bytes": result.phase_peak_mem_bytes,
            "rank_peak_mem_bytes": result.rank_peak_mem_bytes,
            "failed_rank": result.failed_rank, "failed_phase": result.failed_phase,
            "message": result.message}


def confirm_best(study: Study, settings: SweepSettings, runner: Runner, capacity_bytes: int | None,
                 say: Callable[[str], None] = lambda line: None) -> int:
    """Probe the best `settings.confirm` feasible configs with real ranks (more, down the
    ranking, while none has confirmed); returns how many probes ran."""
    wanted, probes = settings.confirm, 0
    real = dataclasses.replace(settings.request, emulated=False)
    done: dict[str, Confirmation] = dict(study.user_attrs.get(CONFIRMATIONS) or {})
    for place, trial in enumerate(ranked_feasible(study)[:2 * wanted]):
        if place >= wanted and any(entry["feasible"] for entry in done.values()):
            break
        if str(trial.number) in done:
            continue
        request = dataclasses.replace(real, config=settings.space.config_for(trial.params))
        log = confirm_log_path(settings.study_dir, trial.number)
        result = read_confirmed(log)
        if result is None:
            say(f"confirming trial {trial.number} with {real.world_size} real ranks")
            interrupts.raise_if_interrupted()
            result = runner.run(request, log)
            probes += 1
        done[str(trial.number)] = record(result, settings, capacity_bytes)
        study.set_user_attr(CONFIRMATIONS, done)
        say(f"trial {trial.number} confirmed: " + describe(done[str(trial.number)]))
    return probes


def read_confirmed(log: Path) -> ProbeResult | None:
    """A confirming probe's result left by a driver that died before recording it."""
    try:
        return ProbeResult.from_json(log.with_suffix(".result.json").read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def describe(entry: Confirmation) -> str:
    from autotune.config import format_bytes

    if entry["status"] != "ok":
        where = f" in {entry['failed_phase']}" if entry.get("failed_phase") else ""
        return f"{entry['status']}{where} ({entry['message']})"
    verdict = "fits" if entry["feasible"] else entry["reason"]
    return (f"{entry['tokens_per_s']:.1f} tokens/s, peak {format_bytes(entry['peak_mem_bytes'])}"
            f" per rank: {verdict}")
