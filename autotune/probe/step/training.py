"""The built-in GRPO probe: real training steps of a colocated GRPO trainer, measured.

One step has the phases of EasyR1/verl's hybrid engine: rollout (a rollout engine holding a
compute-dtype copy of the weights generates `rollout_n` responses per prompt, always to
`max_response_length`, with vLLM's memory or HF generation's, or the actor generates itself
as TRL's does: engine.py), experience (the
old log-prob forward unless `old_logprob_pass` is off, as TRL runs one optimizer step a
generation, and the reference's), update (mini-batches of micro-batches with gradient
accumulation, a GRPO loss, an AdamW step, fused or torch's default) and, when
`val_batch_size` is set, validation
generation. The actor keeps fp32 master weights and AdamW
state as verl and EasyR1 do (16 bytes per parameter during the update), computes in bf16 on a
GPU, and offload moves params / optimizer state to host memory between phases. It runs one
GPU's share of each batch of a run on `request.world_size` GPUs (config.device_share), and
reports the share it ran. With W > 1 the actor and reference are FSDP2-sharded over W ranks
(sharding.py), real peers or emulated ones; the rollout engine holds a compute-dtype copy on
each rank, whole or split over `rollout_tensor_parallel` ranks, gathered from the actor's
shards at each wake-up.

PPO (`algorithm=ppo`) adds the critic on the same GPUs, as verl's and EasyR1's trainers run it
(critic.py): built and sharded like the actor, with its own AdamW; the experience phase
forwards it for the values (its params loaded from the host first where it offloads them,
its optimizer state left where it is), and its own phase, `critic_update`, trains it before
the actor's update (RayPPOTrainer.fit: update_critic, then update_actor) with the actor's
mini-batches cut into its own micro-batches or token budget; between phases its params and
optimizer state sit where its own offload switches put them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from autotune.probe.measure.machine import MachineWatch
from autotune.probe.measure.meter import Meter, describe_device, physical_gpu_index
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus
from autotune.probe.measure.unit_loops import UnitLoop, mean_and_se, unit_times
from autotune.probe.modeling.sharding import leave_group
from autotune.probe.modeling.ulysses import sequence_parallel
from autotune.probe.step.build import Build
from autotune.probe.step.experience import ExperiencePhase
from autotune.probe.step.rollout import RolloutPhase
from autotune.probe.step.state import allocator_record
from autotune.probe.step.update import UpdatePhase

MAX_TIMED_STEPS = 12  # timed steps past request.timed_steps stop here
SHORT_SE_TARGET = 0.01  # a short probe adds steps until its step's standard error is 1% ...
SHORT_CAP_STEPS = 0.5  # ... or one more would take its timed steps past what half a whole
# step would take (timed_min_s at least): where the machine's step noise keeps the error over
# 1%, more steps buy little (it falls as one over the root of their count) and the figure's
# precision comes from pooling across configs and the finalists' repeats


class StoppedSlow(Exception):
    """The timed step measured so far already puts the probe under its floor
    (ProbeRequest.stop_below): the probe stops here."""

    def __init__(self, phase: str, step: int, seconds: dict[str, float],
                 tokens_per_s: float) -> None:
        super().__init__(phase)
        self.phase, self.step, self.seconds = phase, step, seconds
        self.tokens_per_s = tokens_per_s  # at most: the step measured so far is a lower bound


def training_s(phase_s: dict[str, float]) -> float:
    """Seconds of a step's training phases (validation is not part of a training step)."""
    return sum(v for k, v in phase_s.items() if k != "validation")


class TrainingProbe(Build, RolloutPhase, ExperiencePhase, UpdatePhase):
    """Runs one ProbeRequest in this process; `meter.current_phase` says where a failure hit.

    The phases are its bases' (a module each); `step` runs them in the trainer's order. A
    short probe (request.short) runs a sample of each loop of units and predicts the whole
    step (probe/measure/unit_loops.py), its warm-up steps each loop's first unit (the
    update's last too); a full one runs every unit. A focused probe (request.timed_phases, a
    finalist's repeat) times only those phases: its warm-up steps run every phase, its timed
    steps only them."""

    def __init__(self, request: ProbeRequest, meter: Meter | None = None) -> None:
        super().__init__(request, meter)
        self.step_loops: list[list[UnitLoop]] = []  # each step's unit loops (a short probe)
        self.step_wall_s: list[float] = []  # each step's seconds as run
        self.step_var_s2: list[float] = []  # each step's variance of its skipped units' time
        self.steps_run = 0  # whole steps run, warm-up included
        self.settled: set[str] = set()  # phases run after a whole step: at their peak (the
        # first step's update makes AdamW's state, which every later phase holds)
        self.timing = False  # running the timed steps
        self.timed_so_far: list[dict[str, float]] = []  # the timed steps run whole
        self.step_phases: list[str] = []  # the phases of a step, in order
        self.watch: MachineWatch | None = None  # the machine over the timed steps

    def step(self) -> dict[str, float]:
        """One training step; returns seconds per phase (validation included when set), a
        short probe's with what its skipped units would have taken."""
        seconds = {}
        variance = 0.0
        step_started = time.perf_counter()
        phases = [("rollout", self._rollout), ("experience", self._experience)]
        if self.critic is not None:
            phases.append(("critic_update", self._update_critic))
        phases.append(("update", self._update))
        if self.config.val_batch_size:
            phases.append(("validation", self._validate))
        self.step_phases = [name for name, _ in phases]
        if self.timing and self.request.timed_phases:  # a focused probe: the others ran whole
            phases = [(name, run) for name, run in phases  # in its warm-up, and what they
                      if name in self.request.timed_phases]  # last left is read again
        for name, run in phases:
            if self.on_gpu:  # as verl toggles it: vLLM's memory pool refuses the segments
                torch.cuda.memory._set_allocator_settings(
                    f"expandable_segments:{self.allocator.expandable_in(name)}")
            # the trained phases' forwards and backwards (a checkpointed layer's recompute
            # too) run each rank's slice; generation runs whole sequences
            split = self.sequence_group is not None and name in ("experience", "update")
            with self.meter.phase(name), sequence_parallel(self.sequence_group) if split \
                    else contextlib.nullcontext():
                started = time.perf_counter()
                run()
                if self.on_gpu:
                    torch.cuda.synchronize(self.device)
                seconds[name] = time.perf_counter() - started
            skipped_s, skipped_var_s2 = self.meter.clock.take_skipped(name)
            seconds[name] += skipped_s
            variance += skipped_var_s2 if name != "validation" else 0.0
            if self.steps_run:  # it ran holding what a whole step leaves (AdamW's state)
                self.settled.add(name)
            if name != "validation":
                self.stop_if_slow(name, seconds)
        self.steps_run += 1
        self.step_loops.append(self.meter.clock.take_loops())
        self.step_wall_s.append(time.perf_counter() - step_started)
        self.step_var_s2.append(variance)
        return seconds

    def timed_steps(self) -> list[dict[str, float]]:
        """The timed steps: `request.timed_steps`, then more while `wants_more` says so,
        MAX_TIMED_STEPS at most. Every rank runs the same count (ranks step in lockstep
        through their collectives): rank 0's clock decides, and it is shared."""
        self.timed_so_far = timed = []
        for _ in range(self.request.timed_steps):
            timed.append(self.step())
        while len(timed) < MAX_TIMED_STEPS and self.agree_more(self.wants_more(timed)):
            timed.append(self.step())
        return timed

    def wants_more(self, timed: list[dict[str, float]]) -> bool:
        """None past `request.timed_steps` when `request.timed_min_s` is 0 (--timed-steps:
        exactly that many). A full probe: while its steps add up to less than timed_min_s (a
        short step is cheap to repeat and noisy alone). A short one: while its predicted
        step's standard error (never under the study's measured step spread over sqrt(n):
        request.step_cv_prior) is past SHORT_SE_TARGET of it and one more step, as long as the
        last, would end its steps within SHORT_CAP_STEPS whole steps (or timed_min_s): the
        cap is never passed."""
        predicted = [training_s(t) for t in timed]
        if self.request.timed_min_s <= 0:
            return False
        if not self.meter.clock.short:
            return sum(predicted) < self.request.timed_min_s
        mean, se = mean_and_se(predicted, self.step_var_s2[-1], self.request.step_cv_prior)
        after_next = sum(self.step_wall_s[-len(timed):]) + self.step_wall_s[-1]
        return se > SHORT_SE_TARGET * mean and after_next <= max(SHORT_CAP_STEPS * mean,
                                                                  self.request.timed_min_s)

    @property
    def step_tokens(self) -> int:
        """Tokens a step of the whole run trains on: W ranks each ran this share."""
        return self.ran["responses_per_step"] * self.request.world_size * \
            self.config.sequence_length

    def stop_if_slow(self, phase: str, seconds: dict[str, float]) -> None:
        """Raise StoppedSlow when the request sets a floor, every phase has reached its peak
        (has run after a whole step), the timed steps so far (the whole ones and this one to
        `phase`: in a full probe a lower bound on their time, in a short one its estimate)
        already put the rate under the floor, and no rank was contended over the timed steps.
        Every rank asks at the same places; rank 0 decides on the rate (agree_slow)."""
        floor = self.request.stop_below
        if floor is None or not self.timing or not self.settled.issuperset(self.step_phases):
            return
        whole = [training_s(t) for t in self.timed_so_far]  # the timed steps run whole
        at_most = self.step_tokens * (len(whole) + 1) / max(sum(whole) + training_s(seconds),
                                                             1e-9)
        peak = max(self.meter.phase_peak_mem_bytes.values(), default=0)
        contended = self.watch is not None and self.watch.stop().contention() is not None
        if self.agree_slow(at_most < floor.floor_tokens_per_s(peak), contended):
            raise StoppedSlow(phase, len(self.step_wall_s) + 1, dict(seconds), at_most)

    def agree_slow(self, slow: bool, contended: bool) -> bool:
        """Whether every rank stops: rank 0 found the probe slow, and no rank was timed while
        other processes took its machine (a contended step is not the probe's own pace: it
        runs on, and its result is flagged)."""
        if self.group is None or self.request.emulated:
            return slow and not contended
        import torch.distributed as dist

        flags = torch.tensor([1 if slow and dist.get_rank() == 0 else 0, int(contended)],
                             dtype=torch.int32)
        if self.on_gpu:
            flags = flags.to(self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0].item()) and not bool(flags[1].item())

    def agree_more(self, more: bool) -> bool:
        """Rank 0's answer to `more`, on every rank (alone: the answer itself)."""
        if self.group is None or self.request.emulated:
            return more
        import torch.distributed as dist

        flag = torch.tensor([1 if more else 0], dtype=torch.int32)
        if self.on_gpu:
            flag = flag.to(self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def run(self, startup_s: float | None = None) -> ProbeResult:
        request = self.request
        built_at = time.perf_counter()
        self.build()
        build_s = time.perf_counter() - built_at
        self.meter.clock.warming = True  # a short probe: each loop's first unit (warm_last)
        for _ in range(max(request.warmup_steps, 1 if request.timed_phases else 0)):
            self.step()  # a focused probe's phases read what a whole step left
        self.meter.clock.warming = False
        self.step_loops, self.step_wall_s, self.step_var_s2 = [], [], []
        self.watch = watch = MachineWatch(torch.get_num_threads(),
                                          physical_gpu_index(self.device) if self.on_gpu
                                          else None)
        watch.start()
        self.timing = True
        try:
            timed, stopped = self.timed_steps(), None
        except StoppedSlow as slow:
            timed, stopped = [], slow
        machine = watch.stop()
        leave_group()  # only when every rank got here: a failed one just exits (no teardown
        # that could wait on peers stuck in a collective)
        figures = self.figures(timed) if stopped is None else self.stopped_figures(stopped)
        units = unit_times(self.step_loops)
        peaks = dict(self.meter.phase_peak_mem_bytes)
        return ProbeResult(
            **figures, probe_mode="short" if self.meter.clock.short else "full",
            timed_wall_s=sum(self.step_wall_s),
            units={phase: {unit: times.as_dict() for unit, times in kinds.items()}
                   for phase, kinds in units.items()},
            machine=machine.as_dict(),
            contention=machine.contention(),
            peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
            phase_allocator_peak_bytes=dict(self.meter.phase_allocator_peak_bytes),
            phase_tensor_peak_bytes=dict(self.meter.phase_tensor_peak_bytes),
            host_peak_rss_bytes=self.meter.host_peak_rss_bytes,
            host_offload_bytes=self.peak_host_offload_bytes,
            host_held_peak_bytes=self.meter.host_held_peak_bytes,
            num_params=self.num_params, startup_s=startup_s, build_s=build_s,
            share={"val_prompts": 0, **self.ran}, world_size=request.world_size,
            emulated=request.emulated and request.world_size > 1,
            model_state_bytes=dict(self.model_state_bytes),
            engine_weight_bytes=self.engine_weight_bytes, engine=dict(self.engine.figures),
            fsdp_strategy=self.config.fsdp_strategy if self.group is not None else None,
            num_alloc_retries=int(torch.cuda.memory_stats(self.device).get(
                "num_alloc_retries", 0)) if self.on_gpu else None,
            allocator=allocator_record(self.allocator, self.step_phases),
            timed_phases=list(request.timed_phases),
            **describe_device(self.device, request.device.cap_bytes))

    def figures(self, timed: list[dict[str, float]]) -> dict[str, Any]:
        """The timed steps' figures: the step's mean and standard error, the rates."""
        phase_s = {p: sum(t[p] for t in timed) / len(timed) for p in timed[0]}
        step_times_s = [training_s(t) for t in timed]
        step_s, step_se_s = mean_and_se(step_times_s, self.step_var_s2[-1],
                                        self.request.step_cv_prior)
        return {"status": ProbeStatus.OK, "tokens_per_s": self.step_tokens / step_s,
                "samples_per_s": self.step_tokens / self.config.sequence_length / step_s,
                "step_s": step_s, "phase_s": phase_s, "step_times_s": step_times_s,
                "step_se_s": step_se_s}

    def stopped_figures(self, stopped: StoppedSlow) -> dict[str, Any]:
        """A probe stopped slow: the phases its last step measured (a lower bound on its
        step), the rate they allow at most, and why it stopped."""
        floor = self.request.stop_below
        assert floor is not None
        step_s = training_s(stopped.seconds)
        peak = max(self.meter.phase_peak_mem_bytes.values())
        per_gib = stopped.tokens_per_s / (peak / 2**30) if floor.per_gib else None
        figure = f"{per_gib:,.1f} tok/s/GiB" if per_gib is not None else \
            f"{stopped.tokens_per_s:,.1f} tok/s"
        return {"status": ProbeStatus.SLOW,
                "message": (f"stopped after {stopped.phase} of timed step {stopped.step}: "
                            f"at most {figure}, under the floor {floor.describe()}"),
                "tokens_per_s": stopped.tokens_per_s,
                "samples_per_s": stopped.tokens_per_s / self.config.sequence_length,
                "step_s": step_s, "phase_s": dict(stopped.seconds),
                "step_times_s": [training_s(t) for t in self.timed_so_far]}
