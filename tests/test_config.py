"""Knob parsing and the trainer-independent rules."""

from __future__ import annotations

import pytest

from autotune.config import (
    KNOB_NAMES,
    ProbeConfig,
    format_bytes,
    make_probe_config,
    parse_assignments,
    parse_bytes,
    parse_duration_s,
    validate_probe_config,
)
from autotune.errors import ConfigError


def test_parse_assignments_types():
    values = parse_assignments(["micro_batch_size_update=8", "gradient_checkpointing=on",
                                "val_batch_size=none", "offload-params=false"])
    assert values == {"micro_batch_size_update": 8, "gradient_checkpointing": True,
                      "val_batch_size": None, "offload_params": False}


def test_parse_assignments_reports_every_problem():
    with pytest.raises(ConfigError) as info:
        parse_assignments(["micro_batch=4", "rollout_n=0", "use_kl=maybe", "oops"])
    problems = info.value.problems
    assert len(problems) == 4
    assert "did you mean micro_batch_size_update" in problems[0]
    assert "rollout_n=0" in problems[1] and "at least 1" in problems[1]
    assert "true or false" in problems[2]
    assert "key=value" in problems[3]


def test_rules():
    assert validate_probe_config(ProbeConfig()) == []
    problems = validate_probe_config(ProbeConfig(rollout_batch_size=6, global_batch_size=4,
                                                 micro_batch_size_update=3,
                                                 micro_batch_size_experience=5))
    assert any("not divisible by global_batch_size" in p for p in problems)
    assert any("micro_batch_size_update=3" in p for p in problems)
    assert any("micro_batch_size_experience=5" in p for p in problems)
    with pytest.raises(ConfigError, match="exceeds rollout_batch_size"):
        make_probe_config({"rollout_batch_size": 2, "global_batch_size": 4})


def test_sizes_and_durations():
    assert parse_bytes("40GiB") == 40 * 2**30
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("512m") == 512 * 2**20
    assert parse_bytes("1024") == 1024
    with pytest.raises(ConfigError, match="--gpu-memory-limit '40XB'"):
        parse_bytes("40XB", "--gpu-memory-limit")
    assert parse_duration_s("15m") == 900 and parse_duration_s("8h") == 28800
    with pytest.raises(ConfigError):
        parse_duration_s("-3s")
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(None) == "-"


def test_knob_names_are_the_design_vocabulary():
    for name in ["rollout_batch_size", "rollout_n", "global_batch_size", "micro_batch_size_update",
                 "micro_batch_size_experience", "gradient_checkpointing", "offload_params",
                 "offload_optimizer", "val_batch_size"]:
        assert name in KNOB_NAMES
