"""What a study leaves in results/<study>/ besides study.db: trials.csv and best.yaml.

Both are derived from the Optuna storage (the one record of the study) and rewritten whole,
atomically, after every trial, so a killed sweep never leaves a half-written file and the
files always agree with study.db.
"""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune import __version__
from autotune.config import KNOB_NAMES, PHASES, Knobs, ProbeConfig
from autotune.files import JsonObject, JsonValue, write_text_atomic
from autotune.probe.result import coefficient_of_variation
from autotune.sweep.finalists import current_record
from autotune.sweep.measurements import Measured, by_config, ranked
from autotune.sweep.sharing import params_key

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

FIGURE_COLUMNS = ["tokens_per_s", "samples_per_s", "step_s", "peak_mem_bytes",
                  *(f"peak_mem_{phase}_bytes" for phase in PHASES),
                  "host_peak_rss_bytes", "host_offload_bytes", "host_held_peak_bytes",
                  "budget_bytes", "probe_wall_s"]


def trial_row(frozen: FrozenTrial, param_names: list[str], value_names: list[str]
              ) -> dict[str, JsonValue]:
    """One trial as a flat row: identity, params, objective values, measured figures."""
    attrs = frozen.user_attrs
    result = attrs.get("result") or {}
    row: dict[str, JsonValue] = {
        "number": frozen.number, "state": frozen.state.name.lower(),
        "status": attrs.get("status", ""), "predicted": attrs.get("predicted", ""),
        "feasible": attrs.get("feasible", ""),
        "origin": attrs.get("origin", "sampler"), "reused_from": attrs.get("reused_from", ""),
        "repeat_of": attrs.get("repeat_of", "")}
    for name in param_names:
        row[name] = frozen.params.get(name, "")
    values = frozen.values or []
    for i, name in enumerate(value_names):
        row[name] = values[i] if i < len(values) else ""
    phases = result.get("phase_peak_mem_bytes") or {}
    for column in FIGURE_COLUMNS:
        if column.startswith("peak_mem_") and column != "peak_mem_bytes":
            value = phases.get(column[len("peak_mem_"):-len("_bytes")])
        elif column == "budget_bytes":
            value = attrs.get("budget_bytes")
        else:
            value = result.get(column)
        row[column] = "" if value is None else value
    cv = coefficient_of_variation(result.get("step_times_s") or [])
    row["timed_steps"] = len(result.get("step_times_s") or []) or ""
    row["step_cv"] = "" if cv is None else round(cv, 4)
    row["contention"] = result.get("contention") or ""
    row["binding_phase"] = attrs.get("binding_phase") or ""
    row["failed_phase"] = result.get("failed_phase") or ""
    row["reason"] = attrs.get("reason", "")
    row["log"] = attrs.get("log") or ""
    return row


def study_rows(study: Study) -> tuple[list[str], list[dict[str, JsonValue]]]:
    """Columns and rows of every trial of a study, in trial order."""
    space = study.user_attrs.get("search_space", {})
    param_names = list(space.get("params", {}))
    value_names = study.user_attrs.get("objective_names", ["value"])
    rows = [trial_row(t, param_names, value_names) for t in study.get_trials(deepcopy=False)]
    columns = ["number", "state", "status", "predicted", "feasible", "origin", "reused_from",
               "repeat_of", *param_names, *value_names, *FIGURE_COLUMNS, "timed_steps",
               "step_cv", "contention", "binding_phase", "failed_phase", "reason", "log"]
    return columns, rows


def ranked_feasible(study: Study) -> list[FrozenTrial]:
    """Each feasible config's first probed trial, the best mean objective over its probes
    first, the earliest on ties (measurements.py)."""
    return [measured.trial for measured in ranked(study)]


def best_trial(study: Study) -> FrozenTrial | None:
    """The best feasible config's first trial: the finalists' pick while nothing was probed
    since it was made, else the best mean; a config whose real-rank confirmation did not fit
    is never the best."""
    confirmed = study.user_attrs.get("confirmations") or {}

    def fits(number: int) -> bool:
        return bool(confirmed.get(str(number), {}).get("feasible", True))

    trials = ranked_feasible(study)
    record = current_record(study)
    if record is not None and fits(record["chosen"]):
        chosen = next((t for t in trials if t.number == record["chosen"]), None)
        if chosen is not None:
            return chosen
    return next((trial for trial in trials if fits(trial.number)), None)


def pareto_front(study: Study) -> list[FrozenTrial]:
    """Feasible configs (each by its first probed trial) no other beats on both its mean
    tokens/s (up) and the most peak memory its probes held (down), least memory first."""
    points = [(m.trial, m.tokens_per_s_mean, m.peak_mem_bytes) for m in ranked(study)
              if m.tokens_per_s_mean and m.peak_mem_bytes]
    front = [(t, mem) for t, tps, mem in points
             if not any((o_tps >= tps and o_mem <= mem) and (o_tps > tps or o_mem < mem)
                        for _, o_tps, o_mem in points)]
    return [t for t, _ in sorted(front, key=lambda item: (item[1], item[0].number))]


def trial_knobs(study: Study, trial: FrozenTrial) -> tuple[Knobs, JsonObject]:
    """A trial's canonical knobs, and the trainer's own keys a command sweep searched or
    fixed (as the trainer spells them)."""
    space = study.user_attrs["search_space"]
    fixed = {**space["fixed"], **trial.params}
    merged = {**study.user_attrs.get("request", {}).get("config", {}), **fixed}
    return ({name: merged[name] for name in KNOB_NAMES if name in merged},
            {name: value for name, value in fixed.items() if name not in KNOB_NAMES})


def best_document(study: Study, trial: FrozenTrial) -> dict[str, Any]:
    """best.yaml's content: the canonical knobs, what was measured, and where it came from
    (a YAML document: `show` and the trainers' exports read it as such)."""
    attrs = study.user_attrs
    identity = attrs["identity"]
    knobs, trainer_keys = trial_knobs(study, trial)
    config = ProbeConfig.from_knobs(knobs)
    objective = identity["objective"]
    record = current_record(study)
    return {
        "study": study.study_name,
        "trial": trial.number,
        "objective": objective,
        "objective_values": dict(zip(attrs.get("objective_names", []), trial.values, strict=True)),
        "config": knobs,
        **({"trainer_keys": trainer_keys} if trainer_keys else {}),
        "searched": list(attrs["search_space"]["params"]),
        "measured": measured_record(trial, by_config(study)[params_key(trial.params)],
                                    identity["headroom"]),
        "length_headroom": length_headroom_record(study, config, trial),
        "node_host": node_host_record(study, config),
        "confirmed": (attrs.get("confirmations") or {}).get(str(trial.number)),
        "pick": {key: record[key] for key in ("rule", "why", "noise_relative_sd", "entries")}
        if record is not None and record["chosen"] == trial.number else
        {"rule": f"the highest mean {objective} over each config's probes (no finalists "
                 "were probed again)"},
        "pareto_front": [t.number for t in pareto_front(study)],
        "provenance": provenance_record(study, trial),
    }


def measured_record(trial: FrozenTrial, repeats: Measured, headroom: float) -> JsonObject:
    """What best.yaml says was measured of the trial's config: the mean over its probes, the
    most memory any held, and its first probe's own figures."""
    result = trial.user_attrs["result"]
    return {
        "tokens_per_s": repeats.tokens_per_s_mean,
        "samples_per_s": result["samples_per_s"],
        "step_s": result["step_s"],
        "peak_mem_bytes": repeats.peak_mem_bytes,
        "phase_peak_mem_bytes": dict(repeats.phase_peak_mem_bytes()),
        "probes": repeats.probes,
        "tokens_per_s_probes": list(repeats.tokens_per_s),
        "step_cv": coefficient_of_variation(result.get("step_times_s") or []),
        "contended_probes": repeats.contended,
        "host_peak_rss_bytes": result["host_peak_rss_bytes"],
        "host_offload_bytes": result["host_offload_bytes"],
        "capacity_bytes": result["device_limit_bytes"] or result["device_capacity_bytes"],
        "budget_bytes": trial.user_attrs.get("budget_bytes"),
        "headroom": headroom,
        "binding_phase": trial.user_attrs.get("binding_phase"),
        "probe_wall_s": result["probe_wall_s"],
    }


def provenance_record(study: Study, trial: FrozenTrial) -> JsonObject:
    """Where best.yaml's config came from: the probe, model, topology, device, space and the
    versions it was measured with."""
    attrs = study.user_attrs
    identity, space = attrs["identity"], attrs["search_space"]
    request = attrs.get("request", {})
    result = trial.user_attrs["result"]
    return {
        "probe": identity.get("probe", "builtin"),
        **({"command": attrs["command"]} if attrs.get("command") else {}),
        "model": identity["model"],
        "model_path": identity["model_path"],
        "topology": {"nnodes": request.get("nnodes", 1),
                     "gpus_per_node": request.get("gpus_per_node", 1),
                     "share": result.get("share") or {},
                     "ranks": "emulated" if result.get("emulated") else "real"},
        "device": result.get("device_name"),
        "device_capacity_bytes": result.get("device_capacity_bytes"),
        "device_limit_bytes": result.get("device_limit_bytes"),
        "dtype": request.get("dtype"),
        "warmup_steps": request.get("warmup_steps"),
        "timed_steps": request.get("timed_steps"),
        "search_space": space["source"],
        "search_space_hash": space["hash"],
        "versions": {"autotune": __version__, **(result.get("versions") or {})},
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def length_headroom_record(study: Study, config: ProbeConfig, trial: FrozenTrial
                           ) -> JsonObject | None:
    """How long responses may grow before the best config runs out of its budget: the
    study's calibrated memory model, anchored on this trial's measured peaks (study_model.py)."""
    from autotune.sweep.study_model import study_model

    model, budget = study_model(study), trial.user_attrs.get("budget_bytes")
    if model is None or not budget:
        return None
    measured = (trial.user_attrs.get("result") or {}).get("phase_peak_mem_bytes")
    headroom = model.headroom(config, budget, measured)
    return {**headroom.as_dict(), "says": headroom.describe("within the budget"),
            "by": f"{model.source}, anchored on this trial's measured peaks"}


def node_host_record(study: Study, config: ProbeConfig) -> JsonObject | None:
    """The node's host memory for the best config (memory/host.py), on the node the latest
    run was for (--host-memory, else its machine's RAM); None when the study has no node or
    its model cannot be read."""
    import json

    from autotune.errors import AutotuneError
    from autotune.memory.host import NodeRun, node_host
    from autotune.memory.model import model_shape
    from autotune.probe.result import ProbeRequest
    from autotune.sweep.prescreen import memory_model_args

    node = study.user_attrs.get("node") or {}
    if not node.get("host_bytes"):
        return None
    try:
        request = ProbeRequest.from_json(json.dumps(study.user_attrs.get("request") or {}))
        shape = model_shape(request.model, request.model_path)
        host = node_host(shape, config, NodeRun(
            request.gpus_per_node, request.world_size, request.device.on_gpu,
            memory_model_args(request)["compute_bytes"], node.get("trainer")),
            int(node["host_bytes"]))
    except (TypeError, KeyError, ValueError, AutotuneError):
        return None
    node_is = "--host-memory" if node.get("given") else "this machine's RAM, as --host-memory"
    return {"peak_bytes": host.peak_bytes, "binding_phase": host.binding_phase,
            "kill_bytes": host.kill_bytes, "host_oom": host.host_oom,
            "says": f"{host.verdict()}; the node: {node_is}",
            "by": "memory/host.py: every rank on the node, the trainer's own terms"
                  + ("; rank processes a prior" if request.device.on_gpu else "")}


def write_artifacts(study: Study, study_dir: Path) -> Path | None:
    """Rewrite trials.csv and best.yaml from the storage; returns best.yaml's path if any."""
    columns, rows = study_rows(study)
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomic(study_dir / "trials.csv", buffer.getvalue())
    trial = best_trial(study)
    if trial is None:
        return None
    document = best_document(study, trial)
    measured = document["measured"]
    emulated = document["provenance"]["topology"]["ranks"] == "emulated"
    command = document["provenance"].get("command")
    how = " (one emulated rank: time without communication)" if emulated else \
        f" (runs of your {command['trainer']} launch line)" if command else ""
    header = (f"# autotune best configuration of study {study.study_name}: trial "
              f"{trial.number}, {measured['tokens_per_s']:.1f} tokens/s at "
              f"{measured['peak_mem_bytes'] / 2**30:.2f} GiB peak{how}\n"
              f"# model {document['provenance']['model']} on {document['provenance']['device']}"
              f"; export it with `autotune export --study {study.study_name} --trainer ...`\n")
    path = study_dir / "best.yaml"
    write_text_atomic(path, header + yaml.safe_dump(document, sort_keys=False))
    return path
