"""The Adapter: how one trainer's config holds the canonical knobs, and its own rules.

One mapping table per trainer (the keys as each trainer's own config spells them), with the
companions the trainer needs, and the divisibility and range rules it enforces at start-up,
checked for a given number of nodes and GPUs per node so that a config the trainer would
reject is never written. Pure data and arithmetic: no YAML library here.

Batch counting: EasyR1 counts `rollout_batch_size` and `global_batch_size` in prompts and
multiplies the latter by rollout.n in the worker; verl counts `train_batch_size` and
`ppo_mini_batch_size` the same way; micro-batches are responses per GPU in both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from autotune.config import (
    KNOB_NAMES,
    LORA_KNOBS,
    Knobs,
    ProbeConfig,
    Topology,
    parse_knob_value,
    unknown_key_message,
)
from autotune.config.parsing import ALL_LINEAR, parse_module_names
from autotune.errors import ConfigError
from autotune.trainers.key_classes import KeyClasses

# a value of the trainer's own YAML (a scalar, a list, a mapping), and a whole tree of them as
# loaded (ruamel's round-trip mapping, or a plain dict): foreign, as the user wrote it
TrainerValue: TypeAlias = Any
TrainerTree: TypeAlias = TrainerValue
# dotted keys of a trainer's config and their values: what an export writes (never knobs)
TrainerKeys: TypeAlias = dict[str, TrainerValue]
Getter = Callable[[str, TrainerValue], TrainerValue]  # a dotted key of the trainer's config,
# and its default


@dataclass(frozen=True)
class Setting:
    """A trainer setting the measured shapes need: with another value the trainer would not
    run what the probe measured (dynamic batching makes the micro-batch a token budget; a
    critic adds a model the probe never held). `ok` says whether a value in the user's config
    already gives the measured shapes; a missing or null key is the trainer's default."""

    key: str
    value: TrainerValue  # what the export writes
    why: str  # said in the exported file's header and on the terminal
    ok: Callable[[TrainerValue], bool]
    default_ok: bool  # the trainer's default gives the measured shapes: nothing to write
    refuse: bool = False  # another value in the user's config is a conflict (--force takes
    # `value`), not a setting to flip with a note
    refuse_if: Callable[[TrainerValue], bool] | None = None  # which other values are (the
    # rest are flipped with a note)
    applies: Callable[[ProbeConfig], bool] | None = None  # the configs whose run reads it
    # (None: every config); where the trainer's default is unlike the probe only for some
    # (TRL's LoRA dropout, EasyR1's critic padding), a study's export writes it for those

    def reads(self, config: ProbeConfig | None) -> bool:
        """Whether `config`'s run reads this setting (None: not known yet, as before a sweep:
        every setting is checked)."""
        return config is None or self.applies is None or self.applies(config)

    def refuses(self, have: TrainerValue) -> bool:
        """Whether `have` (not ok) in the user's config is a conflict, not a flip."""
        return self.refuse or (self.refuse_if is not None and self.refuse_if(have))


@dataclass(frozen=True)
class Derived:
    """Knobs a trainer holds in several keys at once, or in keys of its own arithmetic (TRL's
    per-process batches, whether a reference model is built): `write` gives every key for the
    knobs' values, `read` the knobs back from a config. Where a base config already reads back
    as the knobs' values, nothing is written (the user's own spelling is kept)."""

    knobs: tuple[str, ...]
    write: Callable[[ProbeConfig, Topology], TrainerKeys]
    read: Callable[[Getter, Topology], Knobs]
    keys: tuple[str, ...]  # the config keys `read` reads: a base config that sets one states
    # the knobs (compared with a study's held-fixed values)


@dataclass(frozen=True)
class SeparateLaunch:
    """How a trainer runs placement=separate for one config: the header's lines on starting
    each side, the rules it breaks (refused), the keys that place the engine on its GPUs
    (written beside the tuned keys) and, where the trainer starts otherwise than its colocated
    run, the launch line ({folder}, {name}, {path}, {overrides}, {world} as Adapter.launch)."""

    lines: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    values: TrainerKeys = field(default_factory=dict)
    launch: str = ""


@dataclass(frozen=True)
class Adapter:
    """A trainer: where each knob goes (first key is where it is read back from), the
    companions written with the tuned keys, and the rules checked before writing."""

    name: str
    keys: dict[str, tuple[str, ...]]
    topology_keys: tuple[str, str] | None  # (nnodes, gpus per node) where the config has them
    companions: TrainerKeys
    rules: Callable[[ProbeConfig, Topology, Getter], list[str]]
    launch: str  # the launch line: {path} the exported file, {overrides}, {world}
    # knobs written through several keys, or keys computed with the topology (TRL's batches)
    derived: tuple[Derived, ...] = ()
    # the knobs the trainer's own default or example config sets: the sweep's starting point
    defaults: Knobs | None = None
    # one GPU's share of the batches as the trainer's own code normalises them
    # (responses_per_step, responses_per_minibatch): TRL's from its per-process batches, must
    # agree with config.device_share; EasyR1 and verl chunk equally (even_share: the config's)
    share: Callable[[ProbeConfig, Topology], dict[str, int]] | None = None
    # a probe of the trainer's own run (`run --launch`): the keys that make it a short run of
    # `steps` logged steps (validating or not), and how many logged steps one rollout makes
    short_run: Callable[[int, bool, str], TrainerKeys] | None = None  # (steps, validate,
    # the trial's directory, where its output goes)
    steps_per_rollout: Callable[[ProbeConfig], int] | None = None
    settings: tuple[Setting, ...] = ()
    # the tree an export without a base config starts from, and how that file is used
    skeleton: TrainerKeys | None = None
    skeleton_note: str = ""
    model_key: str | None = None  # where the config names the model it trains
    writes_model: bool = True  # a file without a base names the model (TRL: the script
    # loads it, and a script may parse GRPOConfig alone)
    # what the trainer runs as measured but its config cannot say (no key): header lines, for
    # the study's config, topology and the knobs it recorded (one it did not is not said)
    unheld: Callable[[ProbeConfig, Topology, Collection[str]], list[str]] | None = None
    engines: tuple[str, ...] = ("vllm-like", "vllm")  # the probe engines for its rollout
    # PPO: where the critic's knobs go (and the actor's knobs it shares: its mini-batch,
    # dynamic batching), written only for a config that trains a critic; None: the trainer's
    # PPO is not supported
    critic_keys: dict[str, tuple[str, ...]] | None = None
    critic_model_key: str | None = None  # where the config names the critic's model
    # knobs the trainer sets from others, with no key of their own (TRL scores log-probs at
    # its train micro-batch): applied to every trial's config before it is probed
    ties: Callable[[ProbeConfig], Knobs] | None = None
    # keys of the table the trainer checks but does not run for `config` (verl's per-GPU
    # micro-batches under token budgets, still asserted where set): written as null
    unused: Callable[[ProbeConfig], tuple[str, ...]] | None = None
    # every other key of the trainer's schema, classified (key_classes.py)
    key_classes: KeyClasses = KeyClasses()
    # why the trainer cannot run the engine on GPUs of its own (placement=separate), where
    # it cannot at all; "": it can (its keys are issue 68's next step)
    no_separate_placement: str = ""
    # placement=separate: how to start the engine on its GPUs and the trainer on the rest,
    # and what it cannot start (config, the run's topology, the trainer's, the model's name
    # or None); None: autotune does not write the trainer's separate placement (yet)
    separate_launch: Callable[[ProbeConfig, Topology, Topology, str | None],
                              SeparateLaunch] | None = None

    @functools.cached_property
    def knob_keys(self) -> frozenset[str]:
        """Every key the tables above write or read: the knobs', the critic's, the derived
        parts', the companions, the settings, the topology and the models'."""
        keys = {key for table in (self.keys, self.critic_keys or {}) for knob_keys in
                table.values() for key in knob_keys}
        keys.update(key for part in self.derived for key in part.keys)
        keys.update(self.companions)
        keys.update(setting.key for setting in self.settings)
        keys.update(self.topology_keys or ())
        keys.update(key for key in (self.model_key, self.critic_model_key) if key)
        return frozenset(keys)

    def unused_keys(self, config: ProbeConfig) -> tuple[str, ...]:
        return self.unused(config) if self.unused else ()

    def keys_for(self, config: ProbeConfig) -> dict[str, tuple[str, ...]]:
        """Where each knob of `config` goes: the critic's keys too when it trains one."""
        if not config.has_critic or not self.critic_keys:
            return self.keys
        merged = dict(self.keys)
        for knob, keys in self.critic_keys.items():
            merged[knob] = (*merged.get(knob, ()), *keys)
        return merged

    @property
    def derived_knobs(self) -> tuple[str, ...]:
        return tuple(knob for part in self.derived for knob in part.knobs)

    def derived_values(self, knobs: Knobs, topology: Topology,
                       get: Getter | None = None) -> TrainerKeys:
        """The keys of every derived part whose knobs are all given; with `get` (the user's
        config), none of a part that already reads back as the knobs' values."""
        config = ProbeConfig.from_knobs(knobs)
        values: TrainerKeys = {}
        for part in self.derived:
            if any(knobs.get(knob) is None for knob in part.knobs):
                continue
            if get is not None and part.read(get, topology) == {
                    knob: knobs[knob] for knob in part.knobs}:
                continue
            values.update(part.write(config, topology))
        return values

    def tuned_values(self, knobs: Knobs, topology: Topology,
                     get: Getter | None = None) -> TrainerKeys:
        """Every dotted key an export of `knobs` writes, with its value (`get`: the user's
        config). `knobs` may be some of a config's (a study's, as it recorded them): a knob
        not given, or none, is not written."""
        values: TrainerKeys = {}
        config = ProbeConfig.from_knobs(knobs)
        for knob, keys in self.keys_for(config).items():
            if knobs.get(knob) is None:
                continue
            for key in keys:
                values[key] = knobs[knob]
        values.update({key: None for key in self.unused_keys(config) if key in values})
        written = None
        if get is not None:  # the user's config as it will be, the tuned keys written
            base = get

            def written(key: str, default: TrainerValue) -> TrainerValue:
                return values[key] if key in values else base(key, default)
        return {**values, **self.derived_values(knobs, topology, written), **self.companions}

    def read_knobs(self, get: Getter, topology: Topology) -> Knobs:
        """The canonical knobs a trainer config holds (for the round trip)."""
        knobs = {knob: get(keys[0], None) for knob, keys in self.keys.items()
                 if get(keys[0], None) is not None}
        for part in self.derived:
            knobs.update(part.read(get, topology))
        if ProbeConfig.from_knobs(knobs).has_critic:  # the critic's own knobs, where it has them
            knobs.update({knob: get(keys[0], None) for knob, keys in
                          (self.critic_keys or {}).items()
                          if knob not in knobs and get(keys[0], None) is not None})
        if not knobs.get("lora_rank"):  # LoRA's other knobs mean nothing without a rank
            knobs = {k: v for k, v in knobs.items() if k not in LORA_KNOBS}
        return knobs

    def check(self, config: ProbeConfig, topology: Topology,
              get: Getter = lambda key, default: default,
              recorded: Collection[str] | None = None) -> list[str]:
        """Every rule of this trainer `config` breaks, one line each naming rule and values.
        The rules read the trainer's keys as the file will hold them: a knob's key with the
        config's value where an export writes it (the knob is not None, and of `recorded`, the
        knobs a study recorded: None, every knob), any other from the user's config (`get`).
        A setting read from the user's config must be a plain value of the trainer default's
        type (an interpolation such as ${oc.select:...} cannot be checked)."""
        written = {key: getattr(config, knob) for knob, keys in self.keys_for(config).items()
                   for key in keys if (recorded is None or knob in recorded)
                   and getattr(config, knob) is not None}
        written.update({key: None for key in self.unused_keys(config) if key in written})

        def plain(key: str, default: TrainerValue) -> TrainerValue:
            if key in written:
                return written[key]
            value = get(key, default)
            if isinstance(default, bool | int) and type(value) is not type(default):
                raise ConfigError(f"{key}={value!r} in the base config: autotune checks "
                                  f"{self.name}'s rules with it and needs a plain "
                                  f"{type(default).__name__}; write the value out")
            return value

        lines = []
        if config.has_critic and not self.critic_keys:
            lines.append("PPO (a critic) is not supported: autotune writes this trainer's GRPO "
                         "config only; sweep with --algorithm grpo, or export for verl or easyr1")
        return [f"{self.name}: {line}" for line in [*lines, *self.rules(config, topology, plain)]]

    def knobs_of_keys(self, given: TrainerKeys, topology: Topology,
                      topology_given: bool = True) -> Knobs:
        """The knobs this trainer's own keys set (`--set num_generations=8`): keys of its
        table, spelled in full or by their last part where that names one knob. Keys it reads
        through several knobs together (TRL's batches, its engine) are read as a group: every
        key of the group must be given, and the topology too where the group reads it.

        Raises:
            ConfigError: a key the trainer's table does not have, or a group given in part.
        """
        owners: dict[str, str | Derived] = {k: knob for knob, keys in self.keys.items()
                                             for k in keys}
        owners.update({k: part for part in self.derived for k in part.keys})
        critic = {k: knob for knob, keys in (self.critic_keys or {}).items() for k in keys}
        knobs: Knobs = {}
        groups: dict[int, tuple[Derived, TrainerKeys]] = {}
        by_key: TrainerKeys = {}  # every given key by its full name: what a group reads
        problems = []
        spelled: dict[str, str] = {}  # each table key found: the spelling that gave it
        for key, value in given.items():
            found = owning_keys(key, owners, critic)
            if not found:
                named = ambiguous_keys(key, owners, critic)
                problems.append(
                    f"{key}: ambiguous, names {', '.join(named)}; spell it in full" if named
                    else f"{unknown_key_message(key, KNOB_NAMES, 'knob')}; nor a key of "
                    f"{self.name}'s table (docs/trainers-and-export.md), spelled in full or "
                    "by its last part")
                continue
            twice = [f"{spelled[k]}={by_key[k]}" for k in found
                     if k in spelled and by_key[k] != value]
            if twice:
                problems.append(f"{key}={value} and {twice[0]} name one key ({found[0]}); "
                                "give it once")
                continue
            spelled.update({k: key for k in found})
            owner = owners[found[0]]
            by_key.update({k: value for k in found})
            if isinstance(owner, str):
                knobs[owner] = value
            else:
                groups.setdefault(id(owner), (owner, {}))[1].update(
                    {k: value for k in found})
        for part, values in groups.values():
            read = self.read_group(part, values, by_key, topology, topology_given)
            if isinstance(read, str):
                problems.append(read)
            else:
                knobs.update(read)
        if problems:
            raise ConfigError(problems)
        return knobs

    def read_group(self, part: Derived, values: TrainerKeys, by_key: TrainerKeys,
                   topology: Topology, topology_given: bool) -> Knobs | str:
        """The knobs the keys `values` of `part` set (`by_key`: every key given), or the line
        saying why they cannot be read: a key of the group missing, values autotune cannot
        probe, or a read that needs the topology where it was not given."""
        named = ", ".join(values)
        missing = [k for k in part.keys if k not in values]
        if missing:
            return (f"{named}: {self.name} reads it with {', '.join(missing)}; give those "
                    f"too, or set the knobs ({', '.join(part.knobs)})")

        def get(key: str, default: TrainerValue) -> TrainerValue:
            return by_key.get(key, default)
        try:
            read = part.read(get, topology)
            for knob, value in read.items():
                parse_knob_value(knob, value)
        except (ConfigError, TypeError, ValueError, ZeroDivisionError):
            return (f"{named}: {self.name} reads them as knobs autotune cannot probe "
                    f"({', '.join(part.knobs)}); check the values, or set the knobs")
        if not topology_given and read != part.read(get, Topology(topology.nnodes, 2)):
            return f"{named}: {self.name} reads it per process; give --nnodes and " \
                "--gpus-per-node too"
        return read


def owning_keys(key: str, owners: dict[str, str | Derived], critic: dict[str, str]
                ) -> list[str]:
    """The table's keys `key` names, in full or by its last part, all of one owner (none:
    unknown, or naming several). The actor's keys by their last part before the critic's
    (which share them: ppo_micro_batch_size_per_gpu is the actor's, critic.ppo_... the
    critic's); a critic's key found joins `owners`."""
    found = [k for k in (*owners, *critic) if k == key] or \
        [k for k in owners if k.rsplit(".", 1)[-1] == key] or \
        [k for k in critic if k.rsplit(".", 1)[-1] == key]
    owners.update({k: critic[k] for k in found if k in critic and k not in owners})
    return found if found and len({id(owners[k]) for k in found}) == 1 else []


def ambiguous_keys(key: str, owners: dict[str, str | Derived], critic: dict[str, str]
                   ) -> list[str]:
    """The table's keys whose last part is `key`, where they belong to several owners (then
    `key` alone names none of them); [] otherwise."""
    named = [k for k in owners if k.rsplit(".", 1)[-1] == key] or \
        [k for k in critic if k.rsplit(".", 1)[-1] == key]  # as owning_keys looks
    return named if len(named) > 1 else []


def module_list(modules: str) -> TrainerValue:
    """lora_target_modules as the trainers take it: `all-linear` as the string, module names
    as a list."""
    return modules if modules == ALL_LINEAR else modules.split(",")


def module_names(value: TrainerValue) -> Knobs:
    """A trainer's target modules (a string or a list) as the knob's comma-separated value
    (no knob where the config has none: the trainer's default applies)."""
    if value is None:
        return {}
    return {"lora_target_modules": parse_module_names("lora_target_modules", value)}


def even_share(config: ProbeConfig, topology: Topology) -> dict[str, int]:
    """A GPU's responses per step and per optimizer step where the trainer chunks each batch
    equally over the world (EasyR1, verl): config.device_share's."""
    share = config.share(topology.world_size)
    return {"responses_per_step": share.responses_per_step,
            "responses_per_minibatch": share.responses_per_minibatch}
