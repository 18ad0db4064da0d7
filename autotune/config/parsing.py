"""Knob values from text: `--set key=value`, a flat YAML file of knobs, one value typed by
its knob; unknown keys named with the closest valid ones; params in a short readable form."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any

from autotune.config.schema import (
    ALL_LINEAR,
    COEFFICIENT_KNOBS,
    KNOB_NAMES,
    MAX_KNOB_VALUE,
    Knobs,
    KnobValue,
    ProbeConfig,
)
from autotune.config.units import parse_bytes
from autotune.errors import ConfigError

_KNOB_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(ProbeConfig)}
_KNOB_CHOICES: dict[str, tuple[str, ...]] = {
    f.name: f.metadata["choices"] for f in dataclasses.fields(ProbeConfig)
    if "choices" in f.metadata}
_KNOB_MINIMUM: dict[str, int] = {f.name: f.metadata.get("minimum", 1)
                                 for f in dataclasses.fields(ProbeConfig)}
# a module name as peft matches it (a suffix of the module's path): letters, digits, _ and .
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def engine_choices() -> tuple[str, ...]:
    """The rollout engines a probe has (the `rollout_engine` knob's choices)."""
    return _KNOB_CHOICES["rollout_engine"]


def parse_knob_value(key: str, raw: object) -> KnobValue:
    """Turn a YAML or command-line value into the knob's type, or raise ConfigError."""
    if key not in _KNOB_TYPES:
        raise ConfigError(unknown_key_message(key, KNOB_NAMES, "knob"))
    kind = _KNOB_TYPES[key]
    names_knob = kind == "str" and key not in _KNOB_CHOICES  # module names: a list may do
    if names_knob and isinstance(raw, list | tuple) and all(isinstance(n, str) for n in raw):
        return parse_module_names(key, raw)
    if not isinstance(raw, str | int | float | None):  # a list or a mapping, never stringified
        raise ConfigError(f"{key}: expected one value, not a {type(raw).__name__}")
    text = str(raw).strip().lower()
    if kind.endswith(" | None") and (raw is None or text in ("none", "null", "")):
        return None
    kind = kind.removesuffix(" | None")
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: expected true or false")
    if kind == "str" and key not in _KNOB_CHOICES:
        return parse_module_names(key, raw)
    if kind == "str":
        choices = _KNOB_CHOICES[key]
        if isinstance(raw, str) and text in choices:
            return text
        raise ConfigError(f"{key}={raw!r}: expected one of {', '.join(choices)}")
    if kind == "float" and key in COEFFICIENT_KNOBS:
        try:
            coefficient = float(str(raw).strip())
        except ValueError:
            coefficient = -1.0
        if isinstance(raw, bool) or not 0 <= coefficient < float("inf"):
            raise ConfigError(f"{key}={raw!r}: expected a coefficient of 0 or more, e.g. 0.001")
        return coefficient
    if kind == "float":
        return parse_share(raw, f"{key}={raw!r}: expected a share of the device, more than 0 "
                                "and at most 1, e.g. 0.6")
    if key.endswith("_bytes"):
        return parse_bytes(str(raw), key)
    if isinstance(raw, bool):
        raise ConfigError(f"{key}={raw!r}: expected a positive integer")
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: expected a positive integer") from None
    if value < _KNOB_MINIMUM[key]:
        raise ConfigError(f"{key}={value}: must be at least {_KNOB_MINIMUM[key]}")
    if value > MAX_KNOB_VALUE:
        raise ConfigError(f"{key}={value}: must be at most {MAX_KNOB_VALUE}")
    return value


def parse_module_names(key: str, raw: object) -> str:
    """`all-linear`, or module names (a YAML list or comma-separated) as one comma-separated
    string: the form a knob's value takes."""
    names = [str(name).strip() for name in raw] if isinstance(raw, list | tuple) \
        else str(raw).split(",") if isinstance(raw, str) else None
    if names is not None and [n.lower() for n in names] == [ALL_LINEAR]:
        return ALL_LINEAR
    if not names or not all(_MODULE_NAME.fullmatch(name.strip()) for name in names):
        raise ConfigError(f"{key}={raw!r}: expected {ALL_LINEAR} or module names, "
                          "comma-separated (q_proj,v_proj)")
    return ",".join(name.strip() for name in names)


def parse_share(raw: object, problem: str) -> float:
    """A share in (0, 1] (of a device, of a node's memory); ConfigError(`problem`) else."""
    try:
        value = float(str(raw).strip()) if not isinstance(raw, bool) else -1.0
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise ConfigError(problem)
    return value


def parse_assignments(assignments: list[str] | tuple[str, ...],
                      translate: Callable[[dict[str, Any]], Knobs] | None = None
                      ) -> Knobs:
    """Parse `key=value` strings from `--set` into typed knob values; report every problem.
    `translate` turns the keys that are not knobs (a trainer's own keys, their values read as
    YAML) into the knobs they set, all at once, or raises ConfigError naming what it cannot."""
    from autotune.files import load_yaml

    values: Knobs = {}
    foreign: dict[str, Any] = {}  # keys that are not knobs (YAML values), for `translate`
    problems: list[str] = []

    def add(knob: str, value: KnobValue) -> None:
        if knob in values and values[knob] != value:
            problems.append(f"--set {knob} given twice ({values[knob]}, then {value}); give "
                            "it once")
        values[knob] = value

    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key.replace("-", "_") in _KNOB_TYPES or translate is None:
            key = key.replace("-", "_")
        if not sep or not key:
            problems.append(f"--set {item!r}: expected key=value, e.g. micro_batch_size_update=4")
            continue
        try:
            if translate is not None and key not in _KNOB_TYPES:
                foreign[key] = load_yaml(raw, f"{key}={raw}")
            else:
                add(key, parse_knob_value(key, raw))
        except ConfigError as err:
            problems.extend(f"--set {p}" for p in err.problems)
    if foreign and translate is not None:
        try:
            for knob, value in translate(foreign).items():
                add(knob, parse_knob_value(knob, value))
        except ConfigError as err:
            problems.extend(f"--set {p}" for p in err.problems)
    if problems:
        raise ConfigError(problems)
    return values




def unknown_key_message(key: str, valid: tuple[str, ...] | list[str], what: str) -> str:
    """One line naming the unknown key, the closest valid ones, and where the full list is."""
    holding = [name for name in valid if key and key in name]  # a prefix or a part first
    close = (holding + [name for name in difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
                        if name not in holding])[:3]
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"unknown {what} {key!r}: {hint}valid: {', '.join(valid)}"



def load_knob_file(path: str) -> Knobs:
    """Canonical knobs from a flat YAML mapping (`--base-config`); every problem in one go."""
    from autotune.files import load_yaml, read_text_file

    data = load_yaml(read_text_file(path, "--base-config"), path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of knob names to values, "
                          "e.g. micro_batch_size_update: 4")
    values: Knobs = {}
    problems: list[str] = []
    for key, raw in data.items():
        try:
            values[str(key)] = parse_knob_value(str(key), raw)
        except ConfigError as err:
            problems.extend(f"{path}: {key}: {p}" for p in err.problems)
    if problems:
        raise ConfigError(problems)
    return values


def describe_params(params: Mapping[str, object]) -> str:
    """Params in a short readable form: mbu=4 mbe=8 gc offload_params."""
    short = {"micro_batch_size_update": "mbu", "micro_batch_size_experience": "mbe",
             "gradient_checkpointing": "gc", "rollout_batch_size": "rbs", "rollout_n": "n",
             "global_batch_size": "gbs", "offload_params": "off_p",
             "offload_optimizer": "off_o", "val_batch_size": "vbs",
             "rollout_tensor_parallel": "tp", "gpu_memory_utilization": "util",
             "max_num_batched_tokens": "mnbt", "enable_sleep": "sleep",
             "dynamic_batching": "dyn", "max_token_len_update": "tok_u",
             "max_token_len_experience": "tok_e", "offload_ref_params": "off_ref",
             "critic_micro_batch_size_update": "c_mbu", "critic_max_token_len_update": "c_tok",
             "critic_gradient_checkpointing": "c_gc", "critic_offload_params": "c_off_p",
             "critic_offload_optimizer": "c_off_o"}
    parts = []
    for name, value in params.items():
        label = short.get(name, name)
        if isinstance(value, bool):
            parts.append(label if value else f"no-{label}")
        else:
            parts.append(f"{label}={value}")
    return " ".join(parts)
