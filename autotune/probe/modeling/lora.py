"""LoRA on the actor, as the trainers run it (verl's `lora_rank`, EasyR1's `lora.rank`, TRL's
`peft_config`): peft's adapters on the chosen linear layers, the base weights frozen.

- The base stays in fp32 (the trainers load the actor in fp32 and shard it with FSDP), frozen:
  no gradients and no AdamW state for it; the adapters are trained (fp32 params, grads, AdamW).
- The reference model is the actor with its adapters off (verl's `ref_in_actor`, EasyR1's and
  TRL's peft path): no second copy of the weights.
- FSDP1 cannot mix frozen and trained parameters in one flat parameter (use_orig_params=False):
  every module with a trained weight and no children is a unit of its own, verl's wrap policy
  for LoRA (verl/utils/fsdp_utils.py get_fsdp_wrap_policy, `is_lora`).
- The engine holds the base architecture: its weights are the base layers' (the adapters are
  zero at start; the trainers sync adapters, a few MB, not the base).
- A VL model's vision tower gets no adapters (EasyR1's default `exclude_modules: .*visual.*`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast
from unittest import mock

import torch

from autotune.config import ALL_LINEAR, ProbeConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

PEFT_PREFIX = "base_model.model."  # peft's path to the wrapped model
BASE_LAYER = ".base_layer"  # a LoRA layer's wrapped linear
VISION_MODULES = r".*visual.*"  # no adapters on a VL model's vision tower (EasyR1's default)


def apply_lora(model: torch.nn.Module, config: ProbeConfig, is_vl: bool) -> torch.nn.Module:
    """`model` with peft's LoRA adapters on `config.lora_target_modules`, base frozen."""
    from peft import LoraConfig, get_peft_model

    named = config.lora_target_modules
    targets = named if named == ALL_LINEAR else named.split(",")
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=0.0,
                      target_modules=targets, bias="none",
                      exclude_modules=VISION_MODULES if is_vl else None)
    # the adapters made where the base lives, in its fp32: peft's moves of modules to the
    # base's device are then nothing to do, and skipped (a module move swaps a traced model's
    # fake tensors, which the trace's weak references pin)
    module_to = torch.nn.Module.to

    def to_where_needed(module: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if all((device is None or p.device == device) and (dtype is None or p.dtype == dtype)
               for p in module.parameters()):
            return module
        return module_to(module, *args, **kwargs)

    with torch.device(next(model.parameters()).device), \
            mock.patch.object(torch.nn.Module, "to", to_where_needed):
        return get_peft_model(cast("PreTrainedModel", model), lora)


def base_name(name: str) -> str:
    """A parameter's name in the base model: the name the engine's weights have."""
    return name.removeprefix(PEFT_PREFIX).replace(BASE_LAYER, "")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is a LoRA adapter's (lora_A, lora_B)."""
    return ".lora_A." in name or ".lora_B." in name


def trained_leaf(module: torch.nn.Module) -> bool:
    """verl's FSDP1 wrap rule for LoRA: a module with no children whose weight is trained."""
    weight = getattr(module, "weight", None)
    return not any(True for _ in module.children()) and isinstance(weight, torch.Tensor) \
        and weight.requires_grad


def trained_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them, or with LoRA the adapters."""
    return [p for p in model.parameters() if p.requires_grad]


def adapters_off(model: torch.nn.Module) -> AbstractContextManager[None]:
    """The actor as the reference: peft's adapters switched off for the forwards inside
    (through an FSDP1 wrapper, which reads the attribute through to the model)."""
    peft_model = cast("PeftModel", model)  # or an FSDP1 wrapper that reads it through
    return cast(AbstractContextManager[None], peft_model.disable_adapter())
