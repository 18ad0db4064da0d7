"""Text for people: a probe's result, the model registry. Units are converted only here."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autotune.config import (
    PHASES,
    SYNC_PHASE,
    describe_engine,
    describe_params,
    format_bytes,
)
from autotune.probe.measure.result import (
    ProbeResult,
    coefficient_of_variation,
    probe_ranks_text,
    study_probes_text,
)

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

    from autotune.sweep.driver import SweepOutcome
    from autotune.sweep.study.settings import SweepSettings


def format_probe_result(result: ProbeResult, model: str) -> str:
    """A short readable summary of one probe: status, speed, per-phase time and memory."""
    device = result.device_name or "unknown device"
    ranks = probe_ranks_text(result.world_size, result.emulated,
                             split=bool(result.side_peak_mem_bytes))  # split: placement=separate
    lines = [f"probe {model} on {device}{', ' + ranks if ranks else ''}: {result.status.value}"]
    if not result.ok:
        where = f" (in {result.failed_phase})" if result.failed_phase else ""
        lines.append(f"  {result.message}{where}")
    if result.tokens_per_s is not None:
        lines.append(f"  tokens/s {result.tokens_per_s:,.1f}   samples/s "
                     f"{result.samples_per_s:,.2f}   step {result.step_s:.2f} s "
                     "(the whole run, validation excluded)")
        se = f" +- {result.step_se_s:.2f} s (standard error)" if result.step_se_s else ""
        if result.probe_mode == "short":
            lines.append(f"  short probe: the step predicted{se} from each loop's first units "
                         f"and its last, over {len(result.step_times_s)} steps taking "
                         f"{result.timed_wall_s or 0.0:.1f} s (--full-steps runs every unit)")
        elif result.step_times_s:
            lines.append(f"  full steps: {len(result.step_times_s)} timed{se}")
        if result.composed_step_s is not None:
            sides = result.side_peak_mem_bytes
            lines.append(f"  pipeline: the step as it ran, sync to sync; "
                         f"{result.composed_step_s:.2f} s composed from its phases "
                         f"(config/pipeline.py); peak {format_bytes(sides.get('engine'))} on "
                         f"the engine's side, {format_bytes(sides.get('trainer'))} on the "
                         "trainer's")
    if result.model_state_bytes and result.world_size > 1:
        states = result.model_state_bytes
        for model, prefix in (("model", ""), ("critic", "critic_")):
            if f"{prefix}params" not in states:
                continue
            parts = [states[f"{prefix}{k}"] for k in ("params", "grads", "optimizer")]
            lines.append(f"  {model} states per rank {format_bytes(sum(parts))} (params "
                         f"{format_bytes(parts[0])}, grads {format_bytes(parts[1])}, "
                         f"optimizer {format_bytes(parts[2])})")
    phases = [p for p in (*PHASES, SYNC_PHASE)
              if p in result.phase_peak_mem_bytes or p in result.phase_s]
    if phases:
        lines.append(f"  {'phase':<14}{'seconds':>9}{'peak device memory':>21}")
        for phase in phases:
            seconds = result.phase_s.get(phase)
            shown = f"{seconds:.2f}" if seconds is not None else "-"
            peak = format_bytes(result.phase_peak_mem_bytes.get(phase))
            lines.append(f"  {phase:<14}{shown:>9}{peak:>21}"
                         f"{'  (max over ranks)' if result.rank_peak_mem_bytes else ''}")
    capacity = format_bytes(result.device_capacity_bytes)
    limit = result.device_limit_bytes
    limit_text = f", limit {format_bytes(limit)}" if limit else ""
    lines.append(f"  peak device memory {format_bytes(result.peak_mem_bytes)} of {capacity}"
                 f"{limit_text}   host peak RSS {format_bytes(result.host_peak_rss_bytes)}"
                 f"   offloaded to host {format_bytes(result.host_offload_bytes)}")
    if result.fixed_cost_s is not None:
        lines.append(f"  fixed cost {result.fixed_cost_s:.1f} s (startup {result.startup_s:.1f} s,"
                     f" build {result.build_s:.1f} s)   probe wall {result.probe_wall_s:.1f} s")
    if not result.ok and result.stderr_tail:
        tail = result.stderr_tail.strip().splitlines()[-8:]
        lines.append("  stderr tail:")
        lines.extend(f"    {line}" for line in tail)
    return "\n".join(lines)


def format_table(rows: Sequence[Mapping[str, object]], columns: list[str]) -> str:
    """A plain left-aligned table with a header row."""
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    lines = [{c: c for c in columns}, *rows]
    return "\n".join("  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns).rstrip()
                     for row in lines)


def _trial_cells(trial: FrozenTrial) -> dict[str, object]:
    from autotune.sweep.study.sharing import ran_params

    attrs = trial.user_attrs
    result = attrs.get("result") or {}
    tokens = result.get("tokens_per_s")
    peak = result.get("peak_mem_bytes")
    status = attrs.get("status", trial.state.name.lower())
    if attrs.get("reused_from") is not None:
        status = f"= #{attrs['reused_from']}"
    elif attrs.get("predicted"):
        status = f"predicted {status}"
    elif status in ("ok", "slow") and not attrs.get("feasible"):
        status = "over headroom"
    if attrs.get("repeat_of") is not None:
        status = f"{status}, again #{attrs['repeat_of']}"
        if result.get("timed_phases"):  # a focused repeat: the rest from a whole probe
            status += f" ({' '.join(result['timed_phases'])} timed)"
    steps = result.get("step_times_s") or []
    cv = coefficient_of_variation(steps)
    spread = f"{cv:.1%}" if cv is not None else "1 step" if len(steps) == 1 else "-"
    if result.get("contention"):
        spread += " busy"  # measured while other processes took the machine
    return {"#": trial.number, "status": status, "config": describe_params(ran_params(trial)),
            "tokens/s": f"{tokens:,.1f}" if tokens else "-",
            "peak": format_bytes(peak) if peak else "-",
            "step cv": spread,
            "phase": attrs.get("binding_phase") or result.get("failed_phase") or "-",
            "probe s": f"{result['probe_wall_s']:.0f}" if result.get("probe_wall_s") else "-"}


def response_reach(study: Study, trials: list[FrozenTrial]) -> dict[int, str]:
    """Each run or predicted config's length headroom, for the trials table."""
    from autotune.config import KNOB_NAMES, ProbeConfig
    from autotune.sweep.feasibility.study_model import study_model
    from autotune.sweep.study.sharing import ran_params

    model = study_model(study)
    budget = next((t.user_attrs["budget_bytes"] for t in trials
                   if t.user_attrs.get("budget_bytes")), None)
    if model is None or not budget:
        return {}
    base = {**(study.user_attrs.get("request") or {}).get("config", {}),
            **study.user_attrs.get("search_space", {}).get("fixed", {})}
    reach = {}
    for trial in trials:
        status = trial.user_attrs.get("status")
        if status not in ("ok", "slow", "gpu_oom") and not trial.user_attrs.get("predicted"):
            continue
        merged = {**base, **ran_params(trial)}
        config = ProbeConfig(**{k: merged[k] for k in KNOB_NAMES if k in merged})
        measured = (trial.user_attrs.get("result") or {}).get("phase_peak_mem_bytes") \
            if status in ("ok", "slow") else None
        headroom = model.headroom(config, budget, measured)
        reach[trial.number] = f"{headroom.fits_up_to:,}" if headroom.bounded_by_memory \
            else f">={headroom.searched_to:,}"
    return reach


def format_study(study: Study, brief: bool = False) -> str:
    """A study for people: its trials (unless brief), the Pareto front and the best config."""
    from autotune.sweep.pick.artifacts import best_trial, pareto_front

    trials = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("status")]
    lines = _study_header(study, trials)
    columns = ["#", "status", "config", "tokens/s", "step cv", "peak", "phase", "probe s"]
    if not brief and trials:
        lines += _trials_table(study, trials, columns)
    front = pareto_front(study)
    if front:
        lines += ["", "Pareto front (tokens/s up, peak memory down):",
                  format_table([_trial_cells(t) for t in front], columns)]
    best = best_trial(study)
    if best is None:
        return "\n".join([*lines, "", "no feasible configuration yet"])
    return "\n".join([*lines, *_best_lines(study, trials, best)])


def _probes_text(study: Study, trials: list[FrozenTrial], world: int) -> str:
    """How the study's probes ran, by the placements of the trials it probed."""
    from autotune.sweep.pick.artifacts import trial_knobs

    probed = [t for t in trials if t.user_attrs.get("probed")]
    placements = [str(trial_knobs(study, t)[0].get("placement") or "colocated")
                  for t in probed] if "search_space" in study.user_attrs else []
    return study_probes_text(world, bool(study.user_attrs.get("identity", {}).get("emulated")),
                             placements)


def _study_header(study: Study, trials: list[FrozenTrial]) -> list[str]:
    """What the study ran (its model, run, objective, probes) and its calibration."""
    identity = study.user_attrs.get("identity", {})
    probed = [t for t in trials if t.user_attrs.get("probed")]
    predicted = [t for t in trials if t.user_attrs.get("predicted")
                 and t.user_attrs.get("reused_from") is None]
    world = identity.get("nnodes", 1) * identity.get("gpus_per_node", 1)
    run = (f", run on {identity.get('nnodes', 1)}x{identity.get('gpus_per_node', 1)} GPUs "
           f"(a probe: {_probes_text(study, trials, world)})" if world > 1 else "")
    command = study.user_attrs.get("command")
    if command:  # probes were runs of the user's trainer
        run += (f", each probe a {command['steps']}-step run of your {command['trainer']} "
                f"launch line ({command['launch']})")
    lines = [f"study {study.study_name}: model {identity.get('model')}{run}, objective "
             f"{identity.get('objective')}, headroom {identity.get('headroom', 0):.0%}, "
             f"{len(probed)} probes in {len(trials)} trials, {len(predicted)} predicted OOM "
             "(not run)"]
    calibration = study.user_attrs.get("memory_calibration")
    if calibration:
        fits = ", ".join(f"{phase} {fit['transient_scale']:.2f} x transient + "
                         f"{format_bytes(fit['context_bytes'])}"
                         for phase, fit in calibration["phases"].items())
        lines.append(f"memory model calibrated on {calibration['probes']} probes: {fits}")
    return lines


def _trials_table(study: Study, trials: list[FrozenTrial], columns: list[str]) -> list[str]:
    """Every trial as a row, with how long a response each config fits, and the probes
    measured under contention counted."""
    reach = response_reach(study, trials)
    rows = [{**_trial_cells(t), "fits to": reach.get(t.number, "-")} for t in trials]
    busy = sum(bool((t.user_attrs.get("result") or {}).get("contention")) for t in trials)
    lines = ["", format_table(rows, [*columns, "fits to"]),
             "(step cv: the spread of a probe's timed steps, or 1 step: timed once, its "
             "error the study's measured spread; busy: measured while other "
             "processes took the machine. fits to: the longest response, in tokens, each "
             "config fits its budget by the study's memory model; >= when no length up "
             "to the model's context or a token budget runs out)"]
    if busy:
        lines.append(f"{busy} probe(s) ran under contention: their tokens/s measure the "
                     "other processes too (trials.csv, column contention)")
    return lines


def _best_lines(study: Study, trials: list[FrozenTrial], best: FrozenTrial) -> list[str]:
    """The best config: what it measured, where, its searched values, the pick, its length
    and host headroom, and how it compares with the start."""
    from autotune.sweep.pick.artifacts import best_document
    from autotune.sweep.pick.finalists import current_record
    from autotune.sweep.pick.finalists import describe as describe_finalists

    document = best_document(study, best)
    measured = document["measured"]
    lines = ["", f"best: trial {best.number}, {measured['tokens_per_s']:,.1f} tokens/s, peak "
                 f"{format_bytes(measured['peak_mem_bytes'])} of budget "
                 f"{format_bytes(measured['budget_bytes'])} (binds in "
                 f"{measured['binding_phase']}), on {document['provenance']['device']}"]
    pooled = document.get("pooled")
    if pooled and pooled["probes"] > pooled["own_probes"]:
        lines.append(f"  pooled over the {pooled['probes']} probes that ran its phases: "
                     f"{pooled['tokens_per_s']:,.1f} +- {pooled['tokens_per_s_se']:,.1f} "
                     "tokens/s")
    if "rollout_engine" in document["config"]:
        lines.append("  rollout: " + describe_engine(document["config"]["rollout_engine"],
                                                     document["provenance"].get("versions")))
    if document["confirmed"]:
        from autotune.sweep.pick.confirm import describe

        lines.append(f"  with {document['confirmed']['world_size']} real ranks: "
                     f"{describe(document['confirmed'])}")
    lines += [f"  {key}: {value}" for key, value in document["config"].items()
              if key in document["searched"]]
    record = current_record(study)
    lines += ["", *describe_finalists(record)] if record is not None \
        else [f"  pick: {document['pick']['rule']}"]
    if document.get("length_headroom"):
        lines.append(f"  length headroom: {document['length_headroom']['says']} (probed at "
                     f"{document['config'].get('max_response_length')} tokens)")
    if document.get("node_host"):
        lines.append(f"  {document['node_host']['says']}")
    identity = study.user_attrs.get("identity", {})
    return lines + _against_start(trials, best, identity, measured)


def _against_start(trials: list[FrozenTrial], best: FrozenTrial, identity: Mapping[str, object],
                   tuned: dict[str, Any]) -> list[str]:
    """How the best compares with the config the run started from (--base-config or the
    trainer's own), measured side by side in the same study."""
    start = next((t for t in trials if t.user_attrs.get("origin") == "base"), None)
    if start is None and identity.get("trainer"):
        start = next((t for t in trials if t.user_attrs.get("origin") == "safe"), None)
    if start is None or start.number == best.number:
        return [] if start is None else ["  (the starting config is the best one found)"]
    what = f"the starting config (trial {start.number}: {describe_params(start.params)})"
    result = start.user_attrs.get("result") or {}
    if start.user_attrs.get("status") == "slow":  # its rate is only a bound
        return [f"  {what}: {start.user_attrs.get('reason')}"]
    if not start.user_attrs.get("feasible") or not result.get("tokens_per_s"):
        return [f"  {what}: {start.user_attrs.get('status')}, "
                f"{start.user_attrs.get('reason') or 'does not fit'}"]
    return [f"  vs {what}: {tuned['tokens_per_s'] / result['tokens_per_s']:.2f}x the tokens/s "
            f"at {tuned['peak_mem_bytes'] / result['peak_mem_bytes']:.2f}x the peak memory"]


def format_outcome(outcome: SweepOutcome, settings: SweepSettings, report_line: str
                   ) -> tuple[str, str]:
    """What `run` prints when a sweep ends: the study in brief, the report and the files
    (standard output), and why nothing fits when nothing does (standard error)."""
    study = outcome.study
    assert study is not None  # a sweep that was not interrupted opened its study
    lines = [format_study(study, brief=True), "", report_line]
    best = outcome.best_path is not None
    exported = f", {outcome.export_path.name}" if outcome.export_path and best else ""
    files = f"trials.csv, logs/{', best.yaml' if best else ''}{exported}"
    if settings.storage is None:
        lines += ["", f"results in {settings.study_dir}/ ({files}, study.db)"]
    else:
        others = outcome.others_running
        still = f"; {others} probe(s) of other drivers still running in it" if others else ""
        lines += ["", f"study {settings.study_name} lives in {outcome.where}, shared by every "
                  f"driver on it{still}. {settings.study_dir}/ holds this driver's logs and "
                  f"{files}, rewritten from the study as it stood when this driver stopped; "
                  f"`autotune show --study {settings.study_name} --storage {outcome.where}` "
                  "reads it as it stands"]
    if best:
        why = ""
    elif outcome.nothing_fits:
        why = outcome.nothing_fits
    elif outcome.budget_stop:  # configs are left to try: more of the budget may find one
        stop = outcome.budget_stop
        why = (f"no feasible configuration yet (stopped: {stop.reason}) with configs left to "
               f"try: the command again resumes the sweep (with a larger {stop.budget})")
    else:
        why = ("no feasible configuration found: widen the space (offload, checkpointing, "
               "smaller micro-batches), lower --headroom or use more memory")
    return "\n".join(lines), why
