"""PPO's critic as verl and EasyR1 build it: the actor's architecture with a scalar value head.

verl's CriticWorker loads `AutoModelForTokenClassification(num_labels=1)` (verl/utils/model.py
load_valuehead_model; EasyR1's fsdp_workers.py the same class): the decoder (and vision tower)
without the LM head, and a fresh `score` layer of hidden x 1. Its master weights are fp32,
sharded by FSDP like the actor's, its AdamW state its own; it computes in the mixed-precision
dtype. `ValueModel` is that model, built from the actor's causal-LM class so that every model
the probe builds has a critic (Qwen2.5-VL included: its backbone takes the image).

The loss is verl's `compute_value_loss` (trainer/ppo/core_algos.py): values clipped to within
`cliprange_value` of the old ones, the larger of the two squared errors, half the token mean.
Advantages are GAE with verl's defaults (gamma = lambda = 1: each token's return is the
response's reward), whitened over the response tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CLIP_VALUE = 0.5  # verl's and EasyR1's critic.cliprange_value


class ValueModel(torch.nn.Module):
    """A causal LM's backbone with a scalar head: one value per token, [batch, tokens]."""

    def __init__(self, causal_lm: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = causal_lm.model  # the decoder (and vision tower): no LM head
        self.config = causal_lm.config
        hidden = int(getattr(self.config, "text_config", self.config).hidden_size)
        self.score = torch.nn.Linear(hidden, 1, device=next(self.backbone.parameters()).device,
                                     dtype=next(self.backbone.parameters()).dtype)
        # FSDP wraps the same units as the actor's (sharding.shard_model reads this)
        self._no_split_modules = list(getattr(causal_lm, "_no_split_modules", None) or ())

    def forward(self, input_ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, use_cache=False, **inputs)[0]
        return self.score(hidden).squeeze(-1)


def enable_checkpointing(critic: ValueModel) -> None:
    """Recompute the backbone's activations in the backward (the critic's own switch)."""
    backbone, kwargs = critic.backbone, {"use_reentrant": False}
    if hasattr(backbone, "activation_checkpointing_enable"):  # transformers >= 5.x
        backbone.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def gae_advantages(rewards: torch.Tensor, values: torch.Tensor, valid: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, [responses, tokens], from each response's reward and the
    critic's values, with gamma = lambda = 1 (verl's defaults): the return of every token is
    the reward; the advantage, return minus value, whitened over the valid tokens."""
    returns = rewards.unsqueeze(-1).expand_as(values) * valid
    advantages = (returns - values) * valid
    count = valid.sum().clamp(min=1)
    mean = advantages.sum() / count
    std = (((advantages - mean) * valid) ** 2).sum().div(count).sqrt()
    return (advantages - mean) / (std + 1e-8) * valid, returns


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               valid: torch.Tensor) -> torch.Tensor:
    """verl's clipped value loss, token-mean over the valid tokens."""
    clipped = old_values + (values - old_values).clamp(-CLIP_VALUE, CLIP_VALUE)
    losses = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * (losses * valid).sum() / valid.sum().clamp(min=1)
