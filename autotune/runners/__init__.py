"""Runners: where a probe runs. Each takes a ProbeRequest and returns a ProbeResult."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from autotune.result import ProbeRequest, ProbeResult


class Runner(Protocol):
    """Runs one probe in isolation.

    Contract: a runner never raises for a probe failure (OOM, timeout, crash, bad config); it
    returns a ProbeResult whose status says what happened. It raises RunnerError only when the
    runner itself is broken. No probe process outlives `run`.
    """

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult: ...


def get_runner(kind: str = "local") -> Runner:
    """The runner for `kind`; imports its backend only when asked for."""
    if kind == "local":
        from autotune.runners.local import SubprocessRunner

        return SubprocessRunner()
    from autotune.errors import ConfigError

    raise ConfigError(f"unknown executor {kind!r}: valid: local")
