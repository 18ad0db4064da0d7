"""trainers: the RL trainers autotune exports to (EasyR1, verl, TRL), one module each.

Owns each trainer's mapping table (canonical knob -> the trainer's keys), its start-up rules
for a topology (nodes x GPUs), key_classes.py with classes_<trainer>.py: every other key of
the trainer's schema in one class, export_plan.py: what an export writes and refuses, and
render.py: merging a config into the user's own trainer YAML. May import batching, config,
errors and files; never torch, the sweep, or the CLI.
"""

from __future__ import annotations

from autotune.errors import ConfigError
from autotune.trainers.adapter import Adapter
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.trl import TRL
from autotune.trainers.verl import VERL

ADAPTERS: dict[str, Adapter] = {adapter.name: adapter for adapter in (EASYR1, VERL, TRL)}


def get_adapter(name: str) -> Adapter:
    if name not in ADAPTERS:
        raise ConfigError(f"--trainer {name!r}: known trainers: {', '.join(ADAPTERS)}")
    return ADAPTERS[name]
