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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.config import Topology
from autotune.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """A trainer setting the measured shapes need: with another value the trainer would not
    run what the probe measured (dynamic batching makes the micro-batch a token budget; a
    critic adds a model the probe never held). `ok` says whether a value in the user's config
    already gives the measured shapes; a missing or null key is the trainer's default."""

    key: str
    value: Any  # what the export writes
    why: str  # said in the exported file's header and on the terminal
    ok: Callable[[Any], bool]
    default_ok: bool  # the trainer's default gives the measured shapes: nothing to write
    refuse: bool = False  # another value in the user's config is a conflict (--force takes
    # `value`), not a setting to flip with a note


Getter = Callable[[str, Any], Any]  # a dotted key of the trainer's config, and its default


@dataclass(frozen=True)
class Derived:
    """Knobs a trainer holds in several keys at once, or in keys of its own arithmetic (TRL's
    per-process batches, whether a reference model is built): `write` gives every key for the
    knobs' values, `read` the knobs back from a config. Where a base config already reads back
    as the knobs' values, nothing is written (the user's own spelling is kept)."""

    knobs: tuple[str, ...]
    write: Callable[[dict[str, Any], Topology], dict[str, Any]]
    read: Callable[[Getter, Topology], dict[str, Any]]
    keys: tuple[str, ...]  # the config keys `read` reads: a base config that sets one states
    # the knobs (compared with a study's held-fixed values)


@dataclass(frozen=True)
class Adapter:
    """A trainer: where each knob goes (first key is where it is read back from), the
    companions written with the tuned keys, and the rules checked before writing."""

    name: str
    keys: dict[str, tuple[str, ...]]
    topology_keys: tuple[str, str] | None  # (nnodes, gpus per node) where the config has them
    companions: dict[str, Any]
    rules: Callable[[dict[str, Any], Topology, Getter], list[str]]
    launch: str  # the launch line: {path} the exported file, {overrides}, {world}
    # knobs written through several keys, or keys computed with the topology (TRL's batches)
    derived: tuple[Derived, ...] = ()
    # the knobs the trainer's own default or example config sets: the sweep's starting point
    defaults: dict[str, Any] | None = None
    # one GPU's share of the batches, computed as the trainer's own code normalises them
    # (responses_per_step, responses_per_minibatch): must agree with config.device_share
    share: Callable[[dict[str, Any], Topology], dict[str, int]] | None = None
    # a probe of the trainer's own run (`run --launch`): the keys that make it a short run of
    # `steps` logged steps (validating or not), and how many logged steps one rollout makes
    short_run: Callable[[int, bool, str], dict[str, Any]] | None = None  # (steps, validate,
    # the trial's directory, where its output goes)
    steps_per_rollout: Callable[[dict[str, Any]], int] | None = None
    settings: tuple[Setting, ...] = ()
    # the tree an export without a base config starts from, and how that file is used
    skeleton: dict[str, Any] | None = None
    skeleton_note: str = ""
    model_key: str | None = None  # where the config names the model it trains
    # what the trainer runs as measured but its config cannot say (no key): header lines
    unheld: Callable[[dict[str, Any], Topology], list[str]] | None = None
    engines: tuple[str, ...] = ("vllm-like", "vllm")  # the probe engines for its rollout
    # PPO: where the critic's knobs go (and the actor's knobs it shares: its mini-batch,
    # dynamic batching), written only for a config that trains a critic; None: the trainer's
    # PPO is not supported
    critic_keys: dict[str, tuple[str, ...]] | None = None
    critic_model_key: str | None = None  # where the config names the critic's model
    # knobs the trainer sets from others, with no key of their own (TRL scores log-probs at
    # its train micro-batch): applied to every trial's config before it is probed
    ties: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def keys_for(self, knobs: dict[str, Any]) -> dict[str, tuple[str, ...]]:
        """Where each knob of `knobs` goes: the critic's keys too when it trains one."""
        if knobs.get("algorithm") != "ppo" or not self.critic_keys:
            return self.keys
        merged = dict(self.keys)
        for knob, keys in self.critic_keys.items():
            merged[knob] = (*merged.get(knob, ()), *keys)
        return merged

    @property
    def derived_knobs(self) -> tuple[str, ...]:
        return tuple(knob for part in self.derived for knob in part.knobs)

    def derived_values(self, knobs: dict[str, Any], topology: Topology,
                       get: Getter | None = None) -> dict[str, Any]:
        """The keys of every derived part whose knobs are all given; with `get` (the user's
        config), none of a part that already reads back as the knobs' values."""
        values: dict[str, Any] = {}
        for part in self.derived:
            if any(knobs.get(knob) is None for knob in part.knobs):
                continue
            if get is not None and part.read(get, topology) == {
                    knob: knobs[knob] for knob in part.knobs}:
                continue
            values.update(part.write(knobs, topology))
        return values

    def tuned_values(self, knobs: dict[str, Any], topology: Topology,
                     get: Getter | None = None) -> dict[str, Any]:
        """Every dotted key this export writes, with its value (`get`: the user's config)."""
        values = {}
        for knob, keys in self.keys_for(knobs).items():
            if knobs.get(knob) is None:
                continue
            for key in keys:
                values[key] = knobs[knob]
        written = None
        if get is not None:  # the user's config as it will be, the tuned keys written
            base = get

            def written(key: str, default: Any) -> Any:
                return values[key] if key in values else base(key, default)
        return {**values, **self.derived_values(knobs, topology, written), **self.companions}

    def read_knobs(self, get: Getter, topology: Topology) -> dict[str, Any]:
        """The canonical knobs a trainer config holds (for the round trip)."""
        knobs = {knob: get(keys[0], None) for knob, keys in self.keys.items()
                 if get(keys[0], None) is not None}
        for part in self.derived:
            knobs.update(part.read(get, topology))
        if knobs.get("algorithm") == "ppo":  # the critic's own knobs, where it has them
            knobs.update({knob: get(keys[0], None) for knob, keys in
                          (self.critic_keys or {}).items()
                          if knob not in knobs and get(keys[0], None) is not None})
        return knobs

    def check(self, knobs: dict[str, Any], topology: Topology,
              get: Getter = lambda key, default: default) -> list[str]:
        """Every rule of this trainer the knobs break, one line each naming rule and values.
        A setting the rules read from the user's config must be a plain value of the trainer
        default's type (an interpolation such as ${oc.select:...} cannot be checked)."""
        def plain(key: str, default: Any) -> Any:
            value = get(key, default)
            if isinstance(default, bool | int) and type(value) is not type(default):
                raise ConfigError(f"{key}={value!r} in the base config: autotune checks "
                                  f"{self.name}'s rules with it and needs a plain "
                                  f"{type(default).__name__}; write the value out")
            return value

        lines = []
        if knobs.get("algorithm") == "ppo" and not self.critic_keys:
            lines.append("PPO (a critic) is not supported: autotune writes this trainer's GRPO "
                         "config only; sweep with --algorithm grpo, or export for verl or easyr1")
        return [f"{self.name}: {line}" for line in [*lines, *self.rules(knobs, topology, plain)]]

    def knobs_of_keys(self, given: dict[str, Any], topology: Topology,
                      topology_given: bool = True) -> dict[str, Any]:
        """The knobs this trainer's own keys set (`--set num_generations=8`): keys of its
        table, spelled in full or by their last part where that names one knob. Keys it reads
        through several knobs together (TRL's batches, its engine) are read as a group: every
        key of the group must be given, and the topology too where the group reads it.

        Raises:
            ConfigError: a key the trainer's table does not have, or a group given in part.
        """
        from autotune.config import KNOB_NAMES, parse_knob_value, unknown_key_message

        owners: dict[str, str | Derived] = {k: knob for knob, keys in self.keys.items()
                                             for k in keys}
        owners.update({k: part for part in self.derived for k in part.keys})
        critic = {k: knob for knob, keys in (self.critic_keys or {}).items() for k in keys}
        knobs: dict[str, Any] = {}
        groups: dict[int, tuple[Derived, dict[str, Any]]] = {}
        by_key: dict[str, Any] = {}  # every given key by its full name: what a group reads
        problems = []
        for key, value in given.items():
            # the actor's keys by their last part before the critic's (which share them:
            # ppo_micro_batch_size_per_gpu is the actor's, critic.ppo_... the critic's)
            found = [k for k in (*owners, *critic) if k == key] or \
                [k for k in owners if k.rsplit(".", 1)[-1] == key] or \
                [k for k in critic if k.rsplit(".", 1)[-1] == key]
            owners.update({k: critic[k] for k in found if k in critic and k not in owners})
            if not found or len({id(owners[k]) for k in found}) > 1:
                problems.append(f"{unknown_key_message(key, KNOB_NAMES, 'knob')}; nor a key of "
                                f"{self.name}'s table (docs/trainers-and-export.md), spelled in "
                                "full or by its last part")
                continue
            owner = owners[found[0]]
            by_key.update({k: value for k in found})
            if isinstance(owner, str):
                knobs[owner] = value
            else:
                groups.setdefault(id(owner), (owner, {}))[1].update(
                    {k: value for k in found})
        for part, values in groups.values():
            missing = [k for k in part.keys if k not in values]
            if missing:
                problems.append(f"{', '.join(values)}: {self.name} reads it with "
                                f"{', '.join(missing)}; give those too, or set the knobs "
                                f"({', '.join(part.knobs)})")
                continue

            def get(key: str, default: Any) -> Any:
                return by_key.get(key, default)
            try:
                read = part.read(get, topology)
                for knob, value in read.items():
                    parse_knob_value(knob, value)
            except (ConfigError, TypeError, ValueError, ZeroDivisionError):
                problems.append(f"{', '.join(values)}: {self.name} reads them as knobs "
                                f"autotune cannot probe ({', '.join(part.knobs)}); check the "
                                "values, or set the knobs")
                continue
            if not topology_given and read != part.read(get, Topology(topology.nnodes, 2)):
                problems.append(f"{', '.join(values)}: {self.name} reads it per process; "
                                "give --nnodes and --gpus-per-node too")
                continue
            knobs.update(read)
        if problems:
            raise ConfigError(problems)
        return knobs
