"""Never probe a config that must run out of memory: the sweep's rules, in the order they
are asked, and the device they are asked against.

1. Dominance over measured OOMs (dominance.py): proven, so also for the safe config.
2. The node's host memory past where its OOM killer acts (memory/host.py), and model states
   alone past the capacity (prescreen.py, the exact part): arithmetic, for every config.
3. The traced pre-screen (traced.py): the probe's own step under fake tensors, from the
   first trial on, for a candidate the memory model puts near the wall.
4. The calibrated memory model (prescreen.py), once enough probes have fitted it.

The safe config is never skipped on 3 or 4: its OOM, measured, is what ends a sweep where
nothing fits. The device is the plan's (its kind, limit and reserve); its capacity is what
this machine has until a probe reports the one it ran on.
"""

from __future__ import annotations

from autotune.config.schema import ProbeConfig
from autotune.files import JsonObject
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeStatus
from autotune.sweep.feasibility.dominance import Dominance
from autotune.sweep.feasibility.prescreen import Prediction, Prescreen
from autotune.sweep.feasibility.traced import Tracer, traced_prediction
from autotune.sweep.space.search_space import Candidate


class Feasibility:
    """What a sweep knows of where the memory wall is, from its rules: each is optional
    (--no-prune, --no-prescreen, --no-trace, a model the memory model cannot read). Each is
    asked of a trial's candidate: dominance compares its params, the pre-screen and the
    traces take its config."""

    def __init__(self, device: Device, dominance: Dominance | None = None,
                 prescreen: Prescreen | None = None, tracer: Tracer | None = None) -> None:
        self.device = device
        self.dominance = dominance
        self.prescreen = prescreen
        self.tracer = tracer  # only with a pre-screen that skips (its estimate picks whom)

    @property
    def capacity_bytes(self) -> int | None:
        """What a probe may use of the device (hardware.usable_bytes), as known now."""
        return self.device.usable_bytes

    def evidence(self) -> tuple[int, int]:
        """How much the rules have learned: measured OOMs, calibration samples."""
        return (len(self.dominance.known) if self.dominance else 0,
                len(self.prescreen.samples) if self.prescreen else 0)

    def record(self, trial_number: int, candidate: Candidate, status: str,
               failed_phase: str | None = None,
               phase_peak_mem_bytes: dict[str, int] | None = None,
               device_capacity_bytes: int | None = None,
               phase_reserved_bytes: dict[str, int] | None = None) -> None:
        """Learn from a measured probe: its device's capacity, an OOM for dominance, a
        success's peaks (and torch's reserved peaks beside them) for the calibration and the
        traces' fixed term."""
        self.device = self.device.with_capacity(device_capacity_bytes)
        probed = ProbeStatus.of(status)
        if self.dominance is not None and probed is not None:
            self.dominance.record(trial_number, candidate.params, probed, failed_phase,
                                  candidate.config.separate)
        if probed is None or not probed.reached_peaks or not phase_peak_mem_bytes:
            return
        if self.prescreen is not None:
            self.prescreen.record(candidate.config, phase_peak_mem_bytes, self.device)
        if self.tracer is not None and not candidate.config.separate:  # the trace is the
            # colocated step's: a split probe's sides teach it nothing
            self.tracer.learn(candidate, phase_peak_mem_bytes, self.device, phase_reserved_bytes)

    def calibration_record(self, device_name: str | None) -> JsonObject | None:
        """The calibration and what tracing did, as stored with the study; None before the
        first successful probe."""
        if self.prescreen is None or self.prescreen.calibration is None:
            return None
        trace = self.tracer.summary() if self.tracer is not None else None
        return self.prescreen.calibration_record(device_name, trace)

    def predict(self, candidate: Candidate, measure: bool = False,
                trace: bool = True) -> Prediction | None:
        """Why `candidate` must run out of memory, or None when it may fit. `measure`: the
        config is to be measured unless proven (the safe config). `trace=False` starts no
        trace: a candidate not traced yet is judged by the other rules alone, which leave
        open every config the traced answer would (the trace only adds OOMs), so it answers
        "may anything fit?" without tracing configs the sweep may never ask for."""
        proof = self.dominance.proof(candidate.params) if self.dominance is not None else None
        if proof is not None:
            return Prediction(proof.status.value, proof.reason, proof.failed_phase, "dominance")
        capacity = self.capacity_bytes
        prescreen = self.prescreen
        if prescreen is None or not prescreen.skip:
            return None
        host = prescreen.host_past(candidate.config)
        if host is not None or capacity is None:
            return host
        estimate = prescreen.estimate(candidate.config, self.device)
        proven = prescreen.states_past(estimate, capacity)
        if proven is not None or measure:
            return proven
        if self.tracer is not None and (trace or self.tracer.answered(candidate)):
            traced = traced_prediction(self.tracer, candidate,
                                       prescreen.modelled_bytes(estimate), self.device)
            if traced is not None:
                return traced
        return prescreen.calibrated_past(estimate, capacity)

    def model_past(self, config: ProbeConfig) -> Prediction | None:
        """What the memory model alone says of `config` (rules 2 and 4: no measured OOM, no
        trace): why it must run out of memory, or None. For a config no trial asks, a
        fixed knob's other value (Frontier.blame)."""
        prescreen, capacity = self.prescreen, self.capacity_bytes
        if prescreen is None:
            return None
        host = prescreen.host_past(config)
        if host is not None or capacity is None:
            return host
        estimate = prescreen.estimate(config, self.device)
        return prescreen.states_past(estimate, capacity) or \
            prescreen.calibrated_past(estimate, capacity)

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.close()
