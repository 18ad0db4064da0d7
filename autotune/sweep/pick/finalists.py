"""Finalists: the best K configs probed again, round robin, until the leader stands apart.

One probe is one recording, and a machine is noisy (another process, a clock, a cache): the
sweep's best single figure is often a lucky one. When the search stops, the best K feasible
configs (measurements.py ranks them by their figure, pooled over the probes of their
phases) are probed again, one round at a time: the
first round every finalist once more, each later round one more probe of the leader and of
every finalist not yet apart from it, until the leader's figure is apart from every other
finalist's beyond the measured noise (measurements.SEPARATION_Z standard errors, one probe's
spread pooled over the finalists' repeats), or none of them could be more than
measurements.PICK_TOLERANCE above it (the pick's tolerance: its difference at SEPARATION_Z
standard errors), or each has had MAX_PROBES probes.

The pick: the highest figure. With the objective tokens/s alone, where another finalist is
not apart from the leader, the one of them with the lower peak memory (they are as fast as we
can tell, and memory is what makes a config safe); tokens/s per GiB (the default) counts
memory in the figure already, so there the leader stands (memory_breaks_ties). The rule
and why it chose are stored in the study (user attr `finalists`) and written in best.yaml;
`show` and the report print every finalist with its interval.

A round of repeats times only the phases that separate the finalists still close (focused.py:
where they all do the same work, the pooled figure gives them the same time), the same phases
in each of them, the rest of each step from its config's whole probe; where every phase
differs, the repeats are whole, and a whole repeat runs as the sweep's probes do once the study
has measured its step noise (tally.with_step_noise: one timed step where one step's noise would
not decide; README command 1's six repeats took 42 s with two each). Each repeat is a trial
of its own (origin `finalist`, `repeat_of` the config's first trial), added to the study once
its probe ended, so a killed sweep loses at most the probe in flight and the next run goes on
where it stopped; its files are `logs/trial-00007.repeat-2.*`. A repeat's result left by a
driver that died before adding it is read back, not probed again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from autotune.config import Knobs, describe_params, format_bytes
from autotune.files import JsonObject, write_text_atomic
from autotune.probe.measure.result import ProbeRequest, ProbeResult
from autotune.runners import Runner
from autotune.sweep.execution import interrupts
from autotune.sweep.pick.focused import UNTIMED_FROM, completed, is_whole, separating_phases
from autotune.sweep.pick.measurements import (
    FINALIST,
    PICK_TOLERANCE,
    SEPARATION_Z,
    Measured,
    noise,
    ranked,
    study_fixed,
)
from autotune.sweep.study import trial_files
from autotune.sweep.study.objective import counts_memory, score
from autotune.sweep.study.record import result_attrs
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.study.sharing import ran_params

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

FINALISTS = "finalists"  # study user attr: the last re-measure's record
DEFAULT_FINALISTS = 3
MAX_PROBES = 3  # probes of one finalist at most, its first included


class FinalistEntry(TypedDict):
    """One finalist as the record keeps it: its probes, its mean and interval."""

    trial: int
    probes: list[int]
    mean: float
    interval: list[float]
    tokens_per_s: list[float]
    tokens_per_s_mean: float
    tokens_per_s_interval: list[float]
    peak_mem_bytes: int
    contended: int


class FinalistsRecord(TypedDict):
    """The pick among the finalists, as stored in the study (user attr `finalists`)."""

    k: int
    max_probes: int
    objective: str
    rule: str
    noise_relative_sd: float
    chosen: int
    why: str
    probes_counted: int  # the study's probes when it was made: later probes make it stale
    entries: list[FinalistEntry]


def repeat_log_path(study_dir: Path, number: int, probe: int) -> Path:
    return trial_files.log_path(study_dir, number).with_suffix(f".repeat-{probe}.log")


def standing(finalists: list[Measured]) -> tuple[float, list[Measured]]:
    """One probe's noise, and the finalists not apart from the leader (the leader first).
    Until one finalist has two probes nothing is apart: the noise is not known yet."""
    spread = noise(finalists)
    leader = finalists[0]
    repeated = any(len(m.values) >= 2 for m in finalists)
    close = [m for m in finalists[1:] if not repeated or not leader.apart_from(m, spread)]
    return spread, [leader, *close]


def tolerated(close: list[Measured], spread: float) -> bool:
    """Whether every finalist close to the leader (`close`, the leader first, each probed
    twice at least) could be at most PICK_TOLERANCE above it: more repeats could change the
    pick by less than the user's tolerance."""
    leader = close[0]
    return len(close) > 1 and all(m.probes >= 2 for m in close) and \
        all(leader.tolerates(m, spread) for m in close[1:])


def remeasure(study: Study, settings: SweepSettings, runner: Runner, k: int,
              capacity_bytes: int | None, say: Callable[[str], None] = lambda line: None,
              prepare: Callable[[ProbeRequest], ProbeRequest] = lambda request: request
              ) -> int:
    """Probe the best `k` feasible configs again until the leader stands apart or the
    budget is spent; store the pick. Returns how many probes ran. `prepare` gives a whole
    repeat's request what the sweep's probes had (the driver: the study's measured step
    noise, tally.with_step_noise, so it times one step where one step's noise would not
    decide, as the sweep's probes did); a focused repeat times part of a step, whose spread
    the study's whole steps do not tell, and runs as asked."""
    probes = 0
    for _ in range(2 * k * MAX_PROBES):  # a probe lost with its node adds no probe: bounded
        finalists = ranked(study)[:k]
        if len(finalists) < 2:
            break
        spread, close = standing(finalists)
        todo = [m for m in finalists if m.probes < 2] or \
            ([m for m in close if m.probes < MAX_PROBES]
             if len(close) > 1 and not tolerated(close, spread) else [])
        if not todo:
            break
        fewest = min(m.probes for m in todo)
        timed = round_phases(close if len(close) > 1 else finalists, study_fixed(study))
        for measured in [m for m in todo if m.probes == fewest]:
            probes += probe_again(study, settings, runner, measured, capacity_bytes, say,
                                  timed, prepare)
    if ranked(study)[:1]:
        study.set_user_attr(FINALISTS, decide(study, k))
    return probes


def probe_again(study: Study, settings: SweepSettings, runner: Runner, measured: Measured,
                capacity_bytes: int | None, say: Callable[[str], None],
                timed: tuple[str, ...] = (),
                prepare: Callable[[ProbeRequest], ProbeRequest] = lambda request: request
                ) -> int:
    """One more probe of a finalist, added to the study as a trial; 1 when it ran. With
    `timed` phases (round_phases) a built-in colocated probe times those alone (focused.py),
    its untimed phases taken from the config's whole probe."""
    import optuna

    number = measured.number
    count = 2 + sum(t.user_attrs.get("repeat_of") == number
                    for t in study.get_trials(deepcopy=False))
    log = repeat_log_path(settings.study_dir, number, count)
    candidate = settings.space.candidate(measured.trial.params)
    request = dataclasses.replace(settings.request_for(candidate),
                                  **settings.slots[0].request_fields())
    whole = whole_probe(measured)
    if timed and whole is not None and request.command is None and \
            not candidate.config.separate:
        request = dataclasses.replace(request, timed_phases=timed)
    else:  # a whole step, whose spread the study measured (a focused one's it did not)
        request = prepare(request)
    result = read_repeat(log)
    ran = result is None
    if result is None:
        timing = f", timing {' and '.join(request.timed_phases)}" if request.timed_phases \
            else ""
        say(f"finalist trial {number} ({describe_params(measured.trial.params)}): "
            f"probe {count} of {MAX_PROBES}{timing}")
        log.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(log.with_suffix(".request.json"), request.to_json())
        interrupts.raise_if_interrupted()
        result = runner.run(request, log)
    basis = whole if result.timed_phases else None  # a focused repeat's untimed phases
    if basis is not None:
        result = completed(result, basis[1])
    verdict = score(result, settings.objective, settings.headroom, capacity_bytes)
    attrs: JsonObject = {
        "status": result.status.value, "probed": True, "predicted": False,
        "feasible": verdict.feasible, "reason": verdict.reason,
        "budget_bytes": verdict.budget_bytes, "binding_phase": verdict.binding_phase,
        "log": str(log.relative_to(settings.study_dir)), "origin": FINALIST,
        "repeat_of": number, "result": result_attrs(result)}
    if basis is not None:
        attrs[UNTIMED_FROM] = basis[0].number
    complete = verdict.state != "fail"
    study.add_trial(optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE if complete else optuna.trial.TrialState.FAIL,
        values=list(verdict.values or ()) if complete else None,
        params=measured.trial.params, distributions=measured.trial.distributions,
        user_attrs=attrs, constraints=verdict.constraints))
    return int(ran)


def whole_probe(measured: Measured) -> tuple[FrozenTrial, ProbeResult] | None:
    """The config's first probe that timed every phase of whole steps, with its result."""
    for trial in measured.trials:
        stored = trial.user_attrs.get("result")
        try:
            result = ProbeResult.from_dict(stored) if stored else None
        except (TypeError, KeyError, ValueError):
            continue
        if result is not None and is_whole(result):
            return trial, result
    return None


def round_phases(group: list[Measured], fixed: Knobs) -> tuple[str, ...]:
    """The phases a round of repeats times in every finalist of `group`: those in which they
    do not all do the same work (focused.py); () for whole probes, also where one of them has
    no whole probe to take the rest from."""
    wholes = [whole_probe(m) for m in group]
    if any(w is None for w in wholes) or not wholes:
        return ()
    return separating_phases([{**fixed, **ran_params(w[0])} for w in wholes if w],
                             wholes[0][1].phase_s if wholes[0] else {})


def read_repeat(log: Path) -> ProbeResult | None:
    """A repeat's result a driver that died before adding it left, if it is whole."""
    try:
        return ProbeResult.from_json(log.with_suffix(".result.json").read_text())
    except (OSError, ValueError, TypeError, KeyError):
        return None


def memory_breaks_ties(objective: str) -> bool:
    """Whether finalists within the noise of the leader go to the lowest peak memory: where
    the objective is tokens/s alone. Tokens/s per GiB (and pareto's ranking, the same figure)
    counts memory already: a finalist that holds less is ranked up by it, and taking it over
    the leader within the noise would count its memory twice."""
    return not counts_memory(objective)


def decide(study: Study, k: int) -> FinalistsRecord:
    """The pick among the best `k` configs, the rule that made it, and every finalist."""
    objective = study.user_attrs.get("identity", {}).get("objective", "throughput_per_memory")
    finalists = ranked(study)[:k]
    spread, close = standing(finalists)
    leader = finalists[0]
    by_memory = memory_breaks_ties(objective)
    chosen = min(close, key=lambda m: (m.peak_mem_bytes, -m.figure)) if by_memory else leader
    if len(finalists) == 1:
        why = "the only feasible config"
    elif chosen is leader and len(close) == 1:
        why = f"its mean is apart from every other finalist's ({SEPARATION_Z:g} standard errors)"
    elif chosen is leader and not by_memory:
        why = ("the highest figure; not apart from trial(s) " +
               ", ".join(str(m.number) for m in close[1:]) + " within the noise, whose "
               f"memory the {objective} figure counts already")
    elif chosen is leader:
        why = ("not apart from trial(s) " + ", ".join(str(m.number) for m in close[1:]) +
               " within the noise, and the lowest peak memory of them")
    else:
        why = (f"within the noise of the leader, trial {leader.number} "
               f"({leader.figure:,.1f}), and the lowest peak memory of those "
               f"({format_bytes(chosen.peak_mem_bytes)} vs "
               f"{format_bytes(leader.peak_mem_bytes)})")
    if tolerated(close, spread):  # the repeats' stop, whichever finalist the rule took
        why += (f"; none can be more than {PICK_TOLERANCE:.0%} above the leader at "
                f"{SEPARATION_Z:g} standard errors, so the repeats stopped there")
    tie = "the lowest peak memory of those" if by_memory else \
        "still the highest: the figure counts memory already"
    return {
        "k": k, "max_probes": MAX_PROBES, "objective": objective,
        "rule": (f"the highest {objective}, each config's phases timed by every probe that "
                 f"ran them; where another finalist is within {SEPARATION_Z:g} standard errors "
                 f"of it, {tie}"),
        "noise_relative_sd": round(spread, 4),
        "chosen": chosen.number, "why": why,
        "probes_counted": sum(m.probes for m in ranked(study)),
        "entries": [entry(m, spread) for m in finalists],
    }


def entry(measured: Measured, spread: float) -> FinalistEntry:
    low, high = measured.interval(spread)
    scale = measured.tokens_per_s_mean / measured.mean if measured.mean else 0.0
    return {"trial": measured.number, "probes": [t.number for t in measured.trials],
            "mean": measured.figure, "interval": [low, high],
            "tokens_per_s": measured.tokens_per_s,
            "tokens_per_s_mean": measured.figure * scale,  # pooled, where it is
            "tokens_per_s_interval": [low * scale, high * scale],
            "peak_mem_bytes": measured.peak_mem_bytes, "contended": measured.contended}


def current_record(study: Study, configs: Mapping[str, Measured] | None = None
                   ) -> FinalistsRecord | None:
    """The stored pick, while no config was probed since it was made; else None (`configs`:
    the study's by_config, when the caller holds it)."""
    record: FinalistsRecord | None = study.user_attrs.get(FINALISTS)
    if not record:
        return None
    counted = sum(m.probes for m in ranked(study, configs))
    return record if record.get("probes_counted") == counted else None


def describe(record: FinalistsRecord) -> list[str]:
    """The finalists as `show` prints them: each with its interval, and the rule."""
    lines = [f"finalists (each probed up to {record['max_probes']} times; one probe's noise "
             f"{record['noise_relative_sd']:.1%}):"]
    for item in record["entries"]:
        low, high = item["tokens_per_s_interval"]
        mark = " <- picked" if item["trial"] == record["chosen"] else ""
        lines.append(f"  trial {item['trial']}: {item['tokens_per_s_mean']:,.1f} tokens/s "
                     f"[{low:,.1f}, {high:,.1f}] over {len(item['probes'])} probe(s), peak "
                     f"{format_bytes(item['peak_mem_bytes'])}"
                     + (f", {item['contended']} under contention" if item["contended"] else "")
                     + mark)
    lines.append(f"  rule: {record['rule']}; picked trial {record['chosen']}: {record['why']}")
    return lines

