"""The registry: real architectures, parameter counts against the model cards."""

from __future__ import annotations

import pytest

from autotune.errors import ConfigError, UnknownModelError
from autotune.probe.modeling.models import count_params, load_model_config
from autotune.registry import REGISTRY, get_model_spec


@pytest.mark.parametrize("name", [n for n, s in REGISTRY.items() if s.card_params])
def test_param_count_matches_model_card(name):
    params = count_params(load_model_config(name))
    card = REGISTRY[name].card_params * 1e9
    assert abs(params - card) / card < 0.01, (name, params)


def test_tiny_models_are_the_same_classes():
    text, vl = load_model_config("tiny-qwen2.5"), load_model_config("tiny-qwen2.5-vl")
    assert text.model_type == load_model_config("qwen2.5-7b").model_type
    assert vl.model_type == load_model_config("qwen2.5-vl-7b").model_type
    assert count_params(text) < 20e6 and count_params(vl) < 20e6


def test_unknown_model_names_closest():
    with pytest.raises(UnknownModelError, match="did you mean qwen2.5-vl-7b"):
        get_model_spec("qwen2.5-vl7b")


def test_local_config_directory(tmp_path):
    load_model_config("tiny-qwen2.5").save_pretrained(tmp_path)
    config = load_model_config("ignored", str(tmp_path))
    assert count_params(config) == count_params(load_model_config("tiny-qwen2.5"))


def test_local_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model_config("x", str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config("x", str(tmp_path))
