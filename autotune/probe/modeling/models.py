"""Real architectures built from their transformers config: random weights, no download.

A registry entry (registry.py) or a local checkpoint's config.json becomes a transformers
config, then a model built directly on its device; a local checkpoint's weights are loaded
when it has them. torch and transformers are imported only inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from autotune.registry import get_model_spec, read_model_path_config

if TYPE_CHECKING:
    import torch
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


def load_model_config(name: str, model_path: str | None = None) -> PretrainedConfig:
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


def _load_local_config(model_path: str) -> PretrainedConfig:
    read_model_path_config(model_path)  # one clear line before transformers reads it
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_path), local_files_only=True)


def is_vl_config(model_config: PretrainedConfig) -> bool:
    return getattr(model_config, "model_type", "") in ("qwen2_5_vl", "qwen2_vl")


def has_weights(model_path: str | None) -> bool:
    if model_path is None:
        return False
    path = Path(model_path)
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def model_class(model_config: PretrainedConfig
                ) -> type[PreTrainedModel] | type[AutoModelForCausalLM]:
    """The transformers class that trains this config (causal LM, or Qwen-VL generation)."""
    if getattr(model_config, "model_type", "") == "qwen2_5_vl":
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration
    if getattr(model_config, "model_type", "") == "qwen2_vl":
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def count_params(model_config: PretrainedConfig) -> int:
    """Parameter count of the architecture, built on the meta device (no memory, no init)."""
    import torch

    with torch.device("meta"):
        model = _instantiate(model_config, torch.float32)
    return sum(p.numel() for p in model.parameters())


def build_model(model_config: PretrainedConfig, device: torch.device, dtype: torch.dtype,
                model_path: str | None = None) -> PreTrainedModel:
    """Build the model directly on `device` in `dtype`: random weights, or the checkpoint's.

    Weights are initialised where they live (never a full CPU init of a GPU model), so a 7B
    model builds in seconds on a GPU.
    """
    import torch

    if model_path is not None and has_weights(model_path):
        cls = model_class(model_config)
        return cls.from_pretrained(model_path, dtype=dtype, device_map=str(device),
                                   local_files_only=True)
    with torch.device(device):
        return _instantiate(model_config, dtype)


def _instantiate(model_config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
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


def special_token_ids(model_config: PretrainedConfig) -> set[int]:
    """Every `*_token_id` the config names (its text config's too): BOS, EOS, padding, and a
    VL model's image, video and vision frame tokens."""
    ids: set[int] = set()
    for config in (model_config, getattr(model_config, "text_config", None)):
        for name, value in (vars(config).items() if config is not None else ()):
            if not name.endswith("token_id"):
                continue
            for item in value if isinstance(value, list | tuple) else [value]:
                if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
                    ids.add(item)
    return ids


def synthetic_prompt_ids(model_config: PretrainedConfig, rows: int, length: int,
                         generator: torch.Generator) -> torch.Tensor:
    """[rows, length] random prompt ids that are never a special token: drawn below the
    added-token block at the top of the vocabulary (Qwen's start at <|endoftext|>), with a
    special id lower down replaced (an image token in a prompt would make a VL model expect
    image features for it)."""
    import torch

    vocab = int(getattr(model_config, "text_config", model_config).vocab_size)
    high = min([s for s in special_token_ids(model_config) if s >= vocab // 2] + [vocab])
    return without_special_ids(torch.randint(0, high, (rows, length), generator=generator),
                               model_config)


def without_special_ids(ids: torch.Tensor, model_config: PretrainedConfig) -> torch.Tensor:
    """`ids` with every special token id replaced by the first ordinary id: what a
    random-weight model generates can be an image token, which a real run's would not."""
    import torch

    specials = special_token_ids(model_config)
    if not specials:
        return ids
    ordinary = next(i for i in range(len(specials) + 1) if i not in specials)
    special = torch.isin(ids, torch.tensor(sorted(specials), device=ids.device))
    return torch.where(special, torch.full_like(ids, ordinary), ids)
