"""runners: where a probe runs (a local subprocess, forked on a CPU from a fork server that has
imported torch once: forking.py; a Ray task), and killing it whole.

Each runner takes a ProbeRequest and returns a ProbeResult. May import config, errors, files,
hardware, probe.result, probe.oom and probe.process_tag (every process a probe starts dies
with its parent, and is tagged, found and killed by its tag); never torch (the probe runs in
its own process); ray only inside ray_runner.py, and only when a RayRunner is made.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from autotune.errors import ConfigError
from autotune.probe.measure.result import ProbeRequest, ProbeResult

if TYPE_CHECKING:
    from autotune.runners.ray_runner import RayRunner


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

    def close(self) -> None:
        """Release what the runner holds (a Ray runner disconnects, and stops a Ray it
        started); called once, when the sweep is over."""
        ...


EXECUTORS = ("local", "ray")  # --executor: subprocesses here, or Ray tasks on a cluster


def get_runner(kind: str = "local", **options: Any) -> Runner:
    """The runner for `kind`, made with `options`; imports its backend only when asked for.

    local: SubprocessRunner(worker_argv=None, scope=""). ray: RayRunner(address=None,
    num_cpus_per_probe=1.0, num_gpus_per_probe=0.0, resources=None, worker_argv=None).
    """
    if kind == "local":
        from autotune.runners.local import SubprocessRunner

        return SubprocessRunner(**options)
    if kind == "ray":
        return connect_ray(**options)
    raise ConfigError(f"unknown executor {kind!r}: valid: {', '.join(EXECUTORS)}")


def _require_ray() -> None:
    """ConfigError, in one line, when Ray is not installed (ray_runner.py imports Ray only
    inside its functions, so importing that module says nothing: Ray itself is looked for)."""
    if importlib.util.find_spec("ray") is None:  # finds it without importing it
        raise ConfigError("--executor ray: Ray is not installed; pip install "
                          "'autotune[ray]'")


def connect_ray(address: str | None = None, num_cpus_per_probe: float = 1.0,
                num_gpus_per_probe: float = 0.0, resources: dict[str, float] | None = None,
                worker_argv: list[str] | None = None) -> RayRunner:
    """A RayRunner on the cluster at `address` (None: a Ray started on this machine)."""
    _require_ray()
    from autotune.runners.ray_runner import RayRunner

    return RayRunner(address, num_cpus_per_probe, num_gpus_per_probe, resources, worker_argv)


def ray_cluster_gpus(address: str | None) -> float:
    """GPUs of the Ray cluster at `address` (connects to it; a RayRunner made next reuses
    the connection)."""
    _require_ray()
    from autotune.runners.ray_runner import cluster_gpus

    return cluster_gpus(address)
