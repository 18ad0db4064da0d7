"""Building a probe as the trainer builds its workers: the actor, its AdamW, the reference, the
critic, the prompts, every state where its offload switches put it, and last the rollout engine.

The actor is fp32 from the request's seed, checkpointed, with LoRA's adapters where asked,
FSDP-sharded over the ranks (modeling/sharding.py), its shards then laid out together as the
trainers' are (Build._pack_shards); the reference and the engine's copy are
compute-dtype models holding the actor's weights; PPO's critic is the actor's architecture
with a scalar head and its own AdamW (modeling/critic.py). The engine starts last, so that
vLLM's start-up check sees what the trainer already holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import torch

from autotune.config import device_problems, model_problems, validate_probe_config
from autotune.errors import ConfigError
from autotune.probe.modeling.critic import ValueModel, enable_checkpointing
from autotune.probe.modeling.lora import apply_lora, trained_parameters
from autotune.probe.modeling.models import build_model, synthetic_prompt_ids
from autotune.probe.modeling.sharding import (
    join_group,
    local_tensor,
    named_weights,
    shard_model,
    tensor_parallel_engine,
)
from autotune.probe.modeling.ulysses import install_attention, sequence_group
from autotune.probe.step.engine import PolicyRollout, Rollout, RolloutEngine, engine_capacity_bytes
from autotune.probe.step.offload import Offload
from autotune.probe.step.vllm_engine import VllmEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Build(Offload):
    """build(): the actor, its AdamW, the reference, the critic, the prompts, the engine."""

    def build(self) -> None:
        """Check the config, then build as the trainer does: the actor (sharded over the
        ranks), its AdamW, the reference, the critic, the prompts, every state where its
        offload switches put it between steps, and last the rollout engine, which starts
        (vLLM's start-up check sees what the trainer holds)."""
        self._build_trained()
        self.engine = self._build_engine()
        self.engine.start(self._profile_inputs)

    def _build_trained(self) -> None:
        """Everything but the engine: the config checked, the ranks joined, the trained
        models, their optimizers and the prompts, each state where its offload puts it."""
        config = self.config
        self._check()
        if self.request.world_size > 1:
            self.group = join_group(self.request.world_size, self.request.emulated, self.device)
        if config.ulysses_sequence_parallel_size > 1:
            assert self.group is not None  # config rules: sp divides W, so W > 1
            install_attention()
            self.sequence_group = sequence_group(config.ulysses_sequence_parallel_size,
                                                 self.group.rank, self.group.world_size,
                                                 self.group.emulated)
        self._build_actor()
        self.ref_model = self._build_copy(shard=True) if config.holds_ref_copy else None
        if config.has_critic:
            self._build_critic()
        self._make_prompts()
        if self.group is not None:
            self._pack_shards()
        self._place_actor(params_on_device=not config.offload_params,
                          optimizer_on_device=not config.offload_optimizer)
        if self.critic is not None:
            self._place_states(self.critic, self.critic_optimizer,
                               not config.critic_offload_params,
                               not config.critic_offload_optimizer)

    def _pack_shards(self) -> None:
        """The sharded models' shards laid out on the device as the trainers lay them out.
        verl shards a model on the host (rank 0) or the meta device (the others) and then
        moves the shards to the device (fsdp_utils.fsdp2_load_full_state_dict:
        `model.to(device)` or `to_empty`); EasyR1's FSDP1 (enable_rank0_init) materialises
        one unit at a time on the device (param_init_fn) and shards it. Either way each
        rank's shards sit together. The probe builds the whole model on the device and
        shards it there (quicker), which carves each shard out of the freed full model:
        holes an expandable segment keeps mapped through the run (held-out H200 grid 3,
        row 09: 1.6 GiB of them in the experience of a 1.5B FSDP2 rank of 2, traced). So
        the shards go to plain host memory and back, the cache emptied between."""
        models = [m for m in (self.model, self.ref_model, self.critic) if m is not None]
        for model in models:
            self._place_module(model, False, pinned=False)
        self.meter.release_cache()
        for model in models:
            self._place_module(model, True)

    def _check(self) -> None:
        """A ConfigError with every problem of the config for this model and device."""
        request, config = self.request, self.config
        problems = self._run_problems()
        heads = (self.text_config.num_attention_heads, self.text_config.num_key_value_heads)
        problems += model_problems(config, self.is_vl, heads)
        if self.meter.runs_kernels:  # a trace runs neither Triton nor vLLM
            problems += device_problems(config, self.on_gpu, self.is_vl,
                                        request.device.cap_bytes is not None)
        if problems:
            raise ConfigError(problems)

    def _run_problems(self) -> list[str]:
        """The config's rules on the run this probe is a share of (a split probe's side is
        a share of a run its launcher checked: none there)."""
        return validate_probe_config(self.config, self.request.world_size)

    def _build_actor(self) -> None:
        """The actor in fp32 from the request's seed, its checkpointing, FSDP-sharded over
        the ranks, with its AdamW."""
        config = self.config
        torch.manual_seed(self.request.seed)
        self.model = build_model(self.model_config, self.device, torch.float32,
                                 self.request.model_path)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        if config.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model.config.use_cache = False
        if config.uses_lora:  # adapters trained, the base frozen (lora.py)
            self.model = cast("PreTrainedModel", apply_lora(self.model, config, self.is_vl))
        self.model.eval()  # as between steps (the update trains, then evaluates): a policy
        # that generates itself keeps its KV cache (HF drops it in training with checkpointing)
        if self.group is not None:
            self.model = shard_model(self.model, self.group, self.compute_dtype,
                                     config.fsdp_strategy, lora=config.uses_lora)
        self.optimizer = self._adamw(trained_parameters(self.model), lr=1e-6)

    def _build_engine(self) -> Rollout:
        """The rollout engine (engine.py): the real vLLM, the actor generating itself, or a
        compute-dtype copy of the actor, split over `rollout_tensor_parallel` ranks."""
        config, request = self.config, self.request
        capacity = engine_capacity_bytes(config, request.device)
        if config.runs_real_vllm:
            names = [name for name, _ in named_weights(self.model)]
            return VllmEngine(self.model_config, config, self.device, self.compute_dtype,
                              capacity, self.meter, names, self.num_params, request.seed)
        if config.actor_generates:
            return PolicyRollout(self.model, self.model_config, config, self.device,
                                 self.compute_dtype, False, capacity, self._move, self.meter)
        engine = self._build_copy(shard=False)
        engine_tp = config.rollout_tensor_parallel > 1
        if engine_tp:
            assert self.group is not None  # config rules: tensor parallel spans ranks
            tensor_parallel_engine(engine, self.group, config.rollout_tensor_parallel)
            for param in engine.parameters():  # each shard owns its memory
                local_tensor(param).data = local_tensor(param).clone()
        return RolloutEngine(engine, self.model_config, config, self.device, self.compute_dtype,
                             engine_tp, capacity, self._move, self.meter)

    def _build_critic(self) -> None:
        """The value model: the actor's architecture in fp32 with a scalar head (critic.py),
        its own checkpointing, FSDP-sharded like the actor, with its own AdamW."""
        torch.manual_seed(self.request.seed + 1)
        lm = build_model(self.model_config, self.device, torch.float32, self.request.model_path)
        self.critic = ValueModel(lm)
        del lm
        if self.config.critic_gradient_checkpointing:
            enable_checkpointing(self.critic)
        if self.group is not None:
            self.critic = shard_model(self.critic, self.group, self.compute_dtype,
                                      self.config.fsdp_strategy)
        self.critic.eval()
        self.critic_optimizer = self._adamw(self.critic.parameters(), lr=1e-5)

    def _adamw(self, params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
        """AdamW as the trainer builds it: fused (fused_optimizer), else torch's default
        step: foreach with a GPU's kernels, a loop per tensor on a CPU."""
        if self.config.fused_optimizer:
            return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, fused=True)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01,
                                 foreach=True if self.gpu_kernels else None)

    def _build_copy(self, shard: bool) -> PreTrainedModel:
        """A compute-dtype model that holds the actor's weights (reference or rollout engine);
        with FSDP, the reference is sharded like the actor and built from the same seed."""
        if self.group is None and not self.config.uses_lora:
            copy = build_model(self.model_config, self.device, self.compute_dtype)
            copy.load_state_dict(self.model.state_dict())
            return copy.eval().requires_grad_(False)
        torch.manual_seed(self.request.seed)  # the actor's initial weights, in this dtype
        copy = build_model(self.model_config, self.device, self.compute_dtype,
                           self.request.model_path)
        copy.eval().requires_grad_(False)
        if shard and self.group is not None:
            copy = shard_model(copy, self.group, self.compute_dtype, self.config.fsdp_strategy)
        return copy

    def _profile_inputs(self, rows: int) -> dict[str, torch.Tensor]:
        """`rows` prompts for the engine's profile run (the probe's own, repeated)."""
        index = torch.arange(rows) % len(self.prompt_ids)
        return {"input_ids": self.prompt_ids[index].to(self.device), **self._vl_inputs(index)}

    def _make_prompts(self) -> None:
        config, generator = self.config, torch.Generator().manual_seed(self.request.seed)
        prompts = max(self.share.prompts_per_step, self.share.val_prompts)
        ids = synthetic_prompt_ids(self.model_config, prompts, config.max_prompt_length,
                                   generator)
        self.pixel_values = None
        if self.is_vl:
            mc = self.model_config
            ids[:, 0] = mc.vision_start_token_id
            ids[:, 1:1 + self.image_tokens] = mc.image_token_id
            ids[:, 1 + self.image_tokens] = mc.vision_end_token_id
            patches = (config.image_size_px // 14) ** 2
            self.grid_side = config.image_size_px // 14
            self.pixel_values = torch.randn(prompts, patches, 3 * 2 * 14 * 14,
                                            generator=generator)
        self.prompt_ids = ids
