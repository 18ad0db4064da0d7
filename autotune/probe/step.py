"""The built-in GRPO probe: real training steps of a colocated GRPO trainer, measured.

One step has the phases of EasyR1/verl's hybrid engine: rollout (a rollout engine holding a
compute-dtype copy of the weights generates `rollout_n` responses per prompt, always to
`max_response_length`, with vLLM's memory or HF generation's, or the actor generates itself
as TRL's does: engine.py), experience (the
old log-prob forward unless `old_logprob_pass` is off, as TRL runs one optimizer step a
generation, and the reference's), update (mini-batches of micro-batches with gradient
accumulation, a GRPO loss, an AdamW step, fused or torch's default) and, when
`val_batch_size` is set, validation
generation. The actor keeps fp32 master weights and AdamW
state as verl and EasyR1 do (16 bytes per parameter during the update), computes in bf16 on a
GPU, and offload moves params / optimizer state to host memory between phases. It runs one
GPU's share of each batch of a run on `request.world_size` GPUs (config.device_share), and
reports the share it ran. With W > 1 the actor and reference are FSDP2-sharded over W ranks
(sharding.py), real peers or emulated ones; the rollout engine holds a compute-dtype copy on
each rank, whole or split over `rollout_tensor_parallel` ranks, gathered from the actor's
shards at each wake-up.

PPO (`algorithm=ppo`) adds the critic on the same GPUs, as verl's and EasyR1's trainers run it
(critic.py): built and sharded like the actor, with its own AdamW; the experience phase
forwards it for the values (its params loaded from the host first where it offloads them,
its optimizer state left where it is), and its own phase, `critic_update`, trains it before
the actor's update (RayPPOTrainer.fit: update_critic, then update_actor) with the actor's
mini-batches cut into its own micro-batches or token budget; between phases its params and
optimizer state sit where its own offload switches put them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

import torch

from autotune.batching import micro_batches
from autotune.config import (
    KnobValue,
    ProbeConfig,
    compute_dtype,
    device_problems,
    device_share,
    image_tokens,
    model_problems,
    validate_probe_config,
)
from autotune.errors import ConfigError
from autotune.memory.allocator import AllocatorSettings
from autotune.probe.critic import ValueModel, enable_checkpointing, gae_advantages, value_loss
from autotune.probe.engine import (
    PolicyRollout,
    Rollout,
    RolloutEngine,
    engine_capacity_bytes,
)
from autotune.probe.logprob import entropy, fused_head
from autotune.probe.lora import adapters_off, apply_lora, trained_parameters
from autotune.probe.machine import MachineWatch
from autotune.probe.meter import (
    MemoryMeter,
    Meter,
    describe_device,
    physical_gpu_index,
    torch_device,
)
from autotune.probe.models import (
    build_model,
    is_vl_config,
    load_model_config,
    synthetic_prompt_ids,
    without_special_ids,
)
from autotune.probe.result import ProbeRequest, ProbeResult, ProbeStatus
from autotune.probe.sharding import (
    RankGroup,
    full_tensor,
    is_fsdp1,
    join_group,
    leave_group,
    local_bytes,
    local_tensor,
    map_local,
    named_weights,
    shard_model,
    tensor_parallel_engine,
)
from autotune.probe.ulysses import (
    SequenceGroup,
    gather_positions,
    install_attention,
    padded_length,
    sequence_group,
    sequence_parallel,
)
from autotune.probe.vllm_engine import VllmEngine

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_CLIP_EPS = 0.2
_KL_COEF = 0.01


MAX_TIMED_STEPS = 12  # timed steps past request.timed_steps stop here (timed_min_s)


def training_s(phase_s: dict[str, float]) -> float:
    """Seconds of a step's training phases (validation is not part of a training step)."""
    return sum(v for k, v in phase_s.items() if k != "validation")


ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_AVOID_RECORD_STREAMS")


def allocator_settings(request: ProbeRequest) -> AllocatorSettings:
    """The CUDA caching allocator's settings the request's probe runs under: its process's
    PYTORCH_CUDA_ALLOC_CONF at start-up (the trainer's, request.env, else this environment's),
    then expandable segments per phase as the step switches them (the knob, never in the
    rollout)."""
    conf = request.env.get("PYTORCH_CUDA_ALLOC_CONF",
                           os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    return AllocatorSettings.from_env(conf, request.config.expandable_segments)


def allocator_record(settings: AllocatorSettings, phases: list[str]) -> dict[str, str]:
    """What a result records of the allocator it ran under: the trainer's environment
    variables as this process had them, and the phases with expandable segments on."""
    record = {name: os.environ[name] for name in ALLOCATOR_ENV if name in os.environ}
    on = [phase for phase in phases if settings.expandable_in(phase)]
    record["expandable_segments_in"] = " ".join(on) if on else "none"
    return record


class TrainingProbe:
    """Runs one ProbeRequest in this process; `meter.current_phase` says where a failure hit."""

    def __init__(self, request: ProbeRequest, meter: Meter | None = None) -> None:
        self.request = request
        self.config: ProbeConfig = request.config
        # the knobs as batching.py reads them, by name (the config stays the working form);
        # a token budget is per GPU, a sequence-parallel group's sp times it (verl's rule)
        self.batching_knobs: Mapping[str, KnobValue] = self.config.batching_knobs()
        self.meter = meter or MemoryMeter(torch_device(request.device.kind))
        self.device = self.meter.device  # the CPU for a trace (trace.py), whatever it models
        self.on_gpu = self.device.type == "cuda"
        self.gpu_kernels = self.meter.gpu_kernels  # a GPU's dtype and AdamW's foreach step
        wanted = compute_dtype(request.dtype, self.gpu_kernels)
        self.compute_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[wanted]
        self.share = device_share(self.config, request.world_size)  # this GPU's part
        # the trained phases' share: an SP group trains the same sequences (ProbeConfig)
        self.train_share = self.config.trained_share(request.world_size)
        self.sequence_group: SequenceGroup | None = None  # made by build() when sp > 1
        self.allocator = allocator_settings(request)  # the CUDA allocator's, per phase
        self.ran: dict[str, int] = {}  # the share as it ran: counted from the tensors
        self.host_offload_bytes = 0  # bytes of actor/ref tensors in host memory now
        self.peak_host_offload_bytes = 0
        self.group: RankGroup | None = None  # the FSDP ranks when world_size > 1
        self.model_state_bytes: dict[str, int] = {}  # this rank's params, grads, AdamW
        self.model_config = load_model_config(request.model, request.model_path)
        self.is_vl = is_vl_config(self.model_config)
        self.text_config = getattr(self.model_config, "text_config", self.model_config)
        self.vocab_size = int(self.text_config.vocab_size)
        self.image_tokens = image_tokens(self.config) if self.is_vl else 0
        # made by build(): the actor, its AdamW, the reference, the engine, the prompts
        self.model: PreTrainedModel  # FSDP-sharded when world_size > 1 (sharding.py)
        self.num_params = 0
        self.optimizer: torch.optim.Optimizer
        self.ref_model: PreTrainedModel | None = None  # with use_kl
        self.critic: ValueModel | None = None  # PPO's value model, and its AdamW
        self.critic_optimizer: torch.optim.Optimizer  # made with the critic
        self.mean_entropy: torch.Tensor | None = None  # entropy_metric: the last experience's
        self.engine: Rollout
        self.engine_weight_bytes = 0
        self.prompt_ids = torch.empty(0, dtype=torch.long)
        self.pixel_values: torch.Tensor | None = None
        self.grid_side = 0
        # made by each step's phases: the responses, their log-probs and advantages
        self.responses = torch.empty(0, dtype=torch.long)
        self.response_lengths = torch.empty(0, dtype=torch.long)  # tokens before each EOS
        self.response_rows = torch.empty(0, dtype=torch.long)
        self.old_log_probs = torch.empty(0)
        self.ref_log_probs = torch.empty(0)
        self.advantages = torch.empty(0)  # [responses] (GRPO) or [responses, tokens] (PPO)
        self.old_values = torch.empty(0)  # PPO: the critic's values and the returns
        self.returns = torch.empty(0)

    # -- building ---------------------------------------------------------------------------

    def build(self) -> None:
        """Check the config, then build as the trainer does: the actor (sharded over the
        ranks), its AdamW, the reference, the critic, the prompts, every state where its
        offload switches put it between steps, and last the rollout engine, which starts
        (vLLM's start-up check sees what the trainer holds)."""
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
        self._place_actor(params_on_device=not config.offload_params,
                          optimizer_on_device=not config.offload_optimizer)
        if self.critic is not None:
            self._place_states(self.critic, self.critic_optimizer,
                               not config.critic_offload_params,
                               not config.critic_offload_optimizer)
        self.engine = self._build_engine()
        self.engine.start(self._profile_inputs)

    def _check(self) -> None:
        """A ConfigError with every problem of the config for this model and device."""
        request, config = self.request, self.config
        problems = validate_probe_config(config, request.world_size)
        heads = (self.text_config.num_attention_heads, self.text_config.num_key_value_heads)
        problems += model_problems(config, self.is_vl, heads)
        if self.meter.runs_kernels:  # a trace runs neither Triton nor vLLM
            problems += device_problems(config, self.on_gpu, self.is_vl,
                                        request.device.cap_bytes is not None)
        if problems:
            raise ConfigError(problems)

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

    # -- placement (offload between phases, as verl/EasyR1 do) ------------------------------

    def _move(self, tensor: torch.Tensor, to_device: bool) -> torch.Tensor:
        """`tensor` on the device or in host memory (the meter says how each is held)."""
        on_host = self.meter.on_host(tensor)
        if to_device and on_host:
            self.host_offload_bytes -= tensor.numel() * tensor.element_size()
            return self.meter.to_device(tensor)
        if not to_device and not on_host:
            self.host_offload_bytes += tensor.numel() * tensor.element_size()
            return self.meter.to_host(tensor)
        return tensor

    def _place_module(self, module: torch.nn.Module, on_device: bool) -> None:
        if self.group is None or is_fsdp1(module):
            # FSDP1: each unit's flat shard moves and FSDP is told (EasyR1's and verl's
            # offload_fsdp_model: flat_param_to, then _local_shard = flat_param.data)
            for param in module.parameters():
                param.data = self._move(param.data, on_device)
                if hasattr(param, "_local_shard"):
                    param._local_shard = param.data
            return

        def place(tensor: torch.Tensor) -> torch.Tensor:  # FSDP: shards move, buffers stay
            if not hasattr(tensor, "_local_tensor"):
                return tensor
            return map_local(tensor, lambda local: self._move(local, on_device))

        module._apply(place)  # FSDP2's _apply re-reads every moved shard

    def _place_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      params_on_device: bool,
                      optimizer_on_device: bool) -> None:
        """A trained model's params and its optimizer's state, each where it is asked."""
        self._place_module(model, params_on_device)
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    state[key] = map_local(value,
                                           lambda local: self._move(local, optimizer_on_device))
        self.peak_host_offload_bytes = max(self.peak_host_offload_bytes, self.host_offload_bytes)

    def _place_actor(self, params_on_device: bool, optimizer_on_device: bool) -> None:
        self._place_states(self.model, self.optimizer, params_on_device, optimizer_on_device)
        if self.ref_model is not None and self.config.ref_on_host:
            self._place_module(self.ref_model, False)
        self.peak_host_offload_bytes = max(self.peak_host_offload_bytes, self.host_offload_bytes)

    def _wake_engine(self) -> None:
        """Wake the engine and load the actor's weights (wherever they live); sharded, the
        actor's params come to the device, are gathered one tensor at a time (verl's FSDP
        sharding manager does the same) and go back where they were."""
        if self.config.actor_generates:  # it generates with the actor's params
            if self.config.offload_params:
                self._place_module(self.model, True)
            self.engine.wake(iter(()))
            return
        sharded_offload = self.group is not None and self.config.offload_params
        if sharded_offload:
            self._place_module(self.model, True)
        actor = dict(named_weights(self.model))

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name in self.engine.weight_names():
                whole = full_tensor(getattr(actor[name], "data", actor[name]))
                yield name, self.engine.part(name, whole)
                del whole

        self.engine.wake(weights())
        self.engine_weight_bytes = self.engine.held_weight_bytes()
        if sharded_offload:
            self._place_module(self.model, False)

    def _sleep_engine(self) -> None:
        self.engine.sleep()
        if self.config.actor_generates and self.config.offload_params:
            self._place_module(self.model, False)
        self.peak_host_offload_bytes = max(self.peak_host_offload_bytes, self.host_offload_bytes)

    # -- the phases -------------------------------------------------------------------------

    @contextmanager
    def _autocast(self) -> Iterator[None]:
        if self.compute_dtype != torch.float32:
            with torch.autocast(self.device.type, dtype=self.compute_dtype):
                yield
        else:
            yield

    def _vl_inputs(self, prompt_rows: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.is_vl:
            return {}
        assert self.pixel_values is not None  # made with the prompts
        pixels = self.pixel_values[prompt_rows].reshape(-1, self.pixel_values.shape[-1])
        grid = torch.tensor([[1, self.grid_side, self.grid_side]] * len(prompt_rows))
        return {"pixel_values": pixels.to(self.device, self.compute_dtype),
                "image_grid_thw": grid.to(self.device)}

    def _generate(self, prompt_rows: torch.Tensor) -> torch.Tensor:
        """Exactly max_response_length tokens for each row (engine.py says how); the trained
        model generating itself computes under its autocast, as its forwards do."""
        with self._autocast() if self.config.actor_generates else contextlib.nullcontext():
            return self.engine.generate(self.prompt_ids, self._vl_inputs, prompt_rows)

    def _rollout(self) -> None:
        config = self.config
        self._wake_engine()
        rows = torch.arange(self.share.prompts_per_step).repeat_interleave(config.rollout_n)
        with torch.no_grad():
            self.responses = without_special_ids(self._generate(rows), self.model_config)
        self.response_rows = rows
        self.response_lengths = self._response_lengths(len(rows))
        self.ran.update(world_size=self.request.world_size,
                        prompts_per_step=len(rows) // config.rollout_n,
                        responses_per_step=len(self.responses))
        if self.sequence_group is not None:  # the group's sequences: each rank's, gathered
            sp = self.sequence_group.size
            self.responses = self.responses.repeat(sp, 1)
            self.response_rows = self.response_rows.repeat(sp)
            self.response_lengths = self.response_lengths.repeat(sp)
        self._sleep_engine()

    def _response_lengths(self, responses: int) -> torch.Tensor:
        """Each response's length: all at max_response_length, the worst case that memory
        verdicts stand on (a benchmark of sampled lengths overrides this)."""
        return torch.full((responses,), self.config.max_response_length, dtype=torch.long)

    def _validate(self) -> None:
        self._wake_engine()
        rows = torch.arange(self.share.val_prompts)
        self.ran["val_prompts"] = len(rows)
        with torch.no_grad():
            self._generate(rows)
        self._sleep_engine()

    def _log_probs_and_entropy(self, model: PreTrainedModel, index: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and each position's entropy from the same logits (as `_log_probs`;
        entropy_chunking and entropy_checkpointing say how the entropy is taken)."""
        both = self._padding_removed(
            index, lambda rows, tokens: self._forward_log_probs(model, rows, tokens, True))
        return both[..., 0], both[..., 1]

    def _log_probs(self, model: PreTrainedModel, index: torch.Tensor) -> torch.Tensor:
        """Log-probs of the response tokens of sequences `index`, [len(index), response
        length]. Fixed micro-batches pad every sequence to the full length, as the trainers do
        without padding removal; with dynamic batching the padding is removed: each sequence
        runs at its own length (the tokens, activations and logits a packed flash-attention
        varlen forward holds, without a packed mask) and positions past its end are 0."""
        return self._padding_removed(
            index, lambda rows, tokens: self._forward_log_probs(model, rows, tokens))

    def _values(self, index: torch.Tensor) -> torch.Tensor:
        """The critic's values of the response tokens of sequences `index`, batched as the
        log-probs are (fp32, [len(index), response length])."""
        return self._padding_removed(index, self._forward_values)

    def _padding_removed(self, index: torch.Tensor,
                         forward: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """`forward(index, tokens)` over the full response, or with dynamic batching each
        sequence at its own length, padded with 0 past its end."""
        lengths = self.response_lengths[index]
        full = self.responses.shape[1]
        if not self.config.dynamic_batching or bool((lengths == full).all()):
            return forward(index, full)
        rows = [forward(index[i:i + 1], int(n)) for i, n in enumerate(lengths.tolist())]
        # pad the token dimension (the second; a trailing one, [..., 2], is left as it is)
        return torch.cat([torch.nn.functional.pad(row, (0, 0) * (row.dim() - 2)
                                                  + (0, full - row.shape[1])) for row in rows])

    def _sequences(self, index: torch.Tensor, tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prompt rows, token ids (on the device) and response tokens of sequences `index`
        cut to `tokens` response tokens, and where the response's predictions start."""
        rows = self.response_rows[index]
        prompt = self.prompt_ids[rows]
        response = self.responses[index][:, :tokens]
        ids = torch.cat([prompt, response], dim=1).to(self.device)
        return rows, ids, response, prompt.shape[1] - 1

    def _forward_values(self, index: torch.Tensor, tokens: int) -> torch.Tensor:
        """The critic's value of each of the first `tokens` response tokens (verl slices
        values[:, -response_length - 1:-1])."""
        rows, ids, response, start = self._sequences(index, tokens)
        assert self.critic is not None  # PPO's
        with self._autocast():
            values = self.critic(ids, **self._vl_inputs(rows))
        return values[:, start:start + response.shape[1]].to(torch.float32)

    def _forward_log_probs(self, model: PreTrainedModel, index: torch.Tensor, tokens: int,
                           with_entropy: bool = False) -> torch.Tensor:
        """Log-probs of the first `tokens` response tokens of sequences `index` (fp32 over
        the vocabulary): from the whole logits, or fused (probe/logprob.py); `with_entropy`:
        [..., 2], each position's entropy beside its log-prob."""
        if self.sequence_group is not None:
            return self._sequence_parallel_log_probs(model, index, tokens, with_entropy)
        rows, ids, response, start = self._sequences(index, tokens)
        end = start + response.shape[1]
        config = self.config
        if config.fused_logprob:  # every position's next token, as verl's fused forward
            trl = config.fused_logprob_kernel == "trl"  # TRL's head: the policy's entropy
            # always, the completion tokens alone where its Triton kernels run (a GPU)
            with self._autocast(), fused_head(
                    model, torch.roll(ids, -1, dims=1),
                    with_entropy=with_entropy or (trl and model is self.model),
                    kernel=config.fused_logprob_kernel,
                    scored=(start, end) if trl and self.gpu_kernels else None,
                    on_gpu=self.gpu_kernels) as head:
                log_probs = model(input_ids=ids, use_cache=False, **self._vl_inputs(rows)).logits
            if not with_entropy:
                return log_probs[:, start:end]
            assert head.entropy is not None
            return torch.stack([log_probs[:, start:end], head.entropy[:, start:end]], dim=-1)
        with self._autocast():
            logits = model(input_ids=ids, use_cache=False, **self._vl_inputs(rows)).logits
        # an fp32 copy of the response positions (a CPU kernel would copy the slice unseen)
        response_logits = logits[:, start:end].to(torch.float32, copy=True)
        del logits
        entropies = entropy(response_logits, config.entropy_chunking,
                            config.entropy_checkpointing) if with_entropy else None
        log_probs = torch.log_softmax(response_logits, dim=-1).gather(
            -1, response.to(self.device).unsqueeze(-1)).squeeze(-1)
        if entropies is None:
            return log_probs
        return torch.stack([log_probs, entropies], dim=-1)

    def _sequence_parallel_log_probs(self, model: PreTrainedModel, index: torch.Tensor,
                                     tokens: int, with_entropy: bool) -> torch.Tensor:
        """`_forward_log_probs` on this rank's slice of each sequence (ulysses.py): the
        slice's logits, every local position's fp32 log-prob (and entropy), gathered over the
        group into the response's, as verl's padding-removed path computes them."""
        group = self.sequence_group
        assert group is not None  # sp > 1
        _, ids, response, start = self._sequences(index, tokens)
        end, length = start + response.shape[1], ids.shape[1]
        pad = (0, padded_length(length, group.size) - length)
        labels = torch.nn.functional.pad(torch.roll(ids, -1, dims=1), pad)[:, group.local_slice(
            length)]
        local = group.local_slice(length)
        positions = torch.arange(local.start, local.stop, device=self.device)
        with self._autocast():  # the phase runs inside sequence_parallel (step)
            logits = model(input_ids=torch.nn.functional.pad(ids, pad)[:, local],
                           position_ids=positions.expand(len(ids), -1), use_cache=False).logits
        local_logits = logits.to(torch.float32, copy=True)
        del logits
        log_probs = torch.log_softmax(local_logits, dim=-1).gather(
            -1, labels.unsqueeze(-1)).squeeze(-1)
        whole = gather_positions(log_probs, group)[:, start:end]
        if not with_entropy:
            return whole
        entropies = entropy(local_logits, self.config.entropy_chunking,
                            self.config.entropy_checkpointing)
        return torch.stack([whole, gather_positions(entropies, group)[:, start:end]], dim=-1)

    def _micro_batches(self, index: torch.Tensor, phase: str) -> list[torch.Tensor]:
        """`index` (responses) cut into `phase`'s micro-batches (batching.py), recording the
        largest as it ran."""
        lengths = (self.response_lengths[index] + self.config.max_prompt_length).tolist()
        groups = [index[group] for group in
                  micro_batches(lengths, self.batching_knobs, phase)]
        key = f"{phase}_micro_batch_rows"
        self.ran[key] = max(self.ran.get(key, 0), max(len(group) for group in groups))
        return groups

    def _chunked(self, forward: Callable[[torch.Tensor], torch.Tensor],
                 chunks: list[torch.Tensor]) -> torch.Tensor:
        """`forward` (log-probs or values) of every response, micro-batch by micro-batch."""
        out = torch.zeros(len(self.responses), self.responses.shape[1])
        for i, chunk in enumerate(chunks):
            if self.meter.runs(i, len(chunks)):
                out[chunk] = forward(chunk).cpu()
        return out

    def _valid(self, index: torch.Tensor) -> torch.Tensor:
        """[len(index), response length]: whether each position is in its response."""
        return (torch.arange(self.responses.shape[1], device=self.device)
                < self.response_lengths[index].to(self.device).unsqueeze(-1))

    def _old_log_probs(self, index: torch.Tensor) -> torch.Tensor:
        """The actor's log-probs before the update, with entropy_metric each position's
        entropy from the same logits too (verl's compute_log_prob, calculate_entropy: its
        actor/entropy metric, the token-mean over the responses)."""
        if not self.config.entropy_metric:
            return self._log_probs(self.model, index)
        log_probs, entropies = self._log_probs_and_entropy(self.model, index)
        valid = self._valid(index)
        self.mean_entropy = (entropies * valid).sum() / valid.sum()  # a tensor: a trace's
        return log_probs

    def _experience(self) -> None:
        config = self.config
        total = len(self.responses)
        if config.offload_params:
            self._place_module(self.model, True)
        with torch.no_grad():
            chunks = self._micro_batches(torch.arange(total), "experience")
            if config.runs_old_logprob_pass:  # off: the update's own, detached (TRL)
                self.old_log_probs = self._chunked(self._old_log_probs, chunks)
            ref = self.ref_model
            if ref is not None:
                if config.ref_on_host:
                    self._place_module(ref, True)
                self.ref_log_probs = self._chunked(lambda c: self._log_probs(ref, c), chunks)
                if config.ref_on_host:
                    self._place_module(ref, False)
            elif config.use_kl:  # LoRA: the reference is the actor with its adapters off
                with adapters_off(self.model):
                    self.ref_log_probs = self._chunked(
                        lambda c: self._log_probs(self.model, c), chunks)
        if config.offload_params:
            self._place_module(self.model, False)
        rewards = torch.randn(total // config.rollout_n, config.rollout_n)
        if self.critic is None:  # GRPO: each response against its group
            advantages = (rewards - rewards.mean(1, keepdim=True)) / (
                rewards.std(1, keepdim=True) + 1e-6)
            self.advantages = advantages.reshape(-1)
            return
        # PPO: the critic's values (verl's compute_values loads its params, not its
        # optimizer), then GAE
        if config.critic_offload_params:
            self._place_module(self.critic, True)
        with torch.no_grad():
            chunks = self._micro_batches(torch.arange(total), "critic_update")
            self.old_values = self._chunked(self._values, chunks)
        if config.critic_offload_params:
            self._place_module(self.critic, False)
        valid = (torch.arange(self.responses.shape[1])  # on the host, as the trainers
                 < self.response_lengths.unsqueeze(-1)).float()  # compute advantages
        self.advantages, self.returns = gae_advantages(rewards.reshape(-1), self.old_values,
                                                       valid)

    def _update(self) -> None:
        config = self.config
        self._place_actor(params_on_device=True, optimizer_on_device=True)
        self.model.train()
        per_minibatch = self.train_share.responses_per_minibatch
        minibatches = torch.randperm(len(self.responses)).split(per_minibatch)
        self.ran.update(minibatches=len(minibatches),
                        responses_per_minibatch=max(len(m) for m in minibatches))
        runs = self.meter.runs  # a trace: the first (grads, AdamW's state made) and the last
        for minibatch in (m for i, m in enumerate(minibatches) if runs(i, len(minibatches))):
            micros = self._micro_batches(minibatch, "update")
            for micro in (m for i, m in enumerate(micros) if runs(i, len(micros))):
                entropies = None
                if config.entropy_coeff:
                    log_probs, entropies = self._log_probs_and_entropy(self.model, micro)
                else:
                    log_probs = self._log_probs(self.model, micro)
                # token-mean over each response's own tokens; a micro-batch weighs as its
                # share of the mini-batch (verl's scaling with dynamic batching, and the
                # 1/accumulation of fixed micro-batches)
                valid = self._valid(micro)
                old = self.old_log_probs[micro].to(self.device) \
                    if config.runs_old_logprob_pass \
                    else log_probs.detach()
                advantage = self.advantages[micro].to(self.device)
                if advantage.dim() == 1:  # GRPO: one advantage per response
                    advantage = advantage.unsqueeze(-1)
                ratio = torch.exp(log_probs - old)
                clipped = torch.clamp(ratio, 1 - _CLIP_EPS, 1 + _CLIP_EPS)
                loss = -torch.min(ratio * advantage, clipped * advantage)
                if config.use_kl:
                    delta = self.ref_log_probs[micro].to(self.device) - log_probs
                    loss = loss + _KL_COEF * (torch.exp(delta) - delta - 1)  # k3 estimator
                if entropies is not None:  # verl's entropy bonus: policy_loss - coeff * H
                    loss = loss - config.entropy_coeff * entropies
                weight = len(micro) / len(minibatch)
                ((loss * valid).sum() / valid.sum() * weight).backward()
            self.optimizer.step()
            self._count_model_states(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self._place_actor(params_on_device=not config.offload_params,
                          optimizer_on_device=not config.offload_optimizer)

    def _update_critic(self) -> None:
        """PPO's critic update: the actor's mini-batches in the critic's micro-batches (or
        token budget), verl's clipped value loss, an AdamW step each."""
        config = self.config
        assert self.critic is not None
        self._place_states(self.critic, self.critic_optimizer, True, True)
        self.critic.train()
        minibatches = torch.randperm(len(self.responses)).split(
            self.train_share.responses_per_minibatch)
        runs = self.meter.runs
        for minibatch in (m for i, m in enumerate(minibatches) if runs(i, len(minibatches))):
            micros = self._micro_batches(minibatch, "critic_update")
            for micro in (m for i, m in enumerate(micros) if runs(i, len(micros))):
                values = self._values(micro)
                loss = value_loss(values, self.old_values[micro].to(self.device),
                                  self.returns[micro].to(self.device), self._valid(micro))
                (loss * len(micro) / len(minibatch)).backward()
            self.critic_optimizer.step()
            self._count_model_states(self.critic, self.critic_optimizer, "critic_")
            self.critic_optimizer.zero_grad(set_to_none=True)
        self.critic.eval()
        self._place_states(self.critic, self.critic_optimizer, not config.critic_offload_params,
                           not config.critic_offload_optimizer)

    def _count_model_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            prefix: str = "") -> None:
        """This rank's fp32 params, grads and AdamW state of `model`, as its update holds
        them (the critic's under critic_*)."""
        params = list(model.parameters())
        state = [value for entry in optimizer.state.values()
                 for value in entry.values() if torch.is_tensor(value) and value.dim() > 0]
        self.model_state_bytes.update({f"{prefix}params": local_bytes(params),
                                       f"{prefix}grads": local_bytes(p.grad for p in params),
                                       f"{prefix}optimizer": local_bytes(state)})

    def step(self) -> dict[str, float]:
        """One training step; returns seconds per phase (validation included when set)."""
        seconds = {}
        phases = [("rollout", self._rollout), ("experience", self._experience)]
        if self.critic is not None:
            phases.append(("critic_update", self._update_critic))
        phases.append(("update", self._update))
        if self.config.val_batch_size:
            phases.append(("validation", self._validate))
        for name, run in phases:
            if self.on_gpu:  # as verl toggles it: vLLM's memory pool refuses the segments
                torch.cuda.memory._set_allocator_settings(
                    f"expandable_segments:{self.allocator.expandable_in(name)}")
            # the trained phases' forwards and backwards (a checkpointed layer's recompute
            # too) run each rank's slice; generation runs whole sequences
            split = self.sequence_group is not None and name in ("experience", "update")
            with self.meter.phase(name), sequence_parallel(self.sequence_group) if split \
                    else contextlib.nullcontext():
                started = time.perf_counter()
                run()
                if self.on_gpu:
                    torch.cuda.synchronize(self.device)
                seconds[name] = time.perf_counter() - started
        return seconds

    def timed_steps(self) -> list[dict[str, float]]:
        """The timed steps: `request.timed_steps`, and more while they add up to less than
        `request.timed_min_s` (a short step is cheap to repeat and noisy alone),
        MAX_TIMED_STEPS at most. Every rank runs the same count (ranks step in lockstep
        through their collectives): rank 0's clock decides, and it is shared."""
        timed = [self.step() for _ in range(self.request.timed_steps)]
        while len(timed) < MAX_TIMED_STEPS and self.agree_more(
                sum(training_s(t) for t in timed) < self.request.timed_min_s):
            timed.append(self.step())
        return timed

    def agree_more(self, more: bool) -> bool:
        """Rank 0's answer to `more`, on every rank (alone: the answer itself)."""
        if self.group is None or self.request.emulated:
            return more
        import torch.distributed as dist

        flag = torch.tensor([1 if more else 0], dtype=torch.int32)
        if self.on_gpu:
            flag = flag.to(self.device)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    # -- the whole probe --------------------------------------------------------------------

    def run(self, startup_s: float | None = None) -> ProbeResult:
        request, config = self.request, self.config
        built_at = time.perf_counter()
        self.build()
        build_s = time.perf_counter() - built_at
        for _ in range(request.warmup_steps):
            self.step()
        watch = MachineWatch(torch.get_num_threads(),
                             physical_gpu_index(self.device) if self.on_gpu else None)
        watch.start()
        timed = self.timed_steps()
        machine = watch.stop()
        leave_group()  # only when every rank got here: a failed one just exits (no teardown
        # that could wait on peers stuck in a collective)
        phase_s = {p: sum(t[p] for t in timed) / len(timed) for p in timed[0]}
        step_times_s = [training_s(t) for t in timed]
        step_s = training_s(phase_s)
        # the whole run's rate: W ranks each ran this share in step_s (emulated: no comms)
        responses = self.ran["responses_per_step"] * request.world_size
        tokens = responses * config.sequence_length
        peaks = dict(self.meter.phase_peak_mem_bytes)
        return ProbeResult(
            status=ProbeStatus.OK, tokens_per_s=tokens / step_s,
            samples_per_s=responses / step_s, step_s=step_s, phase_s=phase_s,
            step_times_s=step_times_s, machine=machine.as_dict(),
            contention=machine.contention(),
            peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
            phase_allocator_peak_bytes=dict(self.meter.phase_allocator_peak_bytes),
            phase_tensor_peak_bytes=dict(self.meter.phase_tensor_peak_bytes),
            host_peak_rss_bytes=self.meter.host_peak_rss_bytes,
            host_offload_bytes=self.peak_host_offload_bytes,
            host_held_peak_bytes=self.meter.host_held_peak_bytes,
            num_params=self.num_params, startup_s=startup_s, build_s=build_s,
            share={"val_prompts": 0, **self.ran}, world_size=request.world_size,
            emulated=request.emulated and request.world_size > 1,
            model_state_bytes=dict(self.model_state_bytes),
            engine_weight_bytes=self.engine_weight_bytes, engine=dict(self.engine.figures),
            fsdp_strategy=config.fsdp_strategy if self.group is not None else None,
            num_alloc_retries=int(torch.cuda.memory_stats(self.device).get(
                "num_alloc_retries", 0)) if self.on_gpu else None,
            allocator=allocator_record(self.allocator, list(phase_s)),
            **describe_device(self.device, request.device.cap_bytes))
