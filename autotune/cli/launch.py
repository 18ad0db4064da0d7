"""`run --trainer T --launch "CMD ..."`: a sweep whose probes are runs of the user's trainer.

What such a sweep needs beyond a built-in one: the trainer's own space by default, a name for
the run when --model names none, all the run's GPUs per probe, and the trials' command
template (sweep/command_probe.py). No torch import.
"""

from __future__ import annotations

from typing import Any

import click

from autotune.errors import ConfigError


def command_defaults(trainer: str | None, options: dict[str, Any], space: str | None) -> str:
    """--launch: the trainer's own space, and a name for the run when --model names none
    (the model is the one in the trainer's config; --model only labels the study and lets
    the pre-screen count its weights)."""
    if trainer is None:
        raise ConfigError("--launch needs --trainer easyr1, verl or trl: it decides where each "
                          "knob goes in the trainer's config and how its log is read")
    if options["model"] is None and options["model_path"] is None:
        options["model"] = f"{trainer}-run"
    return space or trainer


def command_ranks(ctx: click.Context, options: dict[str, Any], topology: Any,
                  gpus_per_trial: int) -> tuple[str | None, int, int]:
    """A probe of the trainer runs the trainer's own ranks: all the run's GPUs per probe, so
    they must all be on this machine."""
    from autotune.cli.options import local_ranks
    from autotune.hardware import has_nvidia_gpu

    given = tuple(options["gpus"].split(",")) if options["gpus"] else None
    here = local_ranks(options["device"], given)
    if topology.world_size > here:
        on_cpu = options["device"] == "cpu" or (options["device"] == "auto"
                                                 and not has_nvidia_gpu())
        where = "CPU cores" if on_cpu else "GPUs"
        raise ConfigError(
            f"--launch: the run spans {topology.nnodes}x{topology.gpus_per_node} GPUs and a "
            f"probe of your trainer runs all of them, but {here} {where} are here; run autotune "
            "on a machine that holds the whole run, or tune a one-node shape of it "
            "(--nnodes 1 --gpus-per-node N)")
    options["ranks"] = "real"
    if options["device"] != "cpu" and topology.world_size > 1 and \
            ctx.get_parameter_source("gpus_per_trial") == click.core.ParameterSource.DEFAULT:
        gpus_per_trial = topology.world_size
    return (f"each probe is a {options['warmup_steps'] + options['timed_steps']}-step run of "
            "your trainer's launch line on the run's own GPUs"), 0, gpus_per_trial


def command_setup(export_to: Any, launch: str, space: Any, options: dict[str, Any]) -> Any:
    """The trials' command template: launch line, the user's YAML, short-run steps."""
    from autotune.sweep.command_probe import check_command_space, command_template

    adapter, base, topology = export_to
    problems = check_command_space(space, adapter)
    if problems:
        raise ConfigError(problems)
    for name in space.trainer_keys:
        if base is not None and "." in name and not has_key(base[0], name):
            click.echo(f"{space.source}: {name} is not in the base config; it is added to "
                       "each trial's config (check the spelling)", err=True)
    validate = "val_batch_size" in space.params or \
        any("val" in name.rsplit(".", 1)[-1] for name in space.trainer_keys)
    return command_template(adapter, launch, topology, base[1] if base else None,
                            options["warmup_steps"] + options["timed_steps"], validate)


def has_key(tree: Any, dotted: str) -> bool:
    node = tree
    for part in dotted.split("."):
        if not hasattr(node, "get") or part not in node:
            return False
        node = node[part]
    return True
