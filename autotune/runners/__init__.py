"""runners: where a probe runs (a local subprocess, a Ray task), and killing it whole.

Each runner takes a ProbeRequest and returns a ProbeResult. May import config, errors, files,
probe.result, probe.oom, probe.launcher (torch-free: its children die with their parent, as
a probe dies with the driver) and probe.process_tag (every process a probe starts is tagged,
found and killed by its tag); never torch (the probe runs in its own process); ray only inside
ray_runner.py, and only when a RayRunner is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from autotune.probe.result import ProbeRequest, ProbeResult


class Runner(Protocol):
    """Runs one probe in isolation.

    Contract: a runner never raises for a probe failure (OOM, timeout, crash, bad config); it
    returns a ProbeResult whose status says what happened. It raises RunnerError only when the
    runner itself is broken. No probe process outlives `run`. `run` may be called from several
    threads at once (parallel probes); `stop` from any thread.
    """

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult: ...

    def stop(self) -> None:
        """Kill every probe in flight, from any thread; each `run` then returns promptly (what
        it returns no longer matters: the sweep records those trials as interrupted)."""
        ...


def get_runner(kind: str = "local", **options: Any) -> Runner:
    """The runner for `kind`, made with `options`; imports its backend only when asked for.

    local: SubprocessRunner(worker_argv=None). ray: RayRunner(address=None,
    num_cpus_per_probe=1.0, num_gpus_per_probe=0.0, resources=None, worker_argv=None).
    """
    if kind == "local":
        from autotune.runners.local import SubprocessRunner

        return SubprocessRunner(**options)
    from autotune.errors import ConfigError

    if kind == "ray":
        try:
            from autotune.runners.ray_runner import RayRunner
        except ImportError:
            raise ConfigError("--executor ray: Ray is not installed; pip install "
                              "'autotune[ray]'") from None
        return RayRunner(**options)

    raise ConfigError(f"unknown executor {kind!r}: valid: local, ray")
