"""`autotune export`: a study's best config as trainer YAML, checked against its rules."""

from __future__ import annotations

from pathlib import Path

import click

from autotune.cli.options import study_options
from autotune.config import Topology
from autotune.errors import ConfigError
from autotune.trainers import get_adapter
from autotune.trainers.export import (
    load_trainer_yaml,
    override_line,
    provenance_lines,
    render_plan,
    topology_for,
    write_new,
)
from autotune.trainers.plan import plan_export


@click.command("export")
@study_options
@click.option("--trainer", "trainer", required=True,
              type=click.Choice(["easyr1", "verl", "trl"]))
@click.option("--base-config", type=click.Path(dir_okay=False), default=None,
              help="Your trainer YAML: only the keys written change (the header lists them); "
                   "comments and order stay.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), default=None,
              help="Where to write (default: results/<study>/best.<trainer>.yaml).")
@click.option("--nnodes", type=click.IntRange(1), default=None,
              help="Nodes the run will use (default: the base config's, else the study's).")
@click.option("--gpus-per-node", type=click.IntRange(1), default=None,
              help="GPUs per node (default: the base config's, else the study's).")
@click.option("--force", is_flag=True,
              help="Take the study's values where your base config has others for knobs the "
                   "study held fixed (by default such conflicts are refused).")
def export(study: str | None, results_dir: str, storage: str | None, trainer: str,
           base_config: str | None, out_path: str | None, nnodes: int | None,
           gpus_per_node: int | None, force: bool) -> None:
    """Write a study's best config as trainer YAML, checked against the trainer's rules.

    With --base-config, the knobs the study searched replace yours; a knob it held fixed at
    another value than yours is refused (re-run the sweep with --base-config, or --force).

    \b
    autotune export --trainer easyr1 --base-config examples/config.yaml --gpus-per-node 8
    autotune export --study qwen2.5-7b-grpo --trainer verl --out best.verl.yaml
    """
    from autotune.sweep.artifacts import best_document, best_trial
    from autotune.sweep.storage import load_study

    loaded = load_study(results_dir, study, storage)
    best = best_trial(loaded)
    if best is None:
        raise ConfigError(f"study {loaded.study_name}: no feasible config to export yet")
    document = best_document(loaded, best)
    adapter = get_adapter(trainer)
    base = load_trainer_yaml(base_config) if base_config else None
    request = loaded.user_attrs.get("request", {})
    measured_on = Topology(request.get("nnodes", 1), request.get("gpus_per_node", 1))
    topology = topology_for(adapter, base[0] if base else None, nnodes, gpus_per_node,
                            measured_on)
    plan = plan_export(adapter, document["config"], topology, base[0] if base else None,
                       document["searched"], force, document.get("trainer_keys"))
    if plan.problems:
        raise ConfigError(plan.problems)
    text = render_plan(plan, adapter, base, provenance_lines(document, adapter, topology))
    path = Path(out_path) if out_path else \
        Path(results_dir) / loaded.study_name / f"best.{trainer}.yaml"
    write_new(path, text)
    click.echo(f"wrote {path}")
    for note in plan.notes:
        click.echo(f"set {note}")
    overrides = override_line(adapter, plan.values)
    click.echo("launch: " + adapter.launch.format(
        path=path, overrides=overrides, world=topology.world_size,
        folder=path.resolve().parent, name=path.name.removesuffix(".yaml")))
    if "{overrides}" not in adapter.launch:
        click.echo("or as overrides" + (" on your base config" if base else "") + ": "
                   + overrides)
