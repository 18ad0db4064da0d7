"""One searched parameter of a space: its values, its Optuna distribution, and its parsing.

A parameter is a canonical knob (config/schema.py), or a trainer's own key for a sweep that
probes the user's trainer, declared with the way it moves device memory (`memory_direction`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.config import (
    KNOB_NAMES,
    KnobValue,
    ProbeConfig,
    parse_knob_value,
    unknown_key_message,
)
from autotune.errors import ConfigError
from autotune.files import JsonObject

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

def params_key(params: Mapping[str, KnobValue]) -> str:
    """A config's params as one string: the same params, the same key, in any order."""
    return json.dumps(params, sort_keys=True)


PARAM_TYPES = ("int", "categorical", "bool")
_BOOL_KNOBS = {name for name in KNOB_NAMES if isinstance(getattr(ProbeConfig(), name), bool)}


@dataclass(frozen=True)
class ParamSpec:
    """One searched knob: its Optuna distribution, written as plain values."""

    name: str
    kind: str  # int | categorical | bool
    choices: tuple[KnobValue, ...] = ()  # categorical (and bool: False, True)
    low: int = 0
    high: int = 0
    step: int = 1
    log: bool = False
    memory_direction: int | None = None  # set only for a trainer's own key (not a knob)

    @property
    def is_trainer_key(self) -> bool:
        return self.memory_direction is not None

    def values(self) -> tuple[KnobValue, ...]:
        """Every value the parameter can take."""
        if self.kind == "int":
            if self.log:
                return tuple(range(self.low, self.high + 1))
            return tuple(range(self.low, self.high + 1, self.step))
        return self.choices

    def distribution(self) -> BaseDistribution:
        from optuna.distributions import CategoricalDistribution, IntDistribution

        if self.kind == "int":
            return IntDistribution(self.low, self.high, log=self.log, step=self.step)
        return CategoricalDistribution(self.choices)

    def as_dict(self) -> JsonObject:
        extra: JsonObject = {} if self.memory_direction is None else \
            {"memory_direction": self.memory_direction}
        if self.kind == "int":
            return {"type": "int", "low": self.low, "high": self.high, "step": self.step,
                    "log": self.log, **extra}
        if self.kind == "bool":
            return {"type": "bool", **extra}
        return {"type": "categorical", "choices": list(self.choices), **extra}


KNOB_NAME_SET = frozenset(KNOB_NAMES)  # a grid's rule checks ask millions of times


def is_trainer_key(name: str) -> bool:
    """A name that is not a canonical knob: a trainer's own key (checked at load)."""
    return name not in KNOB_NAME_SET


def is_ordered(value: KnobValue) -> bool:
    return value is None or isinstance(value, int | float)


def value_order(value: KnobValue) -> float:
    """Where a value sits on its axis (None, for "no validation", below every number)."""
    return -1.0 if value is None else float(value)


def parse_param(name: str, raw: Any, key: str) -> tuple[ParamSpec | None, list[str]]:
    declared = isinstance(raw, dict) and "memory_direction" in raw
    if name not in KNOB_NAMES and not declared:
        return None, [f"{key}: {unknown_key_message(name, KNOB_NAMES, 'knob')} (a trainer's "
                      "own key also needs memory_direction: 1, 0 or -1)"]
    if not isinstance(raw, dict):
        return None, [f"{key}: expected a mapping such as {{type: categorical, choices: [1, 2]}}"]
    if name in KNOB_NAMES and declared:
        return None, [f"{key}.memory_direction: {name} is a knob; its direction is known "
                      "(config.MEMORY_DIRECTION): remove the field"]
    if declared:
        return parse_trainer_param(name, raw, key)
    kind = raw.get("type")
    if kind not in PARAM_TYPES:
        return None, [f"{key}.type: {kind!r} is not one of {', '.join(PARAM_TYPES)}"]
    allowed = {"int": {"type", "low", "high", "step", "log"}, "bool": {"type"},
               "categorical": {"type", "choices"}}[kind]
    problems = [f"{key}.{k}: not a field of a {kind} param (fields: {', '.join(sorted(allowed))})"
                for k in raw if k not in allowed]
    is_bool_knob = name in _BOOL_KNOBS
    if kind == "bool" or (is_bool_knob and kind != "categorical"):
        if not is_bool_knob:
            problems.append(f"{key}.type: bool, but {name} takes integers")
        return (None if problems else ParamSpec(name, "bool", (False, True))), problems
    if kind == "categorical":
        choices = raw.get("choices")
        if not isinstance(choices, list) or not choices:
            return None, [*problems, f"{key}.choices: expected a non-empty list"]
        typed = []
        for i, choice in enumerate(choices):
            try:
                typed.append(parse_knob_value(name, choice))
            except ConfigError as err:
                problems.extend(f"{key}.choices[{i}]: {p}" for p in err.problems)
        if len(set(typed)) != len(typed):
            problems.append(f"{key}.choices: a value is listed twice")
        return (None if problems else ParamSpec(name, "categorical", tuple(typed))), problems
    values: dict[str, int] = {}
    for field_name in ("low", "high", "step"):
        raw_value = raw.get(field_name, 1 if field_name == "step" else None)
        if not isinstance(raw_value, int) or isinstance(raw_value, bool) or raw_value < 1:
            problems.append(f"{key}.{field_name}: expected a positive integer, got {raw_value!r}")
        else:
            values[field_name] = raw_value
    log = raw.get("log", False)
    if not isinstance(log, bool):
        problems.append(f"{key}.log: expected true or false, got {log!r}")
    if problems:
        return None, problems
    if values["low"] > values["high"]:
        problems.append(f"{key}: low={values['low']} is above high={values['high']}")
    if log and values["step"] != 1:
        problems.append(f"{key}: log=true needs step=1 (Optuna cannot combine them)")
    if not log and (values["high"] - values["low"]) % values["step"]:
        problems.append(f"{key}: high - low = {values['high'] - values['low']} is not a "
                        f"multiple of step={values['step']}")
    if problems:
        return None, problems
    return ParamSpec(name, "int", low=values["low"], high=values["high"], step=values["step"],
                     log=log), []


def parse_trainer_param(name: str, raw: dict[str, Any], key: str
                         ) -> tuple[ParamSpec | None, list[str]]:
    """A trainer's own key: its values as the trainer takes them, its declared direction."""
    direction = raw["memory_direction"]
    problems = []
    if direction not in (-1, 0, 1) or isinstance(direction, bool):
        problems.append(f"{key}.memory_direction: expected 1 (more memory as it grows), 0 or "
                        f"-1, got {direction!r}")
    kind = raw.get("type")
    rest = {k: v for k, v in raw.items() if k != "memory_direction"}
    if kind == "int":
        spec, found = parse_param(_INT_PROXY, rest, key)
        problems += found
        if spec is None or problems:
            return None, problems
        return ParamSpec(name, "int", low=spec.low, high=spec.high, step=spec.step,
                         log=spec.log, memory_direction=direction), []
    if kind == "bool":
        extra = [k for k in rest if k != "type"]
        problems += [f"{key}.{k}: not a field of a bool param (fields: type, "
                     "memory_direction)" for k in extra]
        return (None if problems else
                ParamSpec(name, "bool", (False, True), memory_direction=direction)), problems
    if kind != "categorical":
        return None, [*problems, f"{key}.type: {kind!r} is not one of {', '.join(PARAM_TYPES)}"]
    choices = rest.get("choices")
    problems += [f"{key}.{k}: not a field of a categorical param (fields: choices, "
                 "memory_direction, type)" for k in rest if k not in ("type", "choices")]
    if not isinstance(choices, list) or not choices:
        return None, [*problems, f"{key}.choices: expected a non-empty list"]
    if any(isinstance(c, dict | list) for c in choices):
        problems.append(f"{key}.choices: expected plain values (numbers, strings, booleans)")
    elif len({repr(c) for c in choices}) != len(choices):
        problems.append(f"{key}.choices: a value is listed twice")
    if direction and not all(is_ordered(c) for c in choices):
        problems.append(f"{key}: memory_direction {direction} needs numeric choices (use 0 "
                        "for values without an order)")
    return (None if problems else ParamSpec(name, "categorical", tuple(choices),
                                            memory_direction=direction)), problems


_INT_PROXY = "micro_batch_size_update"  # an int knob: a trainer's int key is read as one
