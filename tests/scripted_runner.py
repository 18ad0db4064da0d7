"""A scripted Runner for the sweep's loop logic: figures from a formula, no torch, no process.

This stands in for the probe only to test the driver (ask/tell, dedupe, resume, stop rules)
in milliseconds; the real probe is exercised end to end in test_sweep_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus

MiB = 2**20
LIMIT_BYTES = 1000 * MiB


def scripted_result(request: ProbeRequest) -> ProbeResult:
    """Memory grows with micro-batches and falls with savers; speed grows with micro-batches."""
    c = request.config
    per_response = (40 if c.gradient_checkpointing else 120) * MiB
    update = 300 * MiB + per_response * c.micro_batch_size_update
    experience = 300 * MiB + 60 * MiB * c.micro_batch_size_experience
    offload = (100 * MiB if c.offload_params else 0) + (100 * MiB if c.offload_optimizer else 0)
    rollout = 500 * MiB - offload
    phases = {"rollout": rollout, "experience": experience - offload, "update": update}
    # a device of LIMIT_BYTES, or a larger one under the request's cap
    cap = request.device.limit_bytes
    capacity = LIMIT_BYTES if cap is None else 4 * LIMIT_BYTES
    limit = cap or LIMIT_BYTES
    for phase, peak in phases.items():
        if peak > limit:
            return ProbeResult(status=ProbeStatus.GPU_OOM, message="scripted OOM",
                               failed_phase=phase, device_limit_bytes=cap,
                               device_capacity_bytes=capacity, probe_wall_s=1.0)
    tokens_per_s = 100.0 * (1 + c.micro_batch_size_update) ** 0.5 \
        * (1 + c.micro_batch_size_experience) ** 0.25 \
        * (0.7 if c.gradient_checkpointing else 1.0) \
        * (0.9 if c.offload_params else 1.0) * (0.95 if c.offload_optimizer else 1.0)
    return ProbeResult(status=ProbeStatus.OK, tokens_per_s=tokens_per_s, samples_per_s=1.0,
                       step_s=1.0, peak_mem_bytes=max(phases.values()),
                       phase_peak_mem_bytes=phases, host_peak_rss_bytes=2 * LIMIT_BYTES,
                       device_name="scripted", device_capacity_bytes=capacity,
                       device_limit_bytes=cap, probe_wall_s=2.0, startup_s=0.5, build_s=0.5)


class ScriptedRunner:
    """Answers each request from `scripted_result`; `crash_when` makes chosen configs crash."""

    def __init__(self, crash_when=None, interrupt_on_call: int | None = None) -> None:
        self.calls: list[dict] = []
        self.crash_when = crash_when
        self.interrupt_on_call = interrupt_on_call

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult:
        self.calls.append(request.config.as_dict())
        if self.interrupt_on_call is not None and len(self.calls) == self.interrupt_on_call:
            raise KeyboardInterrupt
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            Path(log_path).write_text(f"scripted probe of {request.config}\n")
        if self.crash_when is not None and self.crash_when(request.config):
            return ProbeResult(status=ProbeStatus.CRASH, message="scripted crash",
                               stderr_tail="Segmentation fault", returncode=-11,
                               probe_wall_s=1.0)
        return scripted_result(request)

    def stop(self) -> None:
        """Scripted probes end at once: nothing to kill."""

    def close(self) -> None:
        """Nothing to release."""


class ModelRunner:
    """Answers with the memory model's own prior plus a fixed context: a device on which the
    memory model is exactly right, to test the estimate pre-screen inside a real sweep."""

    def __init__(self, limit_bytes: int, context_bytes: int = 250 * MiB) -> None:
        from autotune.memory.shape import model_shape

        self.limit_bytes, self.context_bytes = limit_bytes, context_bytes
        self.shape = model_shape("tiny-qwen2.5")
        self.calls: list[dict] = []

    def phase_bytes(self, config) -> dict[str, int]:
        from autotune.memory.model import estimate_memory

        est = estimate_memory(self.shape, config, on_gpu=False)
        return {name: p.states_bytes + self.context_bytes + p.transient_bytes
                for name, p in est.phases.items()}

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult:
        self.calls.append(request.config.as_dict())
        phases = self.phase_bytes(request.config)
        for phase, peak in phases.items():
            if peak > self.limit_bytes:
                return ProbeResult(status=ProbeStatus.GPU_OOM, message="model OOM",
                                   failed_phase=phase, device_capacity_bytes=self.limit_bytes,
                                   probe_wall_s=1.0)
        return ProbeResult(status=ProbeStatus.OK, tokens_per_s=100.0 + len(self.calls),
                           samples_per_s=1.0, step_s=1.0, peak_mem_bytes=max(phases.values()),
                           phase_peak_mem_bytes=phases, device_name="model",
                           device_capacity_bytes=self.limit_bytes, probe_wall_s=1.0)

    def stop(self) -> None:
        """Model probes end at once: nothing to kill."""

    def close(self) -> None:
        """Nothing to release."""


class StandInTracer:
    """A tracer (sweep/feasibility/traced.py's Tracer) that traces nothing and learns
    nothing: the stand-ins below override what their test is about (the real trace process
    runs in test_trace.py)."""

    unavailable: str | None = None

    def traced_bytes(self, candidate, device):
        return None

    def failure(self, candidate):
        return None

    def fits_under_bytes(self, candidate, device):
        return None

    def answered(self, candidate):
        return self.unavailable is not None

    def learn(self, candidate, phase_peak_mem_bytes, device, phase_reserved_bytes=None):
        pass

    def summary(self):
        return {"off": self.unavailable}

    def close(self):
        pass


def model_study(results_dir: Path, name: str, trials: int) -> None:
    """A real SQLite study of `trials` ModelRunner probes over cpu-demo, for commands that
    read a study (estimate --study, export)."""
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    settings = SweepSettings(study_name=name, study_dir=Path(results_dir) / name,
                             space=load_search_space("cpu-demo"),
                             request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                             max_trials=trials, sampler="random")
    Sweep(settings, ModelRunner(limit_bytes=2**40)).run()


class SlowRunner(ScriptedRunner):
    """A ScriptedRunner whose probes take `delay_s`, for parallel sweeps: it records how many
    ran at once, on which cores, and any config run while the same config was running."""

    def __init__(self, delay_s: float = 0.2, lose=None, **kwargs) -> None:
        import threading

        super().__init__(**kwargs)
        self.delay_s, self.lose = delay_s, lose  # lose(config, times_seen) -> lost with its node
        self.lock = threading.Lock()
        self.running: dict[str, tuple | None] = {}
        self.max_running = 0
        self.overlaps: list[tuple[str, tuple | None]] = []  # configs and cores run side by side
        self.concurrent_duplicates = 0

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult:
        import json
        import time

        key = json.dumps(request.config.as_dict(), sort_keys=True)
        with self.lock:
            self.concurrent_duplicates += key in self.running
            self.running[key] = request.cpu_ids
            self.max_running = max(self.max_running, len(self.running))
            if len(self.running) > 1:
                self.overlaps.append(tuple(sorted(map(str, self.running.values()))))
            seen = sum(json.dumps(c, sort_keys=True) == key for c in self.calls)
        try:
            time.sleep(self.delay_s)
            if self.lose is not None and self.lose(request.config, seen):
                self.calls.append(request.config.as_dict())
                return ProbeResult(status=ProbeStatus.LOST, message="node went away",
                                   probe_wall_s=self.delay_s)
            return super().run(request, log_path)
        finally:
            with self.lock:
                self.running.pop(key, None)
