"""`autotune export`: a study's best config as trainer YAML, checked against its rules."""

from __future__ import annotations

from pathlib import Path

import click

from autotune.cli import options as opt
from autotune.errors import ConfigError


@click.command("export")
@opt.study_options
@opt.trainer
@opt.base_config
@opt.out_path
@opt.nnodes
@opt.gpus_per_node
@click.option("--force", is_flag=True,
              help="Export even where the file would not be the measured run: take the "
                   "study's values for knobs it held fixed where your base config has others, "
                   "and write another topology, model or engine than the study's (listed "
                   "under UNMEASURED in the header). By default each is refused.")
@click.option("--strict", is_flag=True,
              help="Refuse a base config that sets a key autotune does not classify for the "
                   "trainer (a newer release's, a fork's). By default such keys are kept and "
                   "listed under NOT COMPARED in the header.")
def export(study: str | None, results_dir: str, storage: str | None, trainer: str | None,
           base_config: str | None, out_path: str | None, nnodes: int | None,
           gpus_per_node: int | None, force: bool, strict: bool) -> None:
    """Write a study's best config as trainer YAML, checked against the trainer's rules.

    With --base-config, the knobs the study searched replace yours; a knob it held fixed at
    another value than yours is refused (re-run the sweep with --base-config, or --force), as
    is another topology, model or rollout engine than the study measured.

    \b
    autotune export --trainer easyr1 --base-config examples/config.yaml --gpus-per-node 8
    autotune export --study qwen2.5-7b-grpo --trainer verl --out best.verl.yaml
    """
    from autotune.sweep.pick.best_export import export_study
    from autotune.trainers import ADAPTERS
    from autotune.trainers.render import launch_lines, write_new

    if trainer is None:
        raise ConfigError(f"export: give --trainer ({', '.join(ADAPTERS)}): the trainer whose "
                          "YAML to write")
    exported = export_study(trainer, study, results_dir, storage, base_config, nnodes,
                            gpus_per_node, force, strict)
    path = Path(out_path) if out_path else \
        Path(results_dir) / exported.study / f"best.{trainer}.yaml"
    write_new(path, exported.text)
    click.echo(f"wrote {path}")
    if exported.chosen:
        click.echo(exported.chosen)
    for note in exported.plan.notes:
        click.echo(f"set {note}")
    for line in launch_lines(exported.adapter, path, exported.plan.values,
                             exported.plan.trainers or exported.topology,
                             base_config is not None, exported.plan.launch):
        click.echo(line)
