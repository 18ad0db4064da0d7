"""A study's best config as the trainer's YAML: the one export, for the best.<trainer>.yaml a
sweep keeps beside best.yaml and for `autotune export`.

The study's best (artifacts.py) is planned into the trainer's config (trainers/export_plan.py: its
rules for the topology, the conflicts with the user's base config, the settings the measured
shapes need) and rendered with its provenance on top (trainers/render.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.config import Topology
from autotune.errors import ConfigError
from autotune.files import write_text_atomic
from autotune.registry import REGISTRY, architecture_of
from autotune.sweep.pick.artifacts import best_document, best_trial, ranked_feasible, trial_knobs
from autotune.trainers.adapter import Adapter, TrainerValue
from autotune.trainers.export_plan import ExportPlan, dotted_get, plan_export
from autotune.trainers.measured import MeasuredRun
from autotune.trainers.render import (
    TrainerYaml,
    load_trainer_yaml,
    load_trainer_yaml_text,
    provenance_lines,
    render_plan,
    topology_for,
)

if TYPE_CHECKING:
    from optuna import Study


@dataclass(frozen=True)
class TrainerExport:
    """A study's best as one trainer's config: what was planned and the file's text."""

    adapter: Adapter
    topology: Topology
    plan: ExportPlan
    text: str
    chosen: str = ""  # why another trial than the study's best was exported, if one was
    study: str = ""  # the study's name


def measured_topology(study: Study) -> Topology:
    """The topology the study's probes measured."""
    request = study.user_attrs.get("request", {})
    return Topology(request.get("nnodes", 1), request.get("gpus_per_node", 1))


def measured_run(study: Study, adapter: Adapter, base: TrainerYaml | None) -> MeasuredRun:
    """What the study's probes ran besides the knobs, and the model the base config names
    compared with it (the registry's or a local checkpoint's shapes)."""
    identity = study.user_attrs["identity"]
    model, path = identity["model"], identity.get("model_path")
    spec = REGISTRY.get(model)
    # a local checkpoint by its absolute path (the sweep's --model-path may be relative to
    # where it ran), else the registry's Hugging Face id
    model_id = str(Path(path).expanduser().resolve()) if path else \
        (spec.hf_id if spec is not None and not spec.tiny else None)

    def named_and_same(key: str | None) -> tuple[TrainerValue, bool | None]:
        """The model the base config names at `key`, and whether it has the study's shapes."""
        named = dotted_get(base[0], key) if base and key else None
        if named is None:
            return None, None
        ours, theirs = architecture_of(path or model), architecture_of(str(named))
        return named, None if ours is None or theirs is None else ours == theirs

    named, same = named_and_same(adapter.model_key)
    critic, same_critic = named_and_same(adapter.critic_model_key)
    return MeasuredRun(measured_topology(study), model, model_id, named, same,
                       command=str(identity.get("probe", "")).startswith("command"),
                       base_critic_model=critic, same_critic_model=same_critic,
                       on_cpu=identity.get("device") == "cpu")


def export_best(study: Study, adapter: Adapter, base: TrainerYaml | None,
                topology: Topology | None = None, force: bool = False,
                strict: bool = False) -> TrainerExport:
    """The study's best config for `adapter`, merged into `base` (the user's trainer YAML),
    checked for `topology` (default: the base config's, else the study's). A knob the study
    held fixed at another value than the base config's, or another topology, model or engine
    than the study's, is refused unless `force`. Where the best breaks a rule of the trainer
    (TRL has no offload keys), the best trial the trainer can run is exported, and the
    header says so.

    Raises:
        ConfigError: no feasible config yet, a rule broken by every trial, or a conflict.
    """
    confirmed = study.user_attrs.get("confirmations") or {}
    trials = [t for t in ranked_feasible(study)
              if confirmed.get(str(t.number), {}).get("feasible", True)]
    if not trials:
        raise ConfigError(f"study {study.study_name}: no feasible config to export yet")
    if base is not None:  # a fresh tree: rendering may edit it
        base = load_trainer_yaml_text(base[1])
    if topology is None:
        topology = topology_for(adapter, base[0] if base else None, None, None,
                                measured_topology(study))
    run = measured_run(study, adapter, base)
    searched, refused = list(study.user_attrs["search_space"]["params"]), list[str]()
    for trial in trials:
        knobs, trainer_keys = trial_knobs(study, trial)
        plan = plan_export(adapter, knobs, topology, base[0] if base else None, searched,
                           force, trainer_keys or None, run, strict)
        if not plan.problems:
            break
        if any(not line.startswith(f"{adapter.name}: ") for line in plan.problems):
            raise ConfigError(plan.problems)  # a conflict: the same for every trial
        refused = refused or plan.problems
    else:
        raise ConfigError(refused)
    provenance = provenance_lines(best_document(study, trial), adapter, topology)
    chosen = ""
    if trial is not trials[0]:
        why = "; ".join(line.removeprefix(f"{adapter.name}: ") for line in refused)
        chosen = (f"the study's best, trial {trials[0].number}, cannot run on {adapter.name} "
                  f"({why}): this is the best trial it can run, trial {trial.number}")
        provenance.insert(-1, chosen)
    text = render_plan(plan, adapter, base, provenance)
    return TrainerExport(adapter, topology, plan, text, chosen, study.study_name)


def export_study(trainer: str, study: str | None = None, results_dir: str = "results",
                 storage: str | None = None, base_config: str | None = None,
                 nnodes: int | None = None, gpus_per_node: int | None = None,
                 force: bool = False, strict: bool = False) -> TrainerExport:
    """A study's best config as `trainer`'s YAML, as `autotune export` makes it, writing no
    file: the study `study` (default: the most recently changed) of `results_dir` or of a
    shared `storage`, merged into the user's `base_config` where given, checked against the
    trainer's rules for the topology (`nnodes` and `gpus_per_node`, else the base config's,
    else the study's). Another topology, model or engine than the study measured, or a knob
    it held fixed at another value than the base config's, is refused unless `force`.

    Raises:
        ConfigError: an unknown trainer or study, nothing feasible to export, or a refusal.
    """
    from autotune.sweep.study.storage import load_study
    from autotune.trainers import get_adapter

    adapter = get_adapter(trainer)
    loaded = load_study(results_dir, study, storage)
    base = load_trainer_yaml(base_config) if base_config else None
    topology = topology_for(adapter, base[0] if base else None, nnodes, gpus_per_node,
                            measured_topology(loaded))
    return export_best(loaded, adapter, base, topology, force, strict)


def write_trainer_export(study: Study, study_dir: Path, adapter: Adapter,
                         base: TrainerYaml | None, topology: Topology) -> Path | None:
    """Rewrite results/<study>/best.<trainer>.yaml from the study's best (a study artifact,
    like best.yaml: replaced atomically as the best changes). The study's fixed values are the
    base config's, or the run's own --set: taken as they are, and listed in the header."""
    if best_trial(study) is None:
        return None
    exported = export_best(study, adapter, base, topology, force=True)
    path = study_dir / f"best.{adapter.name}.yaml"
    write_text_atomic(path, exported.text)
    return path
