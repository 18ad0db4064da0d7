"""The progress views: what a user sees while a sweep runs."""

from __future__ import annotations

import io
import time

from rich.console import Console
from scripted_runner import ScriptedRunner

from autotune.probe.measure.result import ProbeRequest
from autotune.sweep.progress import (
    LiveProgress,
    PlainProgress,
    SweepState,
    format_duration,
    make_progress,
)
from autotune.sweep.space.search_space import load_search_space
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.tuner import Sweep


def run_with(progress, tmp_path):
    settings = SweepSettings("p", tmp_path / "p", load_search_space("cpu-demo"),
                             ProbeRequest(model="tiny-qwen2.5"), max_trials=6)
    Sweep(settings, ScriptedRunner(), progress).run()


def test_plain_lines_show_budget_config_counts_and_stop_reason(tmp_path):
    stream = io.StringIO()
    run_with(PlainProgress(stream), tmp_path)
    lines = [line for line in stream.getvalue().splitlines()  # a suite started in the
             if "Ctrl-C does not reach this sweep" not in line]  # background hears that too
    assert lines[0].endswith("sweep p")
    assert "probe 0/6  probing trial 0: mbu=1 mbe=2 gc off_p off_o" in lines[1]
    assert "trial 0: ok," in lines[2]
    assert "[ok 1  oom 0  predicted oom 0  skipped 0  failed 0; eta" in lines[2]
    assert "stopped: reached --trials 6." in lines[-1] and "best: trial" in lines[-1]


def test_live_view_renders_the_panel(tmp_path):
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    run_with(LiveProgress(console), tmp_path)
    text = buffer.getvalue()
    for expected in ("sweep", "probe 6/6", "trials", "ok ", "best", "stopped: reached"):
        assert expected in text


def test_plain_view_when_not_a_terminal():
    assert isinstance(make_progress(io.StringIO()), PlainProgress)


def test_eta_uses_mean_probe_time_and_timeout():
    state = SweepState("s", max_trials=10, timeout_s=None)
    state.probes, state.probe_wall_s = 4, [10.0, 20.0]
    assert state.eta_s() == 6 * 15.0
    state.timeout_s = 30.0
    state.started_s = time.monotonic() - 10
    assert 19 <= state.eta_s() <= 20
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05"


def test_a_trace_is_shown_while_it_runs():
    """A trace can take a minute before a probe starts: the live panel has a row for it while
    it runs, the plain view a line when it starts."""
    stream = io.StringIO()
    state = SweepState("s", max_trials=4, timeout_s=None)
    PlainProgress(stream).trace_started(state, "mbu=8 mbe=16")
    assert stream.getvalue().rstrip().endswith("probe 0/4  tracing mbu=8 mbe=16")
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=120)
    live = LiveProgress(console)
    live.state = state
    state.tracing = {"micro_batch_size_update": 8}
    console.print(live._render())
    state.tracing = None
    console.print(live._render())
    first, second = buffer.getvalue().split("best")[:2]
    assert "tracing" in first and "mbu=8" in first and "tracing" not in second
