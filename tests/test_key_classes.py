"""Every key a trainer's config can hold is classified (trainers/key_classes.py): a knob key, a
key the adapter checks, a setting compared with the study, or one that changes nothing a probe
measures. The schemas are the trainers' own: verl 0.7.1's generated trainer config (its PyPI
release, as tests/test_trainer_startup.py fetches it), EasyR1's config dataclasses at its
pinned commit (their dotted fields, listed in tests/fixtures/easyr1-keys.txt: EasyR1 is not on
PyPI), TRL's GRPOConfig and ModelConfig as installed (the test extra pins the release). A
trainer release that adds a key fails here until someone classifies it."""

from __future__ import annotations

import dataclasses
import fnmatch
from pathlib import Path

import pytest
import yaml
from test_trainer_startup import trainer_source

from autotune.trainers import ADAPTERS
from autotune.trainers.adapter import Adapter

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def leaves(tree: dict, prefix: str = "") -> list[str]:
    """The dotted leaf keys of a config tree (an empty mapping is a leaf)."""
    found = []
    for name, value in tree.items():
        if isinstance(value, dict) and value:
            found += leaves(value, f"{prefix}{name}.")
        else:
            found.append(f"{prefix}{name}")
    return found


def schema_keys(trainer: str) -> list[str]:
    if trainer == "verl":
        source = trainer_source("verl")
        if source is None:
            pytest.fail("verl 0.7.1's sources are needed (the test extra's hydra-core etc.)")
        path = Path(source) / "verl" / "trainer" / "config" / "_generated_ppo_trainer.yaml"
        return leaves(yaml.safe_load(path.read_text()))
    if trainer == "easyr1":
        lines = (FIXTURES / "easyr1-keys.txt").read_text().splitlines()
        return [line for line in lines if line and not line.startswith("#")]
    from trl import GRPOConfig, ModelConfig

    return [f.name for f in (*dataclasses.fields(GRPOConfig), *dataclasses.fields(ModelConfig))]


def unclassified(adapter: Adapter, keys: list[str]) -> list[str]:
    """Each key in no class or in more than one, with what matched it."""
    bad = []
    for key in keys:
        found = adapter.key_classes.matches(key)
        if key in adapter.knob_keys:
            found = [("knob", ""), *found]
        if len(found) != 1:
            bad.append(f"{key}: {[kind for kind, _ in found] or 'no class'}")
    return bad


@pytest.mark.parametrize("trainer", ["verl", "easyr1", "trl"])
def test_every_key_of_the_trainers_own_schema_is_in_exactly_one_class(trainer):
    adapter = ADAPTERS[trainer]
    keys = schema_keys(trainer)
    assert len(keys) > 150, len(keys)  # the whole schema, not a sample of it
    assert unclassified(adapter, keys) == []
    declared = adapter.key_classes
    patterns = [pattern for pattern, _ in (*declared.checked, *declared.inert)]
    patterns += [rule.pattern for rule in declared.compared]
    stale = [pattern for pattern in patterns
             if not any(fnmatch.fnmatchcase(key, pattern) for key in keys)]
    assert stale == []  # every declaration covers some key of the schema
    for rule in adapter.key_classes.compared:
        assert rule.values and rule.why, rule


def test_easyr1s_key_list_holds_its_example_config():
    """The listed dataclass fields hold every key of EasyR1's own examples/config.yaml."""
    listed = set(schema_keys("easyr1"))
    example = leaves(yaml.safe_load((FIXTURES / "easyr1-config.yaml").read_text()))
    parts = [key.split(".") for key in example]  # a dict-valued field is one key
    assert [".".join(p) for p in parts if not any(".".join(p[:i]) in listed
                                                  for i in range(1, len(p) + 1))] == []
