"""A study's best config as the trainer's YAML: the one export, for the best.<trainer>.yaml a
sweep keeps beside best.yaml and for `autotune export`.

The study's best (artifacts.py) is planned into the trainer's config (trainers/plan.py: its
rules for the topology, the conflicts with the user's base config, the settings the measured
shapes need) and rendered with its provenance on top (trainers/export.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.config import Topology
from autotune.errors import ConfigError
from autotune.files import write_text_atomic
from autotune.sweep.artifacts import best_document, best_trial
from autotune.trainers.adapter import Adapter
from autotune.trainers.export import (
    TrainerYaml,
    load_trainer_yaml_text,
    provenance_lines,
    render_plan,
    topology_for,
)
from autotune.trainers.plan import ExportPlan, plan_export


@dataclass(frozen=True)
class TrainerExport:
    """A study's best as one trainer's config: what was planned and the file's text."""

    adapter: Adapter
    topology: Topology
    plan: ExportPlan
    text: str


def measured_topology(study: Any) -> Topology:
    """The topology the study's probes measured."""
    request = study.user_attrs.get("request", {})
    return Topology(request.get("nnodes", 1), request.get("gpus_per_node", 1))


def export_best(study: Any, adapter: Adapter, base: TrainerYaml | None,
                topology: Topology | None = None, force: bool = False) -> TrainerExport:
    """The study's best config for `adapter`, merged into `base` (the user's trainer YAML),
    checked for `topology` (default: the base config's, else the study's). A knob the study
    held fixed at another value than the base config's is refused unless `force`.

    Raises:
        ConfigError: no feasible config yet, a rule of the trainer broken, or a conflict.
    """
    best = best_trial(study)
    if best is None:
        raise ConfigError(f"study {study.study_name}: no feasible config to export yet")
    document = best_document(study, best)
    if base is not None:  # a fresh tree: rendering may edit it
        base = load_trainer_yaml_text(base[1])
    if topology is None:
        topology = topology_for(adapter, base[0] if base else None, None, None,
                                measured_topology(study))
    plan = plan_export(adapter, document["config"], topology, base[0] if base else None,
                       document["searched"], force, document.get("trainer_keys"))
    if plan.problems:
        raise ConfigError(plan.problems)
    text = render_plan(plan, adapter, base, provenance_lines(document, adapter, topology))
    return TrainerExport(adapter, topology, plan, text)


def write_trainer_export(study: Any, study_dir: Path, adapter: Adapter,
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
