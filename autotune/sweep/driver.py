"""A planned sweep run to its end: the probes, the finalists probed again, the files the study
leaves, the confirmations.

`run_sweep` runs the Sweep of a SweepPlan, keeps trials.csv, best.yaml and (with --trainer)
best.<trainer>.yaml after every probe (artifacts.SweepFiles: rows appended, best.yaml and the
export rewritten when the best changed) and writes them whole when it stops, probes the
best K again before the pick (finalists.py), probes the best configs again with real ranks
when the plan says so, and always releases the runner. A
Ctrl-C (or SIGTERM, raised as one) leaves the files as the study stands and is said in the
outcome: nothing is lost, and the same command resumes. One that code on the way drops (a
cleanup's "Exception ignored") is still seen (interrupts.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.sweep.execution import interrupts
from autotune.sweep.pick.artifacts import SweepFiles
from autotune.sweep.pick.best_export import write_trainer_export
from autotune.sweep.pick.confirm import confirm_best
from autotune.sweep.pick.finalists import remeasure
from autotune.sweep.plan import SweepPlan
from autotune.sweep.progress import Progress
from autotune.sweep.tuner import Stop, Sweep

if TYPE_CHECKING:
    from optuna import Study


@dataclass(frozen=True)
class SweepOutcome:
    """How a sweep ended and what it left."""

    study: Study | None  # the Optuna study, as the storage holds it (None: it never opened)
    best_path: Path | None  # best.yaml, once a config fits
    export_path: Path | None  # best.<trainer>.yaml, with --trainer
    interrupted: bool
    nothing_fits: str | None  # why nothing in the space can fit, when that is why it stopped
    where: str  # where the study lives: its SQLite file, journal or database
    others_running: int  # probes other drivers still run in a shared study
    budget_stop: Stop | None = None  # the stop, when --trials, --timeout or --patience
    # ended it with configs left to try

    @property
    def exit_code(self) -> int:
        """130 when interrupted, 1 when nothing fits, else 0."""
        if self.interrupted:
            return 130
        return 0 if self.best_path is not None else 1


def run_sweep(plan: SweepPlan, progress: Progress | None = None,
              say: Callable[[str], None] = lambda line: None) -> SweepOutcome:
    """Run `plan` to a stop; `progress` shows it, `say` gets the lines of the confirmations."""
    settings, target = plan.settings, plan.trainer
    exported: list[Path | None] = [None]
    files = SweepFiles(settings.study_dir)

    def artifacts(study: Study, whole: bool = False) -> Path | None:
        best = files.write_all(study) if whole else files.after_trial(study)
        if target is not None and (whole or files.best_changed or exported[0] is None):
            exported[0] = write_trainer_export(study, settings.study_dir, target.adapter,
                                               target.base, target.topology)
        return best

    try:
        sweep = Sweep(settings, plan.runner, progress, on_trial=artifacts)
        try:
            with interrupts.recorded():  # a Ctrl-C some cleanup code drops is raised again
                study = sweep.run()
                if settings.finalists and sweep.nothing_fits is None:
                    remeasure(study, settings, plan.runner, settings.finalists,
                              sweep.feasibility.capacity_bytes, say,
                              sweep.tally.with_study_noise)
                interrupts.raise_if_interrupted()
                if settings.confirm and sweep.nothing_fits is None:
                    confirm_best(study, settings, plan.runner,
                                 sweep.feasibility.capacity_bytes, say)
                interrupts.raise_if_interrupted()
        except KeyboardInterrupt:
            if sweep.study is not None:  # the files agree with the study as it was left
                with contextlib.suppress(Exception):
                    artifacts(sweep.study, whole=True)
            return SweepOutcome(sweep.study, None, None, True, None, sweep.where,
                                sweep.others_running)
    finally:
        plan.runner.close()  # a Ray runner disconnects (and stops a Ray it started)
    best = artifacts(study, whole=True)  # from the storage, other drivers' trials included
    budget_stop = sweep.stopped if sweep.stopped and sweep.stopped.budget else None
    return SweepOutcome(study, best, exported[0], False, sweep.nothing_fits, sweep.where,
                        sweep.others_running, budget_stop)
