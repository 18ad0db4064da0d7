"""The model registry: the published config numbers of each supported model, by name.

Each entry is the model's config.json (the dimensions that decide memory and speed), so a
probe builds the real architecture with random weights and the memory model reads the same
numbers; nothing is downloaded. Plain data: no torch, no transformers. Imports config and
errors only.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias

from autotune.errors import ConfigError, UnknownModelError

_QWEN_TEXT_COMMON = {
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151643,
}
_QWEN_VL_VISION = {
    "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
    "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3, "hidden_act": "silu",
}
_QWEN_VL_TOKENS = {
    "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
}


# a model's config.json as transformers reads it (and as Hugging Face publishes it): a
# foreign document whose values are whatever each architecture keeps there
HFConfig: TypeAlias = "dict[str, Any]"


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: the config that builds the architecture and the card's parameter count."""

    name: str
    hf_id: str
    kind: str  # "text" or "vl"
    text_config: HFConfig
    vision_config: HFConfig | None = None
    card_params: float | None = None  # billions, as the model card states them
    tie_word_embeddings: bool = True
    extra: HFConfig = field(default_factory=dict)  # top-level config keys (VL token ids)
    tiny: bool = False  # a CPU-sized variant for tests and demos

    @property
    def is_vl(self) -> bool:
        return self.kind == "vl"


def _text(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int,
          **overrides: float) -> HFConfig:
    return {**_QWEN_TEXT_COMMON, "hidden_size": h, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": inter, "vocab_size": vocab, **overrides}


def _vl_text(text: HFConfig) -> HFConfig:
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    unit = head_dim // 16  # mrope splits head_dim/2 as 1/4, 3/8, 3/8: (16, 24, 24) for 128
    return {**text, "rope_scaling": {"type": "mrope", "mrope_section":
                                     [2 * unit, 3 * unit, 3 * unit]}}


_TINY_TEXT = _text(256, 4, 4, 2, 768, 16384, max_position_embeddings=8192,
                   bos_token_id=16380, eos_token_id=16380)

REGISTRY: dict[str, ModelSpec] = {spec.name: spec for spec in [
    ModelSpec("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct", "text",
              _text(896, 24, 14, 2, 4864, 151936), card_params=0.494),
    ModelSpec("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct", "text",
              _text(1536, 28, 12, 2, 8960, 151936), card_params=1.544),
    ModelSpec("qwen2.5-3b", "Qwen/Qwen2.5-3B-Instruct", "text",
              _text(2048, 36, 16, 2, 11008, 151936), card_params=3.086),
    ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", "text",
              _text(3584, 28, 28, 4, 18944, 152064), card_params=7.616,
              tie_word_embeddings=False),
    ModelSpec("qwen2.5-7b-instruct-1m", "Qwen/Qwen2.5-7B-Instruct-1M", "text",
              _text(3584, 28, 28, 4, 18944, 152064, rope_theta=10_000_000.0,
                    max_position_embeddings=1_010_000), card_params=7.616,
              tie_word_embeddings=False),
    ModelSpec("qwen2.5-vl-3b", "Qwen/Qwen2.5-VL-3B-Instruct", "vl",
              _vl_text(_text(2048, 36, 16, 2, 11008, 151936, max_position_embeddings=128000)),
              {**_QWEN_VL_VISION, "out_hidden_size": 2048}, card_params=3.755,
              extra=_QWEN_VL_TOKENS),
    ModelSpec("qwen2.5-vl-7b", "Qwen/Qwen2.5-VL-7B-Instruct", "vl",
              _vl_text(_text(3584, 28, 28, 4, 18944, 152064, max_position_embeddings=128000)),
              {**_QWEN_VL_VISION, "out_hidden_size": 3584}, card_params=8.292,
              tie_word_embeddings=False, extra=_QWEN_VL_TOKENS),
    ModelSpec("tiny-qwen2.5", "(tiny Qwen2 architecture)", "text", _TINY_TEXT, tiny=True),
    ModelSpec("tiny-qwen2.5-vl", "(tiny Qwen2.5-VL architecture)", "vl", _vl_text(_TINY_TEXT),
              {**_QWEN_VL_VISION, "depth": 2, "hidden_size": 64, "intermediate_size": 128,
               "num_heads": 2, "fullatt_block_indexes": [1], "out_hidden_size": 256},
              extra={"image_token_id": 16383, "video_token_id": 16382,
                     "vision_start_token_id": 16381, "vision_end_token_id": 16379},
              tiny=True),
]}


def get_model_spec(name: str) -> ModelSpec:
    """The registry entry for `name`, or one line naming the closest entries."""
    if name in REGISTRY:
        return REGISTRY[name]
    close = difflib.get_close_matches(name.lower(), list(REGISTRY), n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise UnknownModelError(
        f"unknown model {name!r}: {hint}see `autotune models`, or pass --model-path DIR "
        "for a local checkpoint or config directory")




def read_model_path_config(model_path: str) -> HFConfig:
    """The config.json of a local checkpoint or config directory, checked before any probe;
    one line when the directory or its config.json is missing or not JSON."""
    path = Path(model_path)
    if not path.is_dir():
        raise ConfigError(f"--model-path {model_path}: no such directory; pass a directory "
                          "holding a Hugging Face checkpoint or at least its config.json")
    config_json = path / "config.json"
    if not config_json.is_file():
        raise ConfigError(f"--model-path {model_path}: no config.json there; pass a directory "
                          "holding a Hugging Face checkpoint or at least its config.json")
    try:
        data = json.loads(config_json.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{config_json}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{config_json}: expected a JSON object of config keys")
    return data


# the config numbers that decide a model's memory and speed: two models with the same are
# the same run for autotune (a base model and its instruct tune)
ARCHITECTURE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "vocab_size")


def architecture_of(model: str) -> dict[str, int | None] | None:
    """The architecture numbers of a model as a trainer config names it: a registry name, a
    Hugging Face id of a registry model (its base or instruct variant), or a local directory
    with a config.json; None when autotune cannot tell."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        try:
            data = json.loads((path / "config.json").read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(data, dict):
            return None
        text = {**data, **(data.get("text_config") or {})}
        return {key: text.get(key) for key in ARCHITECTURE_KEYS}
    wanted = _variant(model)
    for spec in REGISTRY.values():
        if wanted in (spec.name, _variant(spec.hf_id)):
            return {key: spec.text_config.get(key) for key in ARCHITECTURE_KEYS}
    return None


def _variant(name: str) -> str:
    """'Qwen/Qwen2.5-7B-Instruct' -> 'qwen2.5-7b': the repository's name, lowercased, without
    the instruct suffix (a tune keeps its base model's shapes)."""
    return name.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix("-instruct")
