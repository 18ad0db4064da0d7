"""Search spaces: which knobs a sweep varies, over which values, and which stay fixed.

A space is a YAML file (those autotune ships are in autotune/search_spaces/, listed by
`autotune spaces`) in Optuna's vocabulary:

    params:
      micro_batch_size_update: {type: categorical, choices: [1, 2, 4, 8]}
      micro_batch_size_experience: {type: int, low: 1, high: 16, log: true}
      gradient_checkpointing: {type: bool}
    fixed:
      rollout_n: 8
      max_response_length: 1024

Knob names are the canonical ones (config/schema.py). A sweep that probes the user's own trainer
(`run --launch`) may also search the trainer's own keys, as the trainer spells them, each with
the way it moves device memory declared so that OOM pruning still reasons about it:

    params:
      worker.rollout.gpu_memory_utilization:
        {type: categorical, choices: [0.4, 0.5, 0.6], memory_direction: 1}

and fix dotted trainer keys under `fixed`. Loading checks everything at once and reports each
problem with its file and key. Optuna is imported only when distributions are asked for.

A trial's params become its Candidate once (`SearchSpace.candidate`): the ProbeConfig they
make, the trainer's own keys and every rule the config breaks; the feasibility rules, the
pre-screen, the traces and the probe's request all take that.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from autotune.batching import BUDGET_KNOB, MICRO_KNOB
from autotune.config import (
    MEMORY_DIRECTION,
    Knobs,
    KnobValue,
    ProbeConfig,
    parse_knob_value,
    unknown_key_message,
    validate_probe_config,
)
from autotune.errors import ConfigError
from autotune.files import load_yaml, read_text_file
from autotune.sweep.space.params import (
    ParamSpec,
    is_ordered,
    is_trainer_key,
    params_key,
    parse_param,
    value_order,
)

SPACES_DIR = Path(__file__).resolve().parents[2] / "search_spaces"  # autotune/search_spaces/
MAX_ENUMERATED_CONFIGS = 200_000  # larger spaces are sampled but never listed in full

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

# what a space fixes by name: a knob's value, or a trainer key's as its YAML holds it (a list
# too: the trainer's own value, passed on as read)
SpaceValue: TypeAlias = "KnobValue | list[Any]"
SpaceValues: TypeAlias = "dict[str, SpaceValue]"


def _no_rules(config: ProbeConfig) -> list[str]:
    return []


@dataclass(frozen=True)
class Candidate:
    """One trial's config, made once from the params Optuna gave (SearchSpace.candidate): the
    params themselves (what dominance compares, what the study keys trials by), the whole
    ProbeConfig they make with the space's fixed knobs and the trainer's ties, the trainer's
    own keys, and the rules the config must pass. Everything after the ask takes this."""

    params: Knobs
    config: ProbeConfig
    trainer_values: SpaceValues = field(default_factory=dict)
    rules: Callable[[ProbeConfig], list[str]] = field(default=_no_rules, repr=False,
                                                      compare=False)

    @property
    def key(self) -> str:
        """The params' identity across trials and drivers (sharing.params_key)."""
        return params_key(self.params)

    @property
    def tied(self) -> Knobs:
        """The params the trainer's ties set otherwise (TRL scores log-probs at its update
        micro-batch): their values as the probe runs them."""
        return {name: getattr(self.config, name) for name, value in self.params.items()
                if hasattr(self.config, name) and getattr(self.config, name) != value}

    @property
    def ran(self) -> Knobs:
        """The params as the probe runs them (the ties applied): what the study shows."""
        return {**self.params, **self.tied}

    @functools.cached_property
    def problems(self) -> tuple[str, ...]:
        """Every rule the config breaks, checked when first asked (a config of the space's
        valid grid, or one being told, needs no check)."""
        return tuple(self.rules(self.config))


@dataclass(frozen=True)
class SearchSpace:
    """Searched params and fixed knobs; everything else takes ProbeConfig's default."""

    params: dict[str, ParamSpec]
    fixed: SpaceValues = field(default_factory=dict)
    source: str = "<memory>"
    # more rules a config must pass (a trainer's, for its topology): never probed otherwise
    rules: Callable[[ProbeConfig], list[str]] | None = field(default=None, compare=False)
    world_size: int = 1  # GPUs of the training run: each takes an equal share of the batches
    # knobs the target trainer sets from others (Adapter.ties), applied by config_for
    ties: Callable[[ProbeConfig], Knobs] | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return Path(self.source).stem

    @property
    def space_hash(self) -> str:
        """Identity of the space: same params and fixed values, same hash."""
        data = {"params": {k: v.as_dict() for k, v in sorted(self.params.items())},
                "fixed": dict(sorted(self.fixed.items()))}
        text = json.dumps(data, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def distributions(self) -> dict[str, BaseDistribution]:
        return {name: spec.distribution() for name, spec in self.params.items()}

    @property
    def trainer_keys(self) -> tuple[str, ...]:
        """The trainer's own keys the space searches or fixes (only a command probe runs
        them)."""
        return tuple(name for name in (*self.params, *self.fixed) if is_trainer_key(name))

    def direction(self, name: str) -> int:
        """How `name` moves peak device memory as it grows: config.MEMORY_DIRECTION for a
        knob, the space's declaration for a trainer key."""
        spec = self.params.get(name)
        if spec is not None and spec.memory_direction is not None:
            return spec.memory_direction
        return MEMORY_DIRECTION.get(name, 0)

    @property
    def batches_by_tokens(self) -> bool:
        """Whether some config of the space cuts micro-batches by a token budget."""
        return "dynamic_batching" in self.params or bool(self.fixed.get("dynamic_batching"))

    @property
    def trains_critic(self) -> bool:
        """Whether some config of the space trains a critic (PPO): the algorithm is searched,
        or the one fixed has a critic."""
        return "algorithm" in self.params or self.config_for({}).has_critic

    def with_token_budgets(self, sequence_tokens: int) -> SearchSpace:
        """The space for a run that batches by tokens: each searched micro-batch becomes the
        token budget of that many whole sequences of `sequence_tokens` (the same worst-case
        peaks, in the trainer's unit), unless the space searches the budget already."""
        params = {}
        for name, spec in self.params.items():
            phase = {knob: phase for phase, knob in MICRO_KNOB.items()}.get(name)
            budget = BUDGET_KNOB.get(phase or "")
            if budget is None or budget in self.params:
                params[name] = spec
                continue
            choices = sorted({v * sequence_tokens for v in spec.values() if isinstance(v, int)})
            params[budget] = ParamSpec(budget, "categorical", choices=tuple(choices))
        return dataclasses.replace(self, params=params)

    @property
    def directions(self) -> dict[str, int]:
        return {**MEMORY_DIRECTION, **{name: self.direction(name) for name in self.params}}

    def candidate(self, params: Mapping[str, KnobValue]) -> Candidate:
        """A trial's params made into its config, once: the config (`config_for`), the
        trainer's own keys (`trainer_values`), and the rules it must pass
        (`config_problems`)."""
        return Candidate(dict(params), self.config_for(params), self.trainer_values(params),
                         self.config_problems)

    def config_problems(self, config: ProbeConfig) -> list[str]:
        """Every rule `config` breaks on the space's GPUs: validate_probe_config's, then the
        target trainer's."""
        return validate_probe_config(config, self.world_size) + \
            (self.rules(config) if self.rules else [])

    def config_for(self, params: Mapping[str, KnobValue]) -> ProbeConfig:
        """The full configuration of a trial (not checked: see `candidate`), with the
        target trainer's ties; the trainer's own keys are left out (see `trainer_values`)."""
        searched = {k: v for k, v in params.items() if not is_trainer_key(k)}
        config = ProbeConfig.from_knobs({**self.fixed_knobs, **searched})
        return config.replace(**self.ties(config)) if self.ties else config

    @property
    def fixed_knobs(self) -> Knobs:
        """The canonical knobs the space fixes (its trainer keys, a list too, are left out:
        see `trainer_values`)."""
        return {k: v for k, v in self.fixed.items()
                if not is_trainer_key(k) and not isinstance(v, list)}

    def trainer_values(self, params: Mapping[str, KnobValue]) -> SpaceValues:
        """The trainer's own keys of a trial, fixed and searched, as the trainer spells them."""
        return {k: v for k, v in {**self.fixed, **params}.items() if is_trainer_key(k)}

    def problems_for(self, params: Mapping[str, KnobValue]) -> list[str]:
        """Every rule the config of `params` breaks (its candidate's problems)."""
        return list(self.candidate(params).problems)

    def with_fixed(self, values: Mapping[str, SpaceValue]) -> SearchSpace:
        """The same space with more fixed knobs (knobs already searched are not touched)."""
        extra = {k: v for k, v in values.items() if k not in self.params}
        return dataclasses.replace(self, fixed={**self.fixed, **extra})

    def with_rules(self, rules: Callable[[ProbeConfig], list[str]]) -> SearchSpace:
        return dataclasses.replace(self, rules=rules)

    def with_ties(self, ties: Callable[[ProbeConfig], Knobs] | None) -> SearchSpace:
        return dataclasses.replace(self, ties=ties)

    def for_world(self, world_size: int) -> SearchSpace:
        """The same space for a run of `world_size` GPUs (its rules split the batches)."""
        return dataclasses.replace(self, world_size=world_size)

    def snapped(self, params: Mapping[str, KnobValue]) -> tuple[Knobs, list[str]]:
        """`params` moved to the nearest value each searched knob allows, and what moved."""
        out, notes = dict(params), []
        for name, value in params.items():
            allowed = self.params[name].values() if name in self.params else [value]
            if value not in allowed:
                out[name] = min(allowed, key=lambda v, x=value: abs(float(v) - float(x)))
                notes.append(f"{name}={value} is not in the space: {out[name]} instead")
        return out, notes

    def with_user_values(self, fixed: Mapping[str, KnobValue], base: Mapping[str, KnobValue],
                         base_source: str | None = None) -> tuple[SearchSpace, Knobs | None]:
        """Apply `--set` values and a `--base-config`: the base's searched values become a
        trial (the rest at their safe values), everything else is fixed, `--set` winning."""
        searched = [k for k in fixed if k in self.params]
        if searched:
            raise ConfigError(f"--set {', '.join(searched)}: searched by {self.source}; "
                              "fix it in a copy of the space instead")
        base_params = {k: v for k, v in base.items() if k in self.params}
        bad = [f"{base_source}: {k}={v} is not among the values the space searches "
               f"({list(self.params[k].values())})"
               for k, v in base_params.items() if v not in self.params[k].values()]
        if bad:
            raise ConfigError(bad)
        space = self.with_fixed({**{k: v for k, v in base.items() if k not in self.params},
                                 **fixed})
        return space, ({**space.safe_params(), **base_params} if base_params else None)

    @property
    def grid_size(self) -> int:
        return math.prod(len(spec.values()) for spec in self.params.values())

    def grid(self) -> Iterator[Knobs]:
        """Every combination of the params, in order (valid or not)."""
        names = list(self.params)
        for combo in itertools.product(*(self.params[n].values() for n in names)):
            yield dict(zip(names, combo, strict=True))

    def valid_grid(self) -> list[Knobs] | None:
        """Every combination that passes the rules, or None when the space is too large."""
        valid = self._valid_grid
        return None if valid is None else [dict(params) for params in valid]

    @functools.cached_property
    def _valid_grid(self) -> tuple[Knobs, ...] | None:
        # listed once per space: the sweep asks for its safe config at every trial, and a
        # 2,304-config space took 0.6 s to check against the rules each time
        if self.grid_size > MAX_ENUMERATED_CONFIGS:
            return None
        return tuple(params for params in self.grid() if not self.problems_for(params))

    def memory_rank(self, params: Mapping[str, KnobValue]) -> float:
        """How memory-hungry a combination is, 0 = the lightest value on every axis."""
        rank = 0.0
        for name, (values, direction) in self._rank_axes.items():
            position = values.index(params[name]) / max(1, len(values) - 1)
            rank += position if direction > 0 else (1 - position) if direction < 0 else 0
        return rank

    @functools.cached_property
    def _rank_axes(self) -> dict[str, tuple[list[KnobValue], int]]:
        """Each searched knob's values in order (numbers ascending) and its memory direction:
        memory_rank's axes, laid out once (a grid ranks every config)."""
        axes = {}
        for name, spec in self.params.items():
            values = sorted(spec.values(), key=value_order) \
                if all(is_ordered(v) for v in spec.values()) else list(spec.values())
            axes[name] = (values, self.direction(name))
        return axes

    def _lightness(self, name: str) -> Callable[[KnobValue], float]:
        """How much memory a value of `name` needs, for ordering (unordered values: equal)."""
        direction = self.direction(name)
        return lambda value: value_order(value) * direction if is_ordered(value) else 0.0

    def safe_params(self) -> Knobs:
        """The lightest valid combination: every memory saver on, smallest micro-batches."""
        return dict(self._safe_params)

    @functools.cached_property
    def _safe_params(self) -> Knobs:
        candidates = self._valid_grid
        if candidates is None:  # too large to list: take the lightest value of each axis
            candidates = ({name: min(spec.values(), key=self._lightness(name))
                           for name, spec in self.params.items()},)
        if not candidates:
            first = self.problems_for(next(self.grid()))
            raise ConfigError(f"{self.source}: no combination of the space passes the rules, "
                              f"e.g. {first[0] if first else 'none'}")
        return min(candidates, key=self.memory_rank)


def shipped_spaces() -> list[str]:
    """The names of the spaces autotune ships (`--space NAME`)."""
    return sorted(path.stem for path in SPACES_DIR.glob("*.yaml"))


def resolve_space_path(name_or_path: str) -> Path:
    """A file path, or the name of a space autotune ships (e.g. 'grpo')."""
    path = Path(name_or_path)
    if path.is_dir():
        raise ConfigError(f"search space {name_or_path}: is a directory; give a .yaml file, "
                          "or the name of a space autotune ships (`autotune spaces`)")
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"search space {name_or_path}: no such file")
        return path
    shipped = SPACES_DIR / f"{name_or_path}.yaml"
    if shipped.is_file():
        return shipped
    raise ConfigError(unknown_key_message(name_or_path, shipped_spaces(), "search space") +
                      " (or give a path to a .yaml file)")


def load_search_space(name_or_path: str) -> SearchSpace:
    """Read and check a search space; raises ConfigError listing every problem."""
    space, problems = check_search_space(name_or_path)
    if problems:
        raise ConfigError(problems)
    assert space is not None
    return space


def smallest_world(space: SearchSpace) -> int:
    """The smallest run a space's file can describe, where its rules are checked before a run
    names its GPUs: one GPU, or one more than the engine's largest rollout_gpus where the
    engine can have GPUs of its own (placement=separate cannot run on one)."""
    def values(name: str) -> list:
        spec = space.params.get(name)
        return list(spec.values()) if spec is not None else [space.fixed.get(name)]

    if "separate" not in values("placement"):
        return 1
    return 1 + max((v for v in values("rollout_gpus") if isinstance(v, int)), default=1)


def check_search_space(name_or_path: str) -> tuple[SearchSpace | None, list[str]]:
    """The space and every problem found in it (for `autotune validate`)."""
    path = resolve_space_path(name_or_path)
    shipped = path.resolve().parent == SPACES_DIR and not Path(name_or_path).suffix
    return _parse(path, f"autotune/search_spaces/{path.name}" if shipped else str(name_or_path))


def _parse(path: Path, where: str) -> tuple[SearchSpace | None, list[str]]:
    try:
        data = load_yaml(read_text_file(path, "search space"), where)
    except ConfigError as err:
        return None, err.problems
    if not isinstance(data, dict):
        return None, [f"{where}: expected a mapping with 'params' and 'fixed' sections"]
    problems = [f"{where}: {unknown_key_message(k, ['params', 'fixed'], 'section')}"
                for k in data if k not in ("params", "fixed")]
    raw_params = data.get("params") or {}
    raw_fixed = data.get("fixed") or {}
    for section, raw in (("params", raw_params), ("fixed", raw_fixed)):
        if not isinstance(raw, dict):
            problems.append(f"{where}: {section}: expected a mapping of knob names")
    if not isinstance(raw_params, dict) or not isinstance(raw_fixed, dict):
        return None, problems
    if not raw_params:
        problems.append(f"{where}: params: no knob to search; add at least one")
    params: dict[str, ParamSpec] = {}
    for name, raw in raw_params.items():
        spec, found = parse_param(str(name), raw, f"{where}: params.{name}")
        problems.extend(found)
        if spec is not None:
            params[str(name)] = spec
    fixed: SpaceValues = {}
    for name, raw in raw_fixed.items():
        key = f"{where}: fixed.{name}"
        if name in raw_params:
            problems.append(f"{key}: also under params; a knob is either searched or fixed")
            continue
        if is_trainer_key(str(name)) and "." in str(name):
            if isinstance(raw, dict):
                problems.append(f"{key}: expected the trainer key's value (a scalar or a list)")
            else:
                fixed[str(name)] = raw
            continue
        try:
            fixed[str(name)] = parse_knob_value(str(name), raw)
        except ConfigError as err:
            problems.extend(f"{key}: {p}" for p in err.problems)
    if problems:
        return None, problems
    space = SearchSpace(params, fixed, where)
    checked = space
    if "kv_cache_memory_bytes" in {*params, *fixed} and "rollout_engine" not in {*params,
                                                                                 *fixed}:
        # it sizes a vLLM engine's KV pool and the run's --engine names the engine: the
        # file alone is checked with one that reads it (the run checks the engine it gets)
        checked = space.with_fixed({"rollout_engine": "vllm-like"})
    checked = checked.for_world(smallest_world(checked))
    # one valid combination is enough here (the sweep lists them all, on the run's GPUs)
    if checked.grid_size <= MAX_ENUMERATED_CONFIGS and \
            not any(not checked.problems_for(params) for params in checked.grid()):
        first = checked.problems_for(next(checked.grid()))
        problems.append(f"{where}: no combination of params and fixed passes the rules, "
                        f"e.g. {first[0]}")
    return space, problems
