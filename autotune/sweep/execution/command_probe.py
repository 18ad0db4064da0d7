"""Probing the user's own trainer: each trial's TrainerCommand, built from the launch line.

`run --trainer T --launch "CMD ..."` makes every probe a short run of the user's trainer
(probe/launch/command.py runs and measures it). For each trial the candidate is written through the
export path (trainers/render.py: merged into the user's YAML, the trainer's rules checked
first), with the trainer's own short-run settings on top (a few steps, no checkpoint, the
console logger only, validation only when the space tunes it) and the space's trainer keys.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
from dataclasses import dataclass

from autotune.config import ProbeConfig, Topology
from autotune.errors import ConfigError
from autotune.probe.measure.result import TRIAL_DIR_TOKEN, TrainerCommand
from autotune.sweep.space.search_space import SearchSpace
from autotune.sweep.space.trainer_target import TrainerTarget
from autotune.trainers.adapter import Adapter, TrainerKeys
from autotune.trainers.export_plan import MISSING, dotted_get, plan_export
from autotune.trainers.render import load_trainer_yaml_text, override_words, render_plan

PLACEHOLDERS = ("{config}", "{config_dir}", "{config_name}", "{overrides}")


@dataclass(frozen=True)
class CommandTemplate:
    """What every trial's command shares: the trainer, the user's YAML, the launch line."""

    adapter: Adapter
    launch: str  # as the user typed it
    argv: tuple[str, ...]
    topology: Topology
    base_text: str | None  # the user's trainer YAML (None: the trainer's defaults)
    steps: int  # training steps of a probe: warm-up and timed
    validate: bool  # the space tunes validation: the short run validates
    cwd: str

    @property
    def identity(self) -> str:
        """What a resumed study must share: the trainer, the launch line, the base config."""
        digest = hashlib.sha256(f"{self.launch}\0{self.base_text or ''}".encode())
        return f"command:{self.adapter.name}:{digest.hexdigest()[:12]}"

    def command_for(self, config: ProbeConfig, trainer_values: TrainerKeys) -> TrainerCommand:
        """The trial's command: its config file's text, or the override words, or both."""
        base = load_trainer_yaml_text(self.base_text) if self.base_text is not None else None
        cycle = self.adapter.steps_per_rollout(config) if self.adapter.steps_per_rollout else 1
        short = self.adapter.short_run(self.steps * cycle, self.validate, TRIAL_DIR_TOKEN) \
            if self.adapter.short_run else {}
        extra = {**short, **trainer_values}
        provenance = [f"autotune probe: {self.adapter.name} for {self.steps} step(s), "
                      f"written per trial; not a config to train with", ""]
        plan = plan_export(self.adapter, config.as_dict(), self.topology,
                           base[0] if base is not None else None, extra=extra)
        if plan.problems:
            raise ConfigError(plan.problems)
        text = render_plan(plan, self.adapter, base, provenance)
        return TrainerCommand(
            trainer=self.adapter.name, argv=self.argv, config_text=text,
            config_name=f"{self.adapter.name}.yaml",
            overrides=tuple(override_words(self.adapter, plan.values)),
            steps=self.steps * cycle, steps_per_cycle=cycle, cwd=self.cwd)


def parse_launch(launch: str) -> tuple[str, ...]:
    """The launch line as words; it must say where the trial's config goes."""
    try:
        argv = tuple(shlex.split(launch))
    except ValueError as err:
        raise ConfigError(f"--launch {launch!r}: {err}; quote it as your shell would") from None
    if not argv:
        raise ConfigError("--launch: empty; give the command you launch your trainer with, "
                          "e.g. --launch 'python train.py --config {config}'")
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"--launch {launch!r}: {argv[0]!r} is not a command here (not on "
                          "PATH, or not an executable file); give the program as you would "
                          "type it in this directory")
    if not any(p in word for word in argv for p in PLACEHOLDERS):
        raise ConfigError(f"--launch {launch!r}: no placeholder for the trial's config; put "
                          "{config} where your trainer takes its YAML file (or {overrides} "
                          "for key=value overrides, {config_dir} and {config_name} for "
                          "Hydra's --config-path/--config-name)")
    return argv


def check_command_space(space: SearchSpace, adapter: Adapter) -> list[str]:
    """Knobs the trainer's config cannot hold, searched in a command sweep: one line each."""
    writable = set(adapter.keys) | set(adapter.derived_knobs)
    problems = [f"{space.source}: params.{name}: {adapter.name} has no key for it, so a run "
                f"of the trainer cannot apply it; drop it from the space or search the "
                f"trainer's own key (with memory_direction)"
                for name, spec in space.params.items()
                if not spec.is_trainer_key and name not in writable]
    return problems


def command_template(adapter: Adapter, launch: str, topology: Topology,
                     base_text: str | None, steps: int, validate: bool) -> CommandTemplate:
    return CommandTemplate(adapter=adapter, launch=launch, argv=parse_launch(launch),
                           topology=topology, base_text=base_text, steps=max(2, steps),
                           validate=validate, cwd=os.getcwd())


def command_setup(target: TrainerTarget, launch: str, space: SearchSpace,
                  steps: int) -> tuple[CommandTemplate, list[str]]:
    """The trials' command template for `run --launch`: the launch line, the user's YAML and
    the short run's steps (validation only when the space tunes it); and the lines to say (a
    trainer key of the space that the base config lacks is added, which may be a typo)."""
    problems = check_command_space(space, target.adapter)
    if problems:
        raise ConfigError(problems)
    notes = [f"{space.source}: {name} is not in the base config; it is added to each trial's "
             "config (check the spelling)" for name in space.trainer_keys
             if target.base is not None and "." in name
             and dotted_get(target.base[0], name, MISSING) is MISSING]
    validate = "val_batch_size" in space.params or \
        any("val" in name.rsplit(".", 1)[-1] for name in space.trainer_keys)
    template = command_template(target.adapter, launch, target.topology,
                                target.base[1] if target.base else None, steps, validate)
    return template, notes
