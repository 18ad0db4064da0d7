"""The memory model: bytes per GPU from plain numbers, no torch (issue 4, first part).

Model states follow the standard mixed-precision Adam accounting as verl and EasyR1 run it
(actor in fp32, FSDP full sharding over N GPUs): 4 bytes of fp32 params, 4 of fp32 grads and
8 of Adam m and v per parameter, 16 in all, divided by N. Offload (verl/EasyR1 semantics)
moves params and optimizer state to host *between* phases: it lowers the rollout and log-prob
phases, never the update. Activation and logits bytes follow
shared/reference/memory-and-throughput.md sections 2.2 and 2.3; the KV cache section 4.1.
Per-phase composition, calibration and `autotune estimate` build on these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PARAM_BYTES = 4  # fp32 master params
GRAD_BYTES = 4  # fp32 grads (FSDP reduces in fp32)
ADAM_BYTES = 8  # fp32 m and v
STATE_BYTES_PER_PARAM = PARAM_BYTES + GRAD_BYTES + ADAM_BYTES  # 16: the ZeRO paper's 2+2+12


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder the memory model needs, read from its config."""

    num_params: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Any, num_params: int) -> ModelShape:
        """From a Hugging Face config (Qwen2, or Qwen2.5-VL's text part)."""
        text = getattr(config, "text_config", None) or config
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(num_params=num_params, hidden=text.hidden_size,
                   layers=text.num_hidden_layers, heads=heads,
                   kv_heads=text.num_key_value_heads, head_dim=head_dim,
                   intermediate=text.intermediate_size, vocab=text.vocab_size)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on one GPU, in the update and between phases, and on the host."""

    update_bytes: int  # params + grads + Adam state during the update
    resident_bytes: int  # what stays on the GPU between phases (grads freed)
    host_offload_bytes: int  # what offload holds in host memory for this GPU


def model_state_bytes(num_params: int, num_gpus: int = 1, offload_params: bool = False,
                      offload_optimizer: bool = False) -> ModelStates:
    """16 bytes per parameter in the update, sharded over `num_gpus` (FSDP / ZeRO-3)."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus}: need at least one GPU")
    params = PARAM_BYTES * num_params // num_gpus
    grads = GRAD_BYTES * num_params // num_gpus
    adam = ADAM_BYTES * num_params // num_gpus
    offloaded = (params if offload_params else 0) + (adam if offload_optimizer else 0)
    return ModelStates(update_bytes=params + grads + adam,
                       resident_bytes=params + adam - offloaded,
                       host_offload_bytes=offloaded)


def layer_activation_bytes_per_token(shape: ModelShape, bytes_per_element: int = 2) -> int:
    """Saved tensors of one Qwen2 layer per token: 20h + 4gd + 8I + 4a bytes in bf16.

    The formula counts bf16 tensors plus fp32 RMSNorm upcasts; in fp32 every tensor is twice
    as wide, so the whole is scaled by bytes_per_element / 2.
    """
    h, d = shape.hidden, shape.head_dim
    bf16 = 20 * h + 4 * shape.kv_heads * d + 8 * shape.intermediate + 4 * shape.heads
    return bf16 * bytes_per_element // 2


def activation_bytes_per_token(shape: ModelShape, checkpointing: bool,
                               bytes_per_element: int = 2) -> int:
    """All layers' saved activations per token; with checkpointing, each layer's input
    (h values) plus one layer recomputed at a time."""
    layer = layer_activation_bytes_per_token(shape, bytes_per_element)
    if checkpointing:
        return bytes_per_element * shape.hidden * shape.layers + layer
    return shape.layers * layer


def logits_bytes_per_token(shape: ModelShape, backward: bool,
                           bytes_per_element: int = 2) -> int:
    """The [tokens, vocab] logits: the tensor itself, plus its gradient in the update."""
    return (2 if backward else 1) * bytes_per_element * shape.vocab


def kv_cache_bytes(shape: ModelShape, tokens: int, bytes_per_element: int = 2) -> int:
    """K and V of every layer for `tokens` tokens: 2 x bytes x L x kv_heads x head_dim each."""
    return 2 * bytes_per_element * shape.layers * shape.kv_heads * shape.head_dim * tokens
