"""The model's shape: the numbers of a decoder and its vision tower the memory model reads.

ModelShape holds a (Qwen2-family) decoder's numbers and a Qwen2.5-VL vision tower's, from the
registry or a local config.json (model_shape: no torch, no transformers), and counts their
parameters as torch does: the whole model, one rank's share of a tensor-parallel rollout
engine, PPO's critic (the decoder without the LM head plus a scalar head), LoRA's adapters.

The per-token terms are arithmetic on those numbers alone, the same for every phase:
activations follow Korthikanti et al. 2022 (arXiv:2205.05198) adapted to Qwen2's SwiGLU, GQA
and RMSNorm; the KV cache is 2 x layers x KV heads x head dim per token, as vLLM sizes it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.config import ALL_LINEAR, DECODER_LINEARS
from autotune.errors import ConfigError
from autotune.registry import get_model_spec, read_model_path_config


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a (Qwen2-family) decoder and its vision tower the memory model needs."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = True
    vision_hidden: int = 0  # 0: a text-only model
    vision_layers: int = 0
    vision_intermediate: int = 0
    vision_out_hidden: int = 0
    patch_px: int = 14
    merge: int = 2  # spatial merge: merge**2 patches make one LLM image token
    context_tokens: int = 32768  # max_position_embeddings: the longest sequence it takes

    @classmethod
    def from_dicts(cls, text: dict[str, Any], vision: dict[str, Any] | None = None,
                   tied_embeddings: bool = True) -> ModelShape:
        """From config.json-style dicts (a registry entry, or a local config.json)."""
        heads = int(text["num_attention_heads"])
        head_dim = text.get("head_dim") or int(text["hidden_size"]) // heads
        decoder = cls(hidden=int(text["hidden_size"]), layers=int(text["num_hidden_layers"]),
                      heads=heads, kv_heads=int(text.get("num_key_value_heads", heads)),
                      head_dim=int(head_dim), intermediate=int(text["intermediate_size"]),
                      vocab=int(text["vocab_size"]), tied_embeddings=bool(tied_embeddings),
                      context_tokens=int(text.get("max_position_embeddings") or 32768))
        if not vision:
            return decoder
        return dataclasses.replace(
            decoder, vision_hidden=int(vision["hidden_size"]), vision_layers=int(vision["depth"]),
            vision_intermediate=int(vision["intermediate_size"]),
            vision_out_hidden=int(vision.get("out_hidden_size", text["hidden_size"])),
            patch_px=int(vision.get("patch_size", 14)),
            merge=int(vision.get("spatial_merge_size", 2)))

    @property
    def is_vl(self) -> bool:
        return self.vision_layers > 0

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def root_params(self) -> int:
        """The embedding, and an untied LM head beside it (most of FSDP's root unit:
        root_unit_params)."""
        return self.embedding_params * (1 if self.tied_embeddings else 2)

    @property
    def root_unit_params(self) -> int:
        """What FSDP's root unit holds: the parameters outside the decoder layers and the
        vision blocks (probe/modeling/sharding.py wraps those alone), the embedding and an
        untied head, and a VL model's patch embedding and merger."""
        return self.root_params + sum(self.vision_merger_tensors)

    @property
    def layer_tensors(self) -> tuple[int, ...]:
        """One decoder layer's parameter tensors, in elements: q, k and v with their biases,
        o without, the SwiGLU MLP's gate, up and down, the two RMSNorms."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        inter = self.intermediate
        return (h * q, q, h * kv, kv, h * kv, kv, q * h, h * inter, h * inter, inter * h, h, h)

    @property
    def layer_params(self) -> int:
        return sum(self.layer_tensors)

    @property
    def vision_block_tensors(self) -> tuple[int, ...]:
        """One Qwen2.5-VL ViT block's parameter tensors: the two RMSNorms, qkv and proj with
        their biases, the SwiGLU MLP's gate, up and down with theirs (() for a text model)."""
        if not self.is_vl:
            return ()
        hv, iv = self.vision_hidden, self.vision_intermediate
        return (hv, hv, 3 * hv * hv, 3 * hv, hv * hv, hv, hv * iv, iv, hv * iv, iv, iv * hv, hv)

    @property
    def vision_merger_tensors(self) -> tuple[int, ...]:
        """The patch embedding, the final norm and the merger's two linear layers."""
        hv, merged = self.vision_hidden, self.vision_hidden * self.merge ** 2
        return (3 * 2 * self.patch_px ** 2 * hv, hv, merged * merged, merged,
                merged * self.vision_out_hidden, self.vision_out_hidden)

    @property
    def vision_params(self) -> int:
        """Qwen2.5-VL's ViT: patch embedding, blocks (qkv, proj, SwiGLU, all with bias), merger."""
        if not self.is_vl:
            return 0
        return self.vision_layers * sum(self.vision_block_tensors) \
            + sum(self.vision_merger_tensors)

    def engine_params(self, tensor_parallel: int = 1) -> int:
        """Parameters one rank's rollout engine holds with `tensor_parallel` ranks an engine,
        sharded as the probe shards it (sharding.tensor_parallel_engine): each decoder layer
        but its norms, the vision MLPs, and an untied embedding and LM head split tp ways."""
        hv, iv = self.vision_hidden, self.vision_intermediate
        split = self.layers * (self.layer_params - 2 * self.hidden)
        split += self.vision_layers * (2 * (hv * iv + iv) + iv * hv)
        if not self.tied_embeddings:
            split += 2 * self.embedding_params
        return self.num_params - split + split // tensor_parallel

    def lora_params(self, rank: int, targets: str) -> int:
        """LoRA adapters' parameters: rank x (in + out) features of each targeted linear layer
        of every decoder layer (q, k, v, o, gate, up, down; `all-linear` is all seven, peft's
        every linear layer but the LM head; the vision tower gets none), 0 at rank 0."""
        if not rank:
            return 0
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        inter = self.intermediate
        features = dict(zip(DECODER_LINEARS, (h + q, h + kv, h + kv, q + h, h + inter,
                                              h + inter, inter + h), strict=True))
        named = features if targets == ALL_LINEAR else {
            name: features.get(name, 0) for name in targets.split(",")}
        return self.layers * rank * sum(named.values())

    @property
    def critic_params(self) -> int:
        """PPO's value model: every parameter but an untied LM head, plus hidden x 1 and a
        bias (AutoModelForTokenClassification's score)."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.num_params - head + self.hidden + 1

    @property
    def num_params(self) -> int:
        """Every parameter, as torch counts them (tied embeddings once)."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return (self.embedding_params + head + self.layers * self.layer_params + self.hidden
                + self.vision_params)


def model_shape(name: str, model_path: str | None = None) -> ModelShape:
    """The memory model's ModelShape from the registry's or a local config.json's numbers,
    without importing torch or transformers."""
    if model_path is None:
        spec = get_model_spec(name)
        return ModelShape.from_dicts(spec.text_config, spec.vision_config,
                                     spec.tie_word_embeddings)
    path = Path(model_path) / "config.json"
    config = read_model_path_config(model_path)
    try:
        text = config.get("text_config") or config
        return ModelShape.from_dicts(
            {**config, **text}, config.get("vision_config"),
            config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))
    except (KeyError, TypeError, ValueError) as err:
        raise ConfigError(f"{path}: not a decoder config the memory model can read "
                          f"({type(err).__name__}: {err})") from None


def layer_activation_bytes_per_token(shape: ModelShape, bytes_per_element: int = 2,
                                     frozen_norms: bool = False) -> int:
    """Saved tensors of one Qwen2 layer per token: 20h + 4gd + 8I + 4a bytes in bf16.

    The formula counts bf16 tensors plus fp32 RMSNorm upcasts; in fp32 every tensor is twice
    as wide, so the whole is scaled by bytes_per_element / 2. With the RMSNorms' weights
    frozen (LoRA: peft freezes every base parameter), 16h: a norm's `weight * x.to(dtype)`
    keeps its cast input (2h bytes) only for the weight's gradient (autograd saves a mul's
    other operand only for an input that needs a gradient: derivatives.yaml, mul.Tensor).
    The trace of a 7B FSDP1 LoRA rank's update (held-out grid 3, row 00) saves 16.6h + 8I
    a token a layer.
    """
    h, d = shape.hidden, shape.head_dim
    bf16 = (16 if frozen_norms else 20) * h + 4 * shape.kv_heads * d \
        + 8 * shape.intermediate + 4 * shape.heads
    return bf16 * bytes_per_element // 2


def activation_bytes_per_token(shape: ModelShape, checkpointing: bool,
                               bytes_per_element: int = 2, recomputing: bool = True,
                               frozen_norms: bool = False) -> int:
    """All layers' saved activations per token; with checkpointing, each layer's input
    (h values) plus, in the backward (`recomputing`), one layer recomputed at a time."""
    layer = layer_activation_bytes_per_token(shape, bytes_per_element, frozen_norms)
    if checkpointing:
        return bytes_per_element * shape.hidden * shape.layers + (layer if recomputing else 0)
    return shape.layers * layer


def vision_activation_bytes_per_patch(shape: ModelShape, checkpointing: bool,
                                      bytes_per_element: int = 2,
                                      recomputing: bool = True) -> int:
    """Saved tensors of the ViT per patch: 24 hv + 8 Iv bytes per block in bf16 (with
    checkpointing, each block's input and, `recomputing`, one block's)."""
    block = (24 * shape.vision_hidden + 8 * shape.vision_intermediate) * bytes_per_element // 2
    if checkpointing:
        return bytes_per_element * shape.vision_hidden * shape.vision_layers + \
            (block if recomputing else 0)
    return shape.vision_layers * block


def kv_cache_bytes(shape: ModelShape, tokens: int, bytes_per_element: int = 2) -> int:
    """K and V of every layer for `tokens` tokens: 2 x bytes x L x kv_heads x head_dim each."""
    return 2 * bytes_per_element * shape.layers * shape.kv_heads * shape.head_dim * tokens


def forward_bytes_per_token(shape: ModelShape, bytes_per_element: int) -> int:
    """Live tensors of one layer's no-grad forward per token (SwiGLU's three I-wide tensors)."""
    return bytes_per_element * (4 * shape.hidden + 3 * shape.intermediate)
