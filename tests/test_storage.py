"""Where a study lives: a refused resume writes nothing, and drivers sharing a study leave
files rewritten from it and say where it is (scripted probes, real journal storage)."""

from __future__ import annotations

import csv
import dataclasses

import pytest
from scripted_runner import ScriptedRunner

from autotune.cli.text import format_outcome, format_study
from autotune.errors import ConfigError
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.driver import run_sweep
from autotune.sweep.plan import SweepPlan
from autotune.sweep.space.search_space import load_search_space
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.study.storage import load_study, open_study

REQUEST = ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"))


def sweep(settings: SweepSettings) -> tuple[int, str]:
    """Run a scripted sweep as `autotune run` does: its exit code and what it prints."""
    outcome = run_sweep(SweepPlan(settings, ScriptedRunner(), None, ()))
    return outcome.exit_code, format_outcome(outcome, settings, "")[0]


def settings(tmp_path, machine: str, **changes) -> SweepSettings:
    fields = {"study_name": "shared", "study_dir": tmp_path / machine / "shared",
              "space": load_search_space("cpu-demo"), "request": REQUEST,
              "storage": str(tmp_path / "study.journal"), **changes}
    return SweepSettings(**fields)


def test_a_refused_resume_writes_nothing_into_the_journal(tmp_path):
    assert sweep(settings(tmp_path, "a", max_trials=2))[0] == 0
    journal = tmp_path / "study.journal"
    before = journal.read_bytes()
    other = settings(tmp_path, "a", max_trials=2, headroom=0.3)  # a different setup
    with pytest.raises(ConfigError, match="different setup"):
        open_study(other)
    assert journal.read_bytes() == before


def test_each_driver_rewrites_its_files_from_the_shared_study_and_says_where_it_lives(
        tmp_path, capsys):
    code, first = sweep(settings(tmp_path, "a", max_trials=2))
    assert code == 0
    assert "lives in " + str(tmp_path / "study.journal") in first and "study.db" not in first
    assert sweep(settings(tmp_path, "b", max_trials=5, seed=1))[0] == 0
    rows = list(csv.DictReader(open(tmp_path / "b" / "shared" / "trials.csv")))
    shared = load_study(str(tmp_path), "shared", str(tmp_path / "study.journal"))
    assert len(rows) == len(shared.trials)  # machine a's trials are in b's file
    assert not (tmp_path / "a" / "shared" / "study.db").exists()
    assert "best: trial" in format_study(shared)


def test_show_reads_a_shared_study_by_its_storage(tmp_path, capsys):
    from autotune.cli import main

    sweep(dataclasses.replace(settings(tmp_path, "a"), max_trials=2))
    capsys.readouterr()
    main(["show", "--storage", str(tmp_path / "study.journal")])  # its only study
    assert "study shared:" in capsys.readouterr().out
