"""What a study leaves in results/<study>/ besides study.db: trials.csv and best.yaml.

Both are derived from the Optuna storage (the one record of the study). `write_artifacts`
writes them whole, atomically, from the storage. A running sweep keeps them with SweepFiles,
whose work per trial does not grow with the study: its first call writes both whole (on a
resumed study too: the storage is the truth, whatever an earlier driver left), then
trials.csv gets the rows of the trials finished since, appended (a finished trial never
changes), and best.yaml is rewritten only when what it says changed. A driver killed
mid-append leaves a cut last row at most; the next driver's first call rewrites the file. When
the sweep stops, `write_all` writes both whole again: every trial in trial order, those still
running (other drivers') included, so the files agree with study.db.
"""

from __future__ import annotations

import csv
import io
import itertools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune.config import KNOB_NAMES, PHASES, Knobs, ProbeConfig
from autotune.files import JsonObject, JsonValue, write_text_atomic
from autotune.probe.measure.result import coefficient_of_variation, probe_ranks_text
from autotune.sweep.pick.finalists import current_record
from autotune.sweep.pick.measurements import (
    Measured,
    by_config,
    fold,
    pooled_of,
    ranked,
    study_fixed,
    study_objective,
)
from autotune.sweep.space.params import params_key
from autotune.sweep.study.sharing import ran_params
from autotune.version import __version__

if TYPE_CHECKING:
    from optuna import Study
    from optuna.trial import FrozenTrial

FINISHED_STATES = ("complete", "fail", "pruned")  # trials.csv's state of a finished trial
FIGURE_COLUMNS = ["tokens_per_s", "samples_per_s", "step_s", "step_se_s", "peak_mem_bytes",
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
    ran = ran_params(frozen)  # as probed: the trainer's ties applied
    for name in param_names:
        row[name] = ran.get(name, "")
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
    row["probe_mode"] = result.get("probe_mode", "full") if result else ""
    row["timed_phases"] = " ".join(result.get("timed_phases") or [])  # a focused repeat's
    row["untimed_from"] = attrs.get("untimed_from", "")  # and the probe of its other phases
    row["step_cv"] = "" if cv is None else round(cv, 4)
    row["contention"] = result.get("contention") or ""
    row["binding_phase"] = attrs.get("binding_phase") or ""
    row["failed_phase"] = result.get("failed_phase") or ""
    row["reason"] = attrs.get("reason", "")
    row["log"] = attrs.get("log") or ""
    return row


def study_columns(study: Study) -> tuple[list[str], list[str], list[str]]:
    """trials.csv's columns, and the study's param and objective names among them."""
    attrs = study.user_attrs
    param_names = list(attrs.get("search_space", {}).get("params", {}))
    value_names = attrs.get("objective_names", ["value"])
    columns = ["number", "state", "status", "predicted", "feasible", "origin", "reused_from",
               "repeat_of", *param_names, *value_names, *FIGURE_COLUMNS, "timed_steps",
               "probe_mode", "timed_phases", "untimed_from", "step_cv", "contention",
               "binding_phase", "failed_phase", "reason", "log"]
    return columns, param_names, value_names


def study_rows(study: Study) -> tuple[list[str], list[dict[str, JsonValue]]]:
    """Columns and rows of every trial of a study, in trial order."""
    columns, param_names, value_names = study_columns(study)
    rows = [trial_row(t, param_names, value_names) for t in study.get_trials(deepcopy=False)]
    return columns, rows


def ranked_feasible(study: Study, configs: Mapping[str, Measured] | None = None
                    ) -> list[FrozenTrial]:
    """Each feasible config's first probed trial, the best mean objective over its probes
    first, the earliest on ties (measurements.py; `configs`: the study's by_config, when the
    caller holds it)."""
    return [measured.trial for measured in ranked(study, configs)]


def best_trial(study: Study, configs: Mapping[str, Measured] | None = None
               ) -> FrozenTrial | None:
    """The best feasible config's first trial: the finalists' pick while nothing was probed
    since it was made, else the best mean; a config whose real-rank confirmation did not fit
    is never the best."""
    confirmed = study.user_attrs.get("confirmations") or {}

    def fits(number: int) -> bool:
        return bool(confirmed.get(str(number), {}).get("feasible", True))

    configs = by_config(study) if configs is None else configs
    trials = ranked_feasible(study, configs)
    record = current_record(study, configs)
    if record is not None and fits(record["chosen"]):
        chosen = next((t for t in trials if t.number == record["chosen"]), None)
        if chosen is not None:
            return chosen
    return next((trial for trial in trials if fits(trial.number)), None)


def pareto_front(study: Study, configs: Mapping[str, Measured] | None = None
                 ) -> list[FrozenTrial]:
    """Feasible configs (each by its first probed trial) no other beats on both its mean
    tokens/s (up) and the most peak memory its probes held (down), least memory first.
    One pass over the configs by memory: a config is on the front when no config of less
    memory is as fast, and none of the same memory is faster."""
    points = sorted(((m.peak_mem_bytes, m.tokens_per_s_mean, m.number, m.trial)
                     for m in ranked(study, configs)
                     if m.tokens_per_s_mean and m.peak_mem_bytes),
                    key=lambda point: (point[0], -point[1], point[2]))
    front: list[FrozenTrial] = []
    fastest_below = -float("inf")  # the fastest config of less memory seen so far
    for _, group in itertools.groupby(points, key=lambda point: point[0]):
        same = list(group)  # one memory, the fastest first
        top = same[0][1]
        if top > fastest_below:
            front.extend(point[3] for point in same if point[1] == top)
        fastest_below = max(fastest_below, top)
    return front


def trial_knobs(study: Study, trial: FrozenTrial) -> tuple[Knobs, JsonObject]:
    """A trial's canonical knobs, and the trainer's own keys a command sweep searched or
    fixed (as the trainer spells them)."""
    space = study.user_attrs["search_space"]
    fixed = {**space["fixed"], **ran_params(trial)}  # as probed: the trainer's ties applied
    merged = {**study.user_attrs.get("request", {}).get("config", {}), **fixed}
    return ({name: merged[name] for name in KNOB_NAMES if name in merged},
            {name: value for name, value in fixed.items() if name not in KNOB_NAMES})


def best_document(study: Study, trial: FrozenTrial,
                  configs: Mapping[str, Measured] | None = None) -> dict[str, Any]:
    """best.yaml's content: the canonical knobs, what was measured, and where it came from
    (a YAML document: `show` and the trainers' exports read it as such; `configs`: the
    study's by_config, when the caller holds it)."""
    attrs = study.user_attrs
    configs = by_config(study) if configs is None else configs
    identity = attrs["identity"]
    knobs, trainer_keys = trial_knobs(study, trial)
    config = ProbeConfig.from_knobs(knobs)
    objective = identity["objective"]
    record = current_record(study, configs)
    return {
        "study": study.study_name,
        "trial": trial.number,
        "objective": objective,
        "objective_values": dict(zip(attrs.get("objective_names", []), trial.values, strict=True)),
        "config": knobs,
        **({"trainer_keys": trainer_keys} if trainer_keys else {}),
        "searched": list(attrs["search_space"]["params"]),
        "measured": measured_record(trial, configs[params_key(trial.params)],
                                    identity["headroom"]),
        "pooled": pooled.as_dict() if (pooled := pooled_of(configs, study_fixed(study)).get(
            params_key(trial.params))) is not None else None,
        "length_headroom": length_headroom_record(study, config, trial),
        "node_host": node_host_record(study, config),
        "confirmed": (attrs.get("confirmations") or {}).get(str(trial.number)),
        "pick": {key: record[key] for key in ("rule", "why", "noise_relative_sd", "entries")}
        if record is not None and record["chosen"] == trial.number else
        {"rule": f"the highest mean {objective} over each config's probes (no finalists "
                 "were probed again)"},
        "pareto_front": [t.number for t in pareto_front(study, configs)],
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
        "step_se_s": result.get("step_se_s"),
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
        "probe_mode": result.get("probe_mode", "full"),  # short: each loop's units sampled
        "search_space": space["source"],
        "search_space_hash": space["hash"],
        "versions": {"autotune": __version__, **(result.get("versions") or {})},
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def length_headroom_record(study: Study, config: ProbeConfig, trial: FrozenTrial
                           ) -> JsonObject | None:
    """How long responses may grow before the best config runs out of its budget: the
    study's calibrated memory model, anchored on this trial's measured peaks (study_model.py)."""
    from autotune.sweep.feasibility.study_model import study_model

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
    from autotune.memory.shape import model_shape
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.feasibility.prescreen import memory_model_args

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
    """Write trials.csv and best.yaml whole from the storage; returns best.yaml's path if any."""
    return SweepFiles(study_dir).write_all(study)


def csv_text(columns: list[str], rows: list[dict[str, JsonValue]], header: bool) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, columns, lineterminator="\n")
    if header:
        writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def best_text(study: Study, trial: FrozenTrial, configs: Mapping[str, Measured]) -> str:
    """best.yaml: a header for people, then the document."""
    document = best_document(study, trial, configs)
    measured = document["measured"]
    topology, command = document["provenance"]["topology"], document["provenance"].get("command")
    ranks = probe_ranks_text(topology["nnodes"] * topology["gpus_per_node"],
                             topology["ranks"] == "emulated",
                             split=document["config"].get("placement") == "separate")
    how = f" (runs of your {command['trainer']} launch line)" if command else \
        f" ({ranks})" if ranks else ""
    header = (f"# autotune best configuration of study {study.study_name}: trial "
              f"{trial.number}, {measured['tokens_per_s']:.1f} tokens/s at "
              f"{measured['peak_mem_bytes'] / 2**30:.2f} GiB peak{how}\n"
              f"{pooled_line(document['pooled'])}"
              f"# model {document['provenance']['model']} on {document['provenance']['device']}"
              f"; export it with `autotune export --study {study.study_name} --trainer ...`\n")
    return header + yaml.safe_dump(document, sort_keys=False)


def pooled_line(pooled: dict[str, Any] | None) -> str:
    """best.yaml's header line for the pooled figure, where other probes share its phases."""
    if pooled is None or pooled["probes"] <= pooled["own_probes"]:
        return ""
    return (f"# pooled over the {pooled['probes']} probes that ran its phases (sweep/pick/"
            f"pooled.py): {pooled['tokens_per_s']:.1f} +- {pooled['tokens_per_s_se']:.1f} "
            "tokens/s\n")


def unstamped(text: str) -> str:
    """best.yaml's text without the time it was written (what tells a change)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(
        "written:"))


class SweepFiles:
    """trials.csv and best.yaml of one study folder, kept by a sweep as it runs (the module's
    docstring says how): the trials already in trials.csv, and every finished probe folded
    once into its config's measurements (measurements.fold)."""

    def __init__(self, study_dir: Path) -> None:
        self.study_dir = study_dir
        self.columns: list[str] | None = None  # trials.csv's header, once written whole
        self.in_csv: set[int] = set()  # the numbers of the trials trials.csv holds
        self.folded: set[int] = set()  # finished trials folded into `configs`
        self.configs: dict[str, Measured] = {}
        self.best: str | None = None  # best.yaml as last written, without its time stamp
        self.best_changed = False  # whether the last call rewrote best.yaml

    @property
    def best_path(self) -> Path:
        return self.study_dir / "best.yaml"

    def after_trial(self, study: Study) -> Path | None:
        """After a probe: append the trials finished since the last call to trials.csv (the
        first call writes it whole), and rewrite best.yaml if what it says changed; returns
        best.yaml's path if any."""
        columns, param_names, value_names = study_columns(study)
        finished = self.fold_new(study)
        if columns != self.columns:
            self.write_csv(columns, [trial_row(t, param_names, value_names)
                                     for t in finished])
            self.in_csv = {t.number for t in finished}
        else:
            new = [t for t in finished if t.number not in self.in_csv]
            if new:
                with open(self.study_dir / "trials.csv", "a", encoding="utf-8") as handle:
                    handle.write(csv_text(columns, [trial_row(t, param_names, value_names)
                                                    for t in new], header=False))
                self.in_csv.update(t.number for t in new)
        return self.write_best(study)

    def write_all(self, study: Study) -> Path | None:
        """trials.csv and best.yaml whole from the storage: every trial, in trial order."""
        columns, rows = study_rows(study)
        self.fold_new(study)
        self.write_csv(columns, rows)
        self.in_csv = {int(str(row["number"])) for row in rows}
        if any(row["state"] not in FINISHED_STATES for row in rows):
            self.columns = None  # a row of a trial still running: the next call rewrites
        return self.write_best(study)

    def fold_new(self, study: Study) -> list[FrozenTrial]:
        """The study's finished trials (in trial order), folding those not folded yet."""
        objective: str | None = None
        finished = []
        for frozen in study.get_trials(deepcopy=False):
            if not frozen.state.is_finished():
                continue
            finished.append(frozen)
            if frozen.number not in self.folded:
                objective = objective or study_objective(study)
                fold(self.configs, frozen, objective)
                self.folded.add(frozen.number)
        return finished

    def write_csv(self, columns: list[str], rows: list[dict[str, JsonValue]]) -> None:
        self.study_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.study_dir / "trials.csv", csv_text(columns, rows, header=True))
        self.columns = columns

    def write_best(self, study: Study) -> Path | None:
        """Rewrite best.yaml when what it says changed; its path, or None while nothing fits."""
        self.best_changed = False
        trial = best_trial(study, self.configs)
        if trial is None:
            return None
        text = best_text(study, trial, self.configs)
        if unstamped(text) != self.best or not self.best_path.exists():
            write_text_atomic(self.best_path, text)
            self.best, self.best_changed = unstamped(text), True
        return self.best_path
