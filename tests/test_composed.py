"""The composed proposal (sweep/pick/composed.py): an untried config made of phases other
probes ran, queued when it beats the best probed one. Pure arithmetic on made-up probes; the
real sweep queues it in the neighbour's slot (test_tuner.py)."""

from __future__ import annotations

import pytest

from autotune.config import SYNC_PHASE as SYNC
from autotune.sweep.pick.composed import Composer, best_composed
from autotune.sweep.pick.pooled import ProbeTimes
from autotune.sweep.space.params import params_key

GiB = 1 << 30
BASE = {"micro_batch_size_update": 2, "gradient_checkpointing": True,
        "gpu_memory_utilization": 0.5, "rollout_engine": "vllm-like"}


def probe(rollout_s, update_s, rollout_gib, update_gib, tokens=1200.0, contended=False,
          **knobs):
    config = {**BASE, **knobs}
    return ProbeTimes(config=params_key(config), knobs=config,
                      phase_s={"rollout": rollout_s, "update": update_s},
                      step_s=rollout_s + update_s, relative_se=0.0, tokens_per_step=tokens,
                      contended=contended,
                      phase_peak_bytes={"rollout": rollout_gib * GiB,
                                        "update": update_gib * GiB})


# a fast rollout at the larger engine share, a fast update at the larger micro-batch: each
# probed beside the other phase's slow setting, never together
A = probe(10.0, 30.0, 40, 30)
B = probe(5.0, 30.0, 60, 30, gpu_memory_utilization=0.8)
C = probe(10.0, 10.0, 40, 50, micro_batch_size_update=8)
BOTH = {**BASE, "gpu_memory_utilization": 0.8, "micro_batch_size_update": 8}


def test_an_untried_config_is_composed_from_the_probes_that_ran_its_phases():
    composed = Composer([A, B, C], "throughput").compose(BOTH, {})
    assert composed is not None
    assert composed.tokens_per_s == pytest.approx(1200.0 / (5.0 + 10.0))  # B's rollout, C's
    assert composed.peak_mem_bytes == 60 * GiB  # B's rollout holds the most (update)
    per_gib = Composer([A, B, C], "throughput_per_memory").compose(BOTH, {})
    assert per_gib is not None and per_gib.score == pytest.approx(1200.0 / 15.0 / 60)


def test_a_phase_no_probe_ran_composes_nothing():
    assert Composer([A, B], "throughput").compose(BOTH, {}) is None  # no update at mbu 8
    # checkpointing off: the update's work and its memory are another phase's key
    assert Composer([A, B, C], "throughput").compose(
        {**BOTH, "gradient_checkpointing": False}, {}) is None


def test_an_engine_that_does_not_sleep_keeps_its_share_in_the_updates_memory():
    """The update's memory key holds the engine's share only where the engine stays awake
    through it (memory.phases.phase_knobs): awake, C's update at 0.5 is not BOTH's at 0.8."""
    awake = {"enable_sleep": False}
    probes = [probe(10.0, 30.0, 40, 30, **awake), probe(5.0, 30.0, 60, 30, **awake,
                                                        gpu_memory_utilization=0.8),
              probe(10.0, 10.0, 40, 50, **awake, micro_batch_size_update=8)]
    assert Composer(probes, "throughput").compose({**BOTH, **awake}, {}) is None


def test_the_best_composition_must_beat_the_best_probe_and_fit_the_budget():
    untried = [BOTH, {**BASE, "micro_batch_size_update": 8, "gradient_checkpointing": False}]
    best = best_composed([A, B, C], untried, {}, "throughput", 64 * GiB, beat=1200.0 / 20.0)
    assert best is not None and best.params == BOTH
    assert best_composed([A, B, C], untried, {}, "throughput", 55 * GiB, None) is None
    assert best_composed([A, B, C], untried, {}, "throughput", None, beat=100.0) is None
    # contended probes stand only where no quiet one ran the phase
    slow = probe(50.0, 30.0, 60, 30, contended=True, gpu_memory_utilization=0.8)
    again = best_composed([A, B, slow, C], untried, {}, "throughput", None, None)
    assert again is not None and again.tokens_per_s == pytest.approx(1200.0 / 15.0)


class PhaseRunner:
    """A device whose phase times are set by each phase's own knobs (the experience by its
    micro-batch, the update by its micro-batch and checkpointing, offload slowing every phase)
    and whose memory is the memory model's: the composition is then exact, so a composed
    config's own probe measures what the composer said."""

    def __init__(self) -> None:
        from scripted_runner import ModelRunner

        self.memory = ModelRunner(limit_bytes=1 << 40)
        self.calls: list[dict] = []

    def run(self, request, log_path=None):
        from autotune.probe.measure.result import ProbeResult, ProbeStatus

        config = request.config
        self.calls.append(config.as_dict())
        slow = 2.0 if config.offload_params else 1.0
        phase_s = {"rollout": 3.0 * slow,
                   "experience": (1.0 + 8.0 / config.micro_batch_size_experience) * slow,
                   "update": (1.0 + 8.0 / config.micro_batch_size_update
                              + (2.0 if config.gradient_checkpointing else 0.0)) * slow}
        step_s = sum(phase_s.values())
        peaks = self.memory.phase_bytes(config)
        return ProbeResult(status=ProbeStatus.OK, tokens_per_s=1000.0 / step_s,
                           samples_per_s=1.0, step_s=step_s, phase_s=phase_s,
                           peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
                           device_name="model", device_capacity_bytes=1 << 40,
                           probe_wall_s=step_s)

    def stop(self) -> None:
        """Nothing runs outside this call."""

    def close(self) -> None:
        """Nothing to release."""


def test_a_real_sweep_probes_the_composition_of_its_probes_phases(tmp_path):
    """A TPE sweep over cpu-demo queues composed configs in the neighbour's slot: each one
    untried when queued, every phase of it run by an earlier probe, and its own probe
    measuring the step the composition predicted (the runner's phases are exact)."""
    import optuna

    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.pick.pooled import phase_key, probe_times
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    settings = SweepSettings(study_name="s", study_dir=tmp_path / "s",
                             space=load_search_space("cpu-demo"),
                             request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                             max_trials=24, seed=3, objective="throughput", finalists=0,
                             trace=False)
    Sweep(settings, PhaseRunner()).run()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    probed = [t for t in study.trials if t.user_attrs.get("probed")]
    composed = [t for t in probed if t.user_attrs.get("origin") == "composed"]
    assert composed, [t.user_attrs.get("origin") for t in probed]
    fixed = dict(study.user_attrs["search_space"]["fixed"])
    for trial in composed:
        earlier = [probe_times(t, fixed) for t in probed if t.number < trial.number]
        mine = probe_times(trial, fixed)
        assert mine is not None and mine.config not in {e.config for e in earlier}
        for phase in mine.phase_s:  # each phase was some earlier probe's, at the same time
            shared = [e for e in earlier
                      if phase_key(phase, e.knobs) == phase_key(phase, mine.knobs)]
            assert shared and shared[0].phase_s[phase] == pytest.approx(mine.phase_s[phase])
        better = max(t.values[0] for t in probed if t.number < trial.number)
        assert trial.values[0] > better  # queued because it beat the best probed config


class NoisyPhaseRunner(PhaseRunner):
    """PhaseRunner with each phase of every probe drawn anew around its time (lognormal, 15%,
    seeded): the best single recording is then often a lucky draw."""

    def __init__(self, seed: int) -> None:
        import random

        super().__init__()
        self.rng = random.Random(seed)

    def run(self, request, log_path=None):
        import math

        result = super().run(request, log_path)
        phase_s = {phase: seconds * math.exp(self.rng.gauss(0.0, 0.15))
                   for phase, seconds in result.phase_s.items()}
        step_s = sum(phase_s.values())
        return result.replace(phase_s=phase_s, step_s=step_s, tokens_per_s=1000.0 / step_s,
                              probe_wall_s=step_s)


def leader_before(trials, number: int, fixed: dict):
    """The leader (the pick's ranking: measurements.rank) over the trials before `number`."""
    from autotune.sweep.pick.measurements import fold, rank

    configs: dict = {}
    for earlier in trials[:number]:
        fold(configs, earlier, "throughput")
    return rank(configs, fixed)[0]


def test_the_search_moves_around_the_pooled_leader_not_the_luckiest_recording(tmp_path):
    """Under noise the search's proposals (a neighbour, a composition) start from the config
    the pick would choose now (tally.leader: the best pooled figure), never from the best
    single recording, which is the luckiest draw: each proposal is a neighbour of, or composes
    better than, the leader of the trials before it, and over three seeded studies the two
    differ at some proposal (so the rule is what decides, not chance)."""
    import optuna

    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.feasibility.frontier import Frontier
    from autotune.sweep.pick.pooled import probe_times
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    space = load_search_space("cpu-demo")
    proposals, differed = 0, 0
    for seed in (5, 6, 7):  # three studies, so a sampler's other draws cannot hide the rule
        name = f"s{seed}"
        settings = SweepSettings(study_name=name, study_dir=tmp_path / name, space=space,
                                 request=ProbeRequest(model="tiny-qwen2.5",
                                                      device=Device("cpu")),
                                 max_trials=40, seed=seed, objective="throughput",
                                 finalists=0, trace=False)
        sweep = Sweep(settings, NoisyPhaseRunner(seed=seed))
        sweep.run()
        study = optuna.load_study(study_name=name,
                                  storage=f"sqlite:///{tmp_path / name / 'study.db'}")
        fixed = dict(study.user_attrs["search_space"]["fixed"])
        trials = study.get_trials(deepcopy=False)
        frontier = Frontier(space, sweep.feasibility, 0)
        for trial in trials:
            origin = trial.user_attrs.get("origin")
            if origin not in ("neighbour", "composed"):
                continue
            leader = leader_before(trials, trial.number, fixed)
            luckiest = max((t for t in trials[:trial.number] if t.user_attrs.get("probed")
                            and t.values), key=lambda t: t.values[0])
            proposals += 1
            differed += params_key(luckiest.params) != params_key(leader.trial.params)
            if origin == "neighbour":
                assert params_key(trial.params) in {
                    params_key(p) for p in frontier.neighbours(dict(leader.trial.params))}
            else:  # composed: queued because its composition beat the leader's figure
                probes = [p for t in trials[:trial.number] if (p := probe_times(t, fixed))]
                assert best_composed(probes, [dict(trial.params)], fixed, "throughput", None,
                                     beat=leader.figure) is not None
    print(f"proposals {proposals}, leader not the luckiest at {differed}")
    assert proposals >= 3 and differed >= 1, (proposals, differed)


def test_the_tallys_leader_is_the_pooled_best_and_a_slow_probe_is_held_to_it(tmp_path):
    """Three probes through the sweep's tally: config A once at 1,000 tok/s (its update drawn
    fast), then B twice, 980 and 926, whose update phase A shares and measured slower, so A's
    pooled figure falls under B's. The best single recording stays A's (the progress view and
    --patience read it); the leader is B, and the floor a new probe may stop slow under is
    B's figure less the noise, B's trial its incumbent."""
    import optuna

    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    space = load_search_space("cpu-demo")
    settings = SweepSettings(study_name="s", study_dir=tmp_path / "s", space=space,
                             request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                             objective="throughput", trace=False)
    tally = Sweep(settings, PhaseRunner()).tally
    base = dict(space.safe_params())  # A and B differ in the experience's knob alone
    a = {**base, "micro_batch_size_experience": 2}
    b = {**base, "micro_batch_size_experience": 16}

    def told(number, params, experience_s, update_s):
        step_s = experience_s + update_s
        frozen = optuna.trial.create_trial(
            params=params, distributions=space.distributions(), values=[1000.0 * 10 / step_s],
            user_attrs={"probed": True, "status": "ok", "feasible": True, "result": {
                "status": "ok", "tokens_per_s": 1000.0 * 10 / step_s, "step_s": step_s,
                "phase_s": {"experience": experience_s, "update": update_s},
                "peak_mem_bytes": 2**30, "step_times_s": [step_s]}})
        frozen.number = number
        tally.fold(frozen)

    told(0, a, 4.0, 6.0)  # 1,000 tok/s: its update drawn fast
    told(1, b, 3.6, 6.6)  # 980 tok/s
    told(2, b, 3.7, 7.1)  # 926 tok/s: the update A shares, slower
    assert tally.best_scalar == pytest.approx(1000.0)
    leader = tally.leader()  # A pooled: 10,000 / (4.0 + 6.57) = 946; B: 979
    assert leader is not None and leader.number == 1
    assert leader.figure == pytest.approx(10_000 / (3.65 + (6.0 + 6.6 + 7.1) / 3))
    floor = tally.stop_below()
    assert floor is not None and floor.incumbent == 1
    assert floor.tokens_per_s == pytest.approx(leader.figure * (1 - floor.margin))


def test_a_split_whose_trainer_paces_the_step_moves_the_trainers_knobs():
    """Overlapped sides (staleness 1): the step is the slower side's, so with the trainer
    pacing it only the trained phases' knobs, the staleness and what both sides read can
    change it; the engine's reservation and TP cannot (a knob only the waiting side reads).
    Colocated, or taking turns, every knob does. Where the objective counts memory, the
    knobs of the phase holding the peak count too."""
    from autotune.config.pipeline import pacing_phases
    from autotune.sweep.pick.composed import moving_knobs
    from autotune.sweep.pick.pooled import pacing_knobs

    phase_s = {"rollout": 90.0, "experience": 30.0, "update": 87.0, SYNC: 0.1}
    assert pacing_phases(phase_s, separate=True, staleness=1) == \
        {"experience", "update", SYNC}
    assert pacing_phases({**phase_s, "rollout": 130.0}, True, 1) == {"rollout", SYNC}
    assert pacing_phases(phase_s, True, 0) == pacing_phases(phase_s, False) == set(phase_s)
    # sides within the noise both pace: 87 + 30 = 117 s against 110 is 6% apart
    close = {**phase_s, "rollout": 110.0}
    assert pacing_phases(close, True, 1, tolerance=0.05) == {"experience", "update", SYNC}
    assert pacing_phases(close, True, 1, tolerance=0.07) == set(phase_s)
    knobs = {"placement": "separate", "rollout_gpus": 4, "staleness": 1,
             "rollout_engine": "vllm-like", "micro_batch_size_update": 4,
             "gradient_checkpointing": True, "offload_optimizer": False,
             "gpu_memory_utilization": 0.6, "rollout_tensor_parallel": 2,
             "val_batch_size": 8}  # read by validation alone, which no probe here timed
    paced = pacing_knobs(knobs, phase_s)
    assert {"micro_batch_size_update", "gradient_checkpointing", "offload_optimizer",
            "rollout_gpus", "staleness", "val_batch_size"} <= paced
    assert not paced & {"gpu_memory_utilization", "rollout_tensor_parallel"}
    assert pacing_knobs(knobs, {**phase_s, "rollout": 130.0}) >= \
        {"gpu_memory_utilization", "rollout_tensor_parallel", "rollout_gpus", "staleness"}
    assert pacing_knobs({**knobs, "placement": "colocated"}, phase_s) == set(knobs)
    peaks = {"rollout": 70 * GiB, "experience": 30 * GiB, "update": 40 * GiB}
    assert moving_knobs(knobs, phase_s, peaks, "throughput") == paced
    assert "gpu_memory_utilization" in moving_knobs(knobs, phase_s, peaks,
                                                    "throughput_per_memory")


class SplitRunner:
    """A split of 8 GPUs whose trainer paces every step (the engine's side 10 s, the
    trainer's 12 s or more): its update by its micro-batch and checkpointing, its rollout by
    the engine's knobs. Memory: a constant, far under the device."""

    def run(self, request, log_path=None):
        from autotune.probe.measure.result import ProbeResult, ProbeStatus

        config = request.config
        phase_s = {"rollout": 10.0 - config.gpu_memory_utilization
                   - config.rollout_tensor_parallel / 4,
                   "experience": 4.0,
                   "update": 8.0 + 8.0 / config.micro_batch_size_update
                   + (2.0 if config.gradient_checkpointing else 0.0),
                   SYNC: 0.1}
        step_s = max(phase_s["rollout"], phase_s["experience"] + phase_s["update"]) + 0.1
        assert step_s > phase_s["rollout"] + 1.0  # the trainer paces
        peaks = {"rollout": 20 * GiB, "experience": 20 * GiB, "update": 30 * GiB}
        return ProbeResult(status=ProbeStatus.OK, tokens_per_s=1000.0 / step_s,
                           samples_per_s=1.0, step_s=step_s, phase_s=phase_s,
                           peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
                           device_name="model", device_capacity_bytes=80 * GiB,
                           probe_wall_s=step_s)

    def stop(self) -> None:
        """Nothing runs outside this call."""

    def close(self) -> None:
        """Nothing to release."""


def test_the_neighbour_moves_of_a_split_try_the_knobs_of_the_side_that_paces(tmp_path):
    """A real TPE sweep over a split whose trainer paces the step: each neighbour move of the
    leader moves a knob the trainer's phases read while one such neighbour is left untried,
    never the engine's reservation or TP, which only set how long the engine waits (in
    placement.py's sweep such moves spent 3 of a seed's last 7 neighbours)."""
    import optuna
    import yaml

    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.feasibility.frontier import Frontier
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.tuner import Sweep

    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump({"params": {
        "micro_batch_size_update": {"type": "categorical", "choices": [1, 2, 4, 8]},
        "gradient_checkpointing": {"type": "bool"},
        "gpu_memory_utilization": {"type": "categorical",
                                   "choices": [0.5, 0.6, 0.7, 0.8, 0.9]},
        "rollout_tensor_parallel": {"type": "categorical", "choices": [1, 2, 4]}},
        "fixed": {"placement": "separate", "rollout_gpus": 4, "staleness": 1,
                  "rollout_engine": "vllm-like", "rollout_batch_size": 64, "rollout_n": 8,
                  "global_batch_size": 32, "micro_batch_size_experience": 4,
                  "max_prompt_length": 1024, "max_response_length": 2048}}))
    space = load_search_space(str(path)).for_world(8)
    trainer_knobs = {"micro_batch_size_update", "gradient_checkpointing"}
    moves = 0
    for seed in (0, 1, 2, 3):
        name = f"s{seed}"
        settings = SweepSettings(
            study_name=name, study_dir=tmp_path / name, space=space,
            request=ProbeRequest(model="qwen2.5-7b", gpus_per_node=8,
                                 device=Device("cuda", capacity_bytes=80 * GiB)),
            max_trials=30, seed=seed, objective="throughput", finalists=0, trace=False,
            prescreen=False)
        sweep = Sweep(settings, SplitRunner())
        sweep.run()
        frontier = Frontier(space, sweep.feasibility, 0)
        study = optuna.load_study(study_name=name,
                                  storage=f"sqlite:///{tmp_path / name / 'study.db'}")
        fixed = dict(study.user_attrs["search_space"]["fixed"])
        trials = study.get_trials(deepcopy=False)
        for trial in trials:
            if trial.user_attrs.get("origin") != "neighbour":
                continue
            leader = dict(leader_before(trials, trial.number, fixed).trial.params)
            moved = {k for k in leader if leader[k] != trial.params[k]}
            seen = {params_key(t.params) for t in trials[:trial.number]}
            left = [near for near in frontier.neighbours(leader)
                    if params_key(near) not in seen and
                    {k for k in near if near[k] != leader[k]} <= trainer_knobs]
            if left:
                moves += 1
                assert moved <= trainer_knobs, (trial.number, leader, trial.params)
    print(f"neighbour moves with a trainer knob left: {moves}")
    assert moves >= 5, moves
