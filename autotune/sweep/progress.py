"""What a running sweep shows: a live panel on a terminal, one plain line per event otherwise.

Both views read the same SweepState (tuner.py): probes done of the budget, the config being
probed, elapsed and estimated time left, the best so far, and counts of ok / OOM / skipped /
failed trials. The live view redraws twice a second from a thread of rich's, so the clock moves
while a probe runs; the plain view writes lines a log file or CI can keep.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TextIO

from autotune.config import Knobs, describe_params

if TYPE_CHECKING:
    from rich.console import Console
    from rich.live import Live
    from rich.table import Table


@dataclass
class SweepState:
    """What the progress view shows; updated by the sweep after every step."""

    study_name: str
    max_trials: int | None
    timeout_s: float | None
    started_s: float = field(default_factory=time.monotonic)
    probes: int = 0
    slots: int = 1  # probes run side by side
    counts: dict[str, int] = field(default_factory=lambda: {
        "ok": 0, "slow": 0, "oom": 0, "predicted": 0, "skipped": 0, "failed": 0, "lost": 0,
        "killed": 0})
    probe_wall_s: list[float] = field(default_factory=list)
    running: dict[int, Knobs] = field(default_factory=dict)  # trial number -> params
    tracing: Knobs | None = None  # the candidate traced now (sweep/feasibility/traced.py)
    best: str = "-"
    stop_reason: str | None = None

    def eta_s(self) -> float | None:
        """Seconds left: remaining probes at the mean probe time over the parallel slots,
        capped by the timeout."""
        elapsed = time.monotonic() - self.started_s
        left = None
        if self.max_trials is not None and self.probe_wall_s:
            mean = sum(self.probe_wall_s) / len(self.probe_wall_s)
            rounds = -(-max(0, self.max_trials - self.probes) // max(1, self.slots))
            left = rounds * mean
        if self.timeout_s is not None:
            rest = max(0.0, self.timeout_s - elapsed)
            left = rest if left is None else min(left, rest)
        return left


class Progress(Protocol):
    """What a sweep reports to (progress.py has the live and plain views)."""

    def started(self, state: SweepState) -> None: ...
    def trial_started(self, state: SweepState, line: str) -> None: ...
    def trace_started(self, state: SweepState, line: str) -> None: ...
    def trial_finished(self, state: SweepState, line: str) -> None: ...
    def note(self, state: SweepState, line: str) -> None: ...
    def finished(self, state: SweepState) -> None: ...


class SilentProgress:
    """Reports nothing: for tests and benchmarks."""

    def started(self, state: SweepState) -> None: ...
    def trial_started(self, state: SweepState, line: str) -> None: ...
    def trace_started(self, state: SweepState, line: str) -> None: ...
    def trial_finished(self, state: SweepState, line: str) -> None: ...
    def note(self, state: SweepState, line: str) -> None: ...
    def finished(self, state: SweepState) -> None: ...


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def counts_text(state: SweepState) -> str:
    c = state.counts
    lost = "".join(f"  {k} {c[k]}" for k in ("lost", "killed") if c[k])
    slow = f" (+{c['slow']} stopped slow)" if c["slow"] else ""
    return (f"ok {c['ok']}{slow}  oom {c['oom']}  predicted oom {c['predicted']}  "
            f"skipped {c['skipped']}  failed {c['failed']}{lost}")


def budget_text(state: SweepState) -> str:
    total = f"/{state.max_trials}" if state.max_trials is not None else ""
    return f"probe {state.probes}{total}"


class PlainProgress:
    """One line per event, flushed: for logs, pipes and CI."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr

    def _line(self, state: SweepState, text: str) -> None:
        elapsed = format_duration(time.monotonic() - state.started_s)
        print(f"[{elapsed}] {budget_text(state)}  {text}", file=self.stream, flush=True)

    def started(self, state: SweepState) -> None:
        resumed = f", resuming with {state.probes} probes done" if state.probes else ""
        self._line(state, f"sweep {state.study_name}{resumed}")

    def trial_started(self, state: SweepState, line: str) -> None:
        self._line(state, f"probing {line}")

    def trace_started(self, state: SweepState, line: str) -> None:
        self._line(state, f"tracing {line}")

    def trial_finished(self, state: SweepState, line: str) -> None:
        eta = format_duration(state.eta_s())
        self._line(state, f"{line}   [{counts_text(state)}; eta {eta}]")

    def note(self, state: SweepState, line: str) -> None:
        self._line(state, line)

    def finished(self, state: SweepState) -> None:
        why = state.stop_reason or "interrupted"
        self._line(state, f"stopped: {why}. {counts_text(state)}. best: {state.best}")


class LiveProgress:
    """A rich panel redrawn in place, with the last few trial lines above it."""

    def __init__(self, console: Console | None = None) -> None:
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.live: Live | None = None
        self.state: SweepState | None = None

    def _render(self) -> Table:
        from rich.table import Table

        state = self.state
        assert state is not None
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", justify="right")
        table.add_column()
        elapsed = format_duration(time.monotonic() - state.started_s)
        table.add_row("sweep", f"{state.study_name}   {budget_text(state)}   elapsed {elapsed}"
                               f"   eta {format_duration(state.eta_s())}")
        for number, params in sorted(state.running.items()):
            table.add_row("probing", f"trial {number}: {describe_params(params)}")
        if state.tracing is not None:
            table.add_row("tracing", describe_params(state.tracing))
        table.add_row("trials", counts_text(state))
        table.add_row("best", state.best)
        return table

    def started(self, state: SweepState) -> None:
        from rich.live import Live

        self.state = state

        class _Panel:  # rich calls __rich__ at every refresh, so elapsed time keeps moving
            def __rich__(_self) -> Table:
                return self._render()

        self.live = Live(_Panel(), console=self.console, refresh_per_second=2, transient=False)
        self.live.start()
        if state.probes:
            self.console.print(f"resuming {state.study_name}: {state.probes} probes done")

    def trial_started(self, state: SweepState, line: str) -> None:
        self.state = state

    def trace_started(self, state: SweepState, line: str) -> None:
        self.state = state  # the panel shows state.tracing while it is set

    def trial_finished(self, state: SweepState, line: str) -> None:
        self.state = state
        self.console.print(f"[{format_duration(time.monotonic() - state.started_s)}] {line}")

    def note(self, state: SweepState, line: str) -> None:
        self.trial_finished(state, line)

    def finished(self, state: SweepState) -> None:
        if self.live is not None:
            self.live.stop()
        why = state.stop_reason or "interrupted"
        self.console.print(f"stopped: {why}")


def make_progress(stream: TextIO | None = None) -> Progress:
    """Live on a terminal, plain lines otherwise."""
    stream = stream or sys.stderr
    return LiveProgress() if stream.isatty() else PlainProgress(stream)
