"""The model registry: real architectures built from their transformers config, no download.

Each entry is the published config.json of the model (the dimensions that decide memory and
speed), so a probe builds the real architecture with random weights. `--model-path DIR` takes a
local checkpoint or config directory instead. torch and transformers are imported only by the
functions that need them, so listing the registry stays instant.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class ModelSpec:
    """A registry entry: the config that builds the architecture and the card's parameter count."""

    name: str
    hf_id: str
    kind: str  # "text" or "vl"
    text_config: dict[str, Any]
    vision_config: dict[str, Any] | None = None
    card_params: float | None = None  # billions, as the model card states them
    tie_word_embeddings: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # top-level config keys (VL token ids)
    tiny: bool = False  # a CPU-sized variant for tests and demos

    @property
    def is_vl(self) -> bool:
        return self.kind == "vl"


def _text(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int,
          **overrides: Any) -> dict[str, Any]:
    return {**_QWEN_TEXT_COMMON, "hidden_size": h, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv,
            "intermediate_size": inter, "vocab_size": vocab, **overrides}


def _vl_text(text: dict[str, Any]) -> dict[str, Any]:
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


def load_model_config(name: str, model_path: str | None = None) -> Any:
    """The transformers config of a registry model, or of a local directory's config.json."""
    if model_path is not None:
        return _load_local_config(model_path)
    spec = get_model_spec(name)
    if spec.is_vl:
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig(text_config=dict(spec.text_config),
                                vision_config=dict(spec.vision_config or {}),
                                tie_word_embeddings=spec.tie_word_embeddings, **spec.extra)
    from transformers import Qwen2Config

    return Qwen2Config(**spec.text_config, tie_word_embeddings=spec.tie_word_embeddings)


def _load_local_config(model_path: str) -> Any:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model-path {model_path}: no config.json there; pass a directory "
                          "holding a Hugging Face checkpoint or at least its config.json")
    try:
        json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path / 'config.json'}: not valid JSON ({err})") from None
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def is_vl_config(model_config: Any) -> bool:
    return getattr(model_config, "model_type", "") in ("qwen2_5_vl", "qwen2_vl")


def has_weights(model_path: str | None) -> bool:
    if model_path is None:
        return False
    path = Path(model_path)
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def model_class(model_config: Any) -> Any:
    """The transformers class that trains this config (causal LM, or Qwen-VL generation)."""
    if getattr(model_config, "model_type", "") == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    if getattr(model_config, "model_type", "") == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def count_params(model_config: Any) -> int:
    """Parameter count of the architecture, built on the meta device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        model = _instantiate(model_config, torch.float32)
    return sum(p.numel() for p in model.parameters())


def build_model(model_config: Any, device: Any, dtype: Any, model_path: str | None = None) -> Any:
    """Build the model directly on `device` in `dtype`: random weights, or the checkpoint's.

    Weights are initialised where they live (never a full CPU init of a GPU model), so a 7B
    model builds in seconds on a GPU.
    """
    import torch

    if has_weights(model_path):
        cls = model_class(model_config)
        return cls.from_pretrained(model_path, dtype=dtype, device_map=str(device),
                                   local_files_only=True)
    with torch.device(device):
        return _instantiate(model_config, dtype)


def _instantiate(model_config: Any, dtype: Any) -> Any:
    import torch

    cls = model_class(model_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if hasattr(cls, "from_config"):
            return cls.from_config(model_config, dtype=dtype)
        return cls(model_config)
    finally:
        torch.set_default_dtype(previous)


def model_shape(name: str, model_path: str | None = None) -> Any:
    """The memory model's ModelShape from the registry's or a local config.json's numbers,
    without importing torch or transformers."""
    from autotune.memory import ModelShape

    if model_path is None:
        spec = get_model_spec(name)
        return ModelShape.from_dicts(spec.text_config, spec.vision_config,
                                     spec.tie_word_embeddings)
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model-path {model_path}: no config.json there; pass a directory "
                          "holding a Hugging Face checkpoint or at least its config.json")
    try:
        config = json.loads(path.read_text())
        text = config.get("text_config") or config
        return ModelShape.from_dicts(
            {**config, **text}, config.get("vision_config"),
            config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{path}: not a decoder config the memory model can read "
                          f"({type(err).__name__}: {err})") from None
