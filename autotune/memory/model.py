"""The memory model: peak bytes per GPU and per phase of a GRPO step, from plain numbers.

No torch here: the inputs are the model's config numbers and the knobs, so `autotune estimate`
answers in milliseconds and the sweep can screen configs before running them.

The model's numbers, its parameter counts and the per-token activations and KV cache are
shape.py's; the model states (16 bytes per trained parameter, offload, the reference, the
engine's copy, PPO's critic) and FSDP's moments are states.py's; the log-prob logits
by kernel, logits.py's. A vllm-like rollout engine is the resident states plus its reservation,
gpu_memory_utilization x the device (section 4.2). PPO's critic has its own update phase
(`critic_update`, before the actor's); its value forward in the experience phase holds its
params and no vocabulary logits.

On a GPU the card holds more than the tensors: the caching allocator's reserve, sketched by
reserve.py (the step's large allocations in order, replayed through allocator.py) for the
experience and the update (`allocator_reserve`), and what lives outside torch
(outside_torch.py: the CUDA context, NCCL's buffers) as the fixed context.

Each phase's peak is split into `states_bytes` (tensors whose size is known exactly: model
states, the reference model, the rollout engine's weights), `transient_bytes` (what grows with
the micro-batch: activations, logits, KV cache, vision patches, the allocator's reserve; the
arithmetic here is the uncalibrated prior) and a fixed context. Calibration (calibration.py)
fits the context and a scale on the transient part per phase and device; the states are never
fitted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from autotune.batching import worst_case_rows
from autotune.config import (
    DTYPE_BYTES,
    DeviceShare,
    ProbeConfig,
    compute_dtype,
)
from autotune.memory.allocator import AllocatorSettings
from autotune.memory.logits import (
    logprob_logits_bytes,
    update_logits_bytes,
)
from autotune.memory.outside_torch import outside_torch
from autotune.memory.reserve import StepShape, phase_reserve_bytes
from autotune.memory.shape import (
    ModelShape,
    activation_bytes_per_token,
    forward_bytes_per_token,
    kv_cache_bytes,
    vision_activation_bytes_per_patch,
)
from autotune.memory.states import (
    ADAM_BYTES,
    PARAM_BYTES,
    Sizing,
    actor_cast_bytes,
    actor_states,
    critic_cast_bytes,
    critic_held,
    critic_param_count,
    critic_states,
    engine_weight_bytes,
    fsdp_gather_bytes,
    fsdp_root_bytes,
    lora_param_count,
    optimizer_step_bytes,
    reference_bytes,
    reference_resident_bytes,
    resident_bytes,
    root_backward_bytes,
    shard_bytes,
    trained_param_count,
    wake_gather_bytes,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack


class ModelArgs(TypedDict, total=False):
    """How a run is asked of the memory model beyond its config and model (estimate_memory's
    keyword arguments, as sweep/prescreen.py's memory_model_args builds them)."""

    num_gpus: int  # the run's GPUs, each runs its share of the batches
    on_gpu: bool
    compute_bytes: int  # the compute dtype's width
    state_shards: int  # ranks the model states are sharded over
    engine_capacity_bytes: int  # what a vllm-like engine reserves its share of
    outside_bytes: int  # what a process holds outside torch
    reserve_bytes: dict[str, int]  # the allocator's reserve per phase, held


# The knobs that move each phase's peak in this model (a test checks every other knob leaves
# the phase unchanged). Offload moves states between phases, so it moves the rollout but not
# the update, which loads them back; the log-prob forwards load the actor params back too.
# The allocator's settings and the FSDP wrapper move what every phase holds on the card
# (the trace's replay sees them; this model only expandable segments, in the training
# phases' reserve): declared for every phase, so dominance never compares across them.
ALLOCATOR_KNOBS = ("expandable_segments", "fsdp_strategy")
_SHAPE_KNOBS = ("max_prompt_length", "max_response_length", "use_kl", "image_size_px",
                "algorithm",  # a critic is one more model on the GPU in every phase
                "lora_rank", "lora_target_modules",  # the states, the reference copy
                *ALLOCATOR_KNOBS)
_SEQUENCE_KNOBS = ("ulysses_sequence_parallel_size",)  # a trained phase's rank's slice
_CRITIC_HELD = ("critic_offload_params", "critic_offload_optimizer")  # where it waits
_CRITIC_BATCH = ("critic_micro_batch_size_update", "critic_max_token_len_update")
_REF_KNOBS = ("offload_params", "offload_ref_params")  # where the reference waits
_ENGINE_KNOBS = ("rollout_engine", "gpu_memory_utilization",  # the reservation
                 "kv_cache_memory_bytes")
_HELD_KNOBS = (*_ENGINE_KNOBS, "enable_sleep")  # a vllm-like engine that does not sleep
# whether the old-log-prob forward runs: its switch, and where that is none the batches
_OLD_PASS_KNOBS = ("old_logprob_pass", "rollout_batch_size", "global_batch_size")
_LOGITS_KNOBS = ("fused_logprob", "fused_logprob_kernel", "entropy_chunking")  # the log-probs
PHASE_KNOBS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"rollout_batch_size", "rollout_n", "max_num_seqs", *_REF_KNOBS,
                          *_CRITIC_HELD,
                          "offload_optimizer", "rollout_tensor_parallel", *_ENGINE_KNOBS,
                          *_SHAPE_KNOBS}),
    "experience": frozenset({"micro_batch_size_experience", "offload_optimizer",
                             *_LOGITS_KNOBS, "entropy_metric", *_OLD_PASS_KNOBS,
                             "dynamic_batching",
                             "max_token_len_experience", *_CRITIC_HELD, *_SEQUENCE_KNOBS,
                             *_CRITIC_BATCH, *_HELD_KNOBS, *_SHAPE_KNOBS}),
    "critic_update": frozenset({*_CRITIC_BATCH, "critic_gradient_checkpointing",
                                "fused_optimizer",
                                "offload_params", "offload_optimizer", *_REF_KNOBS,
                                "dynamic_batching", *_HELD_KNOBS, *_SHAPE_KNOBS,
                                *_SEQUENCE_KNOBS}),
    "update": frozenset({"micro_batch_size_update", "gradient_checkpointing", *_REF_KNOBS,
                         *_LOGITS_KNOBS, "entropy_coeff", "fused_optimizer",
                         "dynamic_batching", "max_token_len_update", *_CRITIC_HELD,
                         *_SEQUENCE_KNOBS,
                         *_HELD_KNOBS, *_SHAPE_KNOBS}),
    "validation": frozenset({"val_batch_size", "max_num_seqs", *_REF_KNOBS,
                             "offload_optimizer", "rollout_tensor_parallel", *_ENGINE_KNOBS,
                             *_CRITIC_HELD, *_SHAPE_KNOBS}),
}
# With a critic, the experience phase's value forward runs after the actor's params and the
# reference went back to where they wait: their offload moves that phase too.
CRITIC_PHASE_KNOBS: dict[str, frozenset[str]] = {
    **PHASE_KNOBS, "experience": PHASE_KNOBS["experience"] | set(_REF_KNOBS)}


def phase_knobs(critic: bool) -> dict[str, frozenset[str]]:
    """The knobs that move each phase's peak, for a run with or without a critic."""
    return CRITIC_PHASE_KNOBS if critic else PHASE_KNOBS

# The fixed context of one probe process before calibration (the prior a study's calibration
# replaces): on a GPU what lives outside torch (outside_torch.py), on a CPU the anonymous RSS
# of Python, torch and transformers (docs/memory-and-trace.md).
GPU_CONTEXT_BYTES = 1 << 30  # the traced estimate's old prior (benchmarks' landscapes keep it)
CPU_CONTEXT_BYTES = 255 << 20
# The traced estimate's fixed term (probe/trace.py counts every tensor; this is the rest): on
# a GPU the CUDA context, cuBLAS and NCCL workspaces and the caching allocator's rounding; on
# a CPU the interpreter with torch and transformers, and what glibc's heap holds beyond the
# live tensors (the median of benchmarks/trace_accuracy.py's grids). The sweep replaces it
# with what its own probes held beyond their traces.
TRACE_GPU_CONTEXT_BYTES = GPU_CONTEXT_BYTES
TRACE_CPU_CONTEXT_BYTES = 264 << 20


@dataclass(frozen=True)
class PhaseEstimate:
    """One phase's estimated peak on one GPU, split as calibration treats it."""

    states_bytes: int  # exact: model states, reference and engine weights present
    transient_bytes: int  # the prior for what grows with the batch (scaled by calibration)
    context_bytes: int  # the fixed per-process overhead (fitted by calibration)
    parts: dict[str, int]  # the named terms, for the table
    critic_bytes: int = 0  # PPO: the critic's share of the peak (its states there, and what
    # it runs where it runs: its value forward, its update)

    @property
    def total_bytes(self) -> int:
        return self.states_bytes + self.transient_bytes + self.context_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    phases: dict[str, PhaseEstimate]
    host_offload_bytes: int  # host memory offload holds for this GPU
    share: DeviceShare  # the GPU's share of the step these phases hold

    @property
    def peak_bytes(self) -> int:
        return max(p.total_bytes for p in self.phases.values())

    @property
    def binding_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total_bytes)

    def critic_bytes(self, phase: str) -> int:
        """PPO's critic's share of `phase`'s peak (PhaseEstimate.critic_bytes)."""
        return self.phases[phase].critic_bytes


def context_bytes(config: ProbeConfig, num_gpus: int, on_gpu: bool,
                  outside_bytes: int | None) -> int:
    """The fixed context of one process before calibration: on a GPU what lives outside torch
    (outside_torch.py: the CUDA context, NCCL's buffers) unless measured (`outside_bytes`); on
    a CPU CPU_CONTEXT_BYTES."""
    if not on_gpu:
        return CPU_CONTEXT_BYTES
    if outside_bytes is not None:
        return outside_bytes
    return outside_torch(num_gpus, False, config.rollout_tensor_parallel).total_bytes


def vision_forward_bytes(s: Sizing) -> int:
    """The ViT's no-grad forward for one sequence's image: 4 hv + 3 Iv values per patch (its
    SwiGLU's three I-wide tensors), in the compute dtype."""
    shape = s.shape
    return (4 * shape.vision_hidden + 3 * shape.vision_intermediate) * s.compute_bytes \
        * s.patches


def forward_bytes(s: Sizing, rows: int, tokens: int) -> int:
    """A no-grad forward of `rows` sequences of `tokens` tokens: one layer's live tensors
    (forward_bytes_per_token) and each image's (vision_forward_bytes)."""
    per_token = forward_bytes_per_token(s.shape, s.compute_bytes)
    return rows * (tokens * per_token + vision_forward_bytes(s))


def saved_activation_bytes(s: Sizing, rows: int, checkpointing: bool) -> tuple[int, int]:
    """What a micro-batch of `rows` sequences saves for its backward: the decoder's
    activations (Korthikanti et al. 2022, activation_bytes_per_token) and the ViT's (per
    patch, vision_activation_bytes_per_patch)."""
    seq, c = s.config.sequence_length, s.compute_bytes
    return (rows * seq * activation_bytes_per_token(s.shape, checkpointing, c),
            rows * s.patches * vision_activation_bytes_per_patch(s.shape, checkpointing, c))


def generation_bytes(s: Sizing, sequences: int) -> dict[str, int]:
    """An engine generating `sequences` (max_num_seqs at a time) that grows with its batch:
    the KV cache (kv_cache_bytes, its KV heads split over the tensor-parallel ranks), the
    prefill's forward and the sampler's logits in the compute dtype and fp32. {} for an
    engine with vLLM's memory: it generates inside its reservation."""
    config, c = s.config, s.compute_bytes
    if config.engine_reserves:
        return {}
    batch = min(sequences, config.max_num_seqs)
    kv = kv_cache_bytes(s.shape, batch * config.sequence_length, c)
    return {"kv_cache": kv // config.rollout_tensor_parallel,
            "prefill": forward_bytes(s, batch, config.max_prompt_length),
            "sampling_logits": batch * s.shape.vocab * (c + 4)}


def engine_reservation_bytes(s: Sizing, engine_capacity_bytes: int | None) -> int:
    """What an engine with vLLM's memory reserves whatever the batch (0 for another engine):
    with kv_cache_memory_bytes the pool in bytes beside its weights and its profile run (a
    prefill chunk, the sampler's fp32 logits), else gpu_memory_utilization x
    `engine_capacity_bytes` (the device, or its memory limit)."""
    config = s.config
    if not config.engine_reserves:
        return 0
    if config.kv_cache_memory_bytes is not None:  # the pool in bytes: what it takes
        rows = max(1, min(config.max_num_seqs,
                          config.max_num_batched_tokens // config.max_prompt_length))
        profile = (forward_bytes(s, rows, config.max_prompt_length)
                   + config.max_num_seqs * s.shape.vocab * 4)  # a prefill chunk, the sampler
        return engine_weight_bytes(s) + config.kv_cache_memory_bytes + profile
    if engine_capacity_bytes is None:
        raise ValueError("a vllm-like engine reserves a share of the device: pass "
                         "engine_capacity_bytes")
    return int(config.gpu_memory_utilization * engine_capacity_bytes)


def engine_held(s: Sizing, reservation: int) -> dict[str, int]:
    """What an engine with vLLM's memory that does not sleep keeps through the other phases:
    its whole reservation ({} for any other engine)."""
    config = s.config
    awake = config.engine_reserves and not config.enable_sleep
    return {"engine_reservation": reservation} if awake else {}


def engine_asleep_bytes(s: Sizing) -> int:
    """Host bytes of an engine with vLLM's memory asleep at level 1: its weights (level 2
    drops them)."""
    config = s.config
    asleep = config.engine_reserves and config.enable_sleep and config.sleep_level == 1
    return engine_weight_bytes(s) if asleep else 0


def rollout_states(s: Sizing, reservation: int) -> dict[str, int]:
    """What the rollout and validation hold beside generating: the resident states, the
    critic, and the engine (its reservation; its weights; or, where the actor generates, the
    actor's own params back on the device and the compute-dtype weights its forward uses),
    and FSDP's root unit, still gathered."""
    config = s.config
    if config.engine_reserves:
        engine = {"engine_reservation": reservation}
    elif config.actor_generates:
        params = shard_bytes(PARAM_BYTES, s.shape.num_params, s.shards)
        engine = {"actor_params": params if config.offload_params else 0,
                  "cast_weights": actor_cast_bytes(s)}
    else:
        engine = {"engine_weights": engine_weight_bytes(s)}
    states = {"resident": resident_bytes(s), **critic_held(s), **engine}
    root = fsdp_root_bytes(s)
    return {**states, "fsdp_root": root} if root else states


def rollout_phase(s: Sizing, sequences: int, states: dict[str, int],
                  context: int) -> PhaseEstimate:
    """The rollout: `states` (rollout_states) and generating `sequences`, or a sharded engine
    waking, whichever is more."""
    generating, wake = generation_bytes(s, sequences), wake_gather_bytes(s)
    return PhaseEstimate(sum(states.values()), max(sum(generating.values()), wake), context,
                         {**states, **generating, "wake_gather": wake},
                         critic_states(s).resident_bytes)


def validation_phase(s: Sizing, prompts: int, states: dict[str, int],
                     context: int) -> PhaseEstimate:
    """Validation: the rollout's states and generating the validation batch's `prompts`."""
    generating = generation_bytes(s, prompts)
    return PhaseEstimate(sum(states.values()), sum(generating.values()), context,
                         {**states, **generating}, critic_states(s).resident_bytes)


def logprob_forward_bytes(s: Sizing, rows: int) -> dict[str, int]:
    """The experience's forwards of `rows` sequences: the old-log-prob forward (the actor's
    cast weights, the entropy's logits), then the reference's (its own compute-dtype weights:
    gathered like the actor's when sharded); with neither (TRL at beta 0 and one optimizer
    step), no forward at all."""
    config = s.config
    old_pass = config.runs_old_logprob_pass
    forward = {"cast_weights": actor_cast_bytes(s) if old_pass or s.shards > 1 else 0,
               "logits": logprob_logits_bytes(s, rows, config.entropy_metric and old_pass),
               "activations": forward_bytes(s, rows, config.sequence_length)}
    return forward if old_pass or config.use_kl else dict.fromkeys(forward, 0)


def experience_phase(s: Sizing, share: DeviceShare, held: dict[str, int],
                     context: int) -> PhaseEstimate:
    """The experience phase: the actor's params and Adam state, the reference and the log-prob
    forwards (logprob_forward_bytes), or with a critic its value forward where that is more."""
    config = s.config
    psi, trained = s.shape.num_params + lora_param_count(s), trained_param_count(s)
    states = {"actor": shard_bytes(PARAM_BYTES, psi, s.shards),
              "adam": 0 if config.offload_optimizer
              else shard_bytes(ADAM_BYTES, trained, s.shards),
              "reference": reference_bytes(s), **critic_held(s), **held}
    forward = logprob_forward_bytes(s, s.rows(share.responses_per_step, "experience"))
    gathering = fsdp_gather_bytes(s) if config.runs_old_logprob_pass or config.use_kl else 0
    # on one GPU the no-grad forward keeps no cast weights (autocast caches only for a
    # gradient) and each layer's activations are gone by the logits: those peak apart
    peak = sum(forward.values()) if s.shards > 1 else max(
        forward["logits"], forward["cast_weights"] + forward["activations"])
    phase = PhaseEstimate(sum(states.values()), max(peak, gathering), context,
                          {**states, **forward, "fsdp_gather": gathering},
                          critic_states(s).resident_bytes)
    if not config.has_critic:
        return phase
    values = value_forward_phase(s, share, held, context)
    return values if values.total_bytes > phase.total_bytes else phase


def value_forward_phase(s: Sizing, share: DeviceShare, held: dict[str, int],
                        context: int) -> PhaseEstimate:
    """PPO's value forward, after the actor's and the reference's (their params back where
    they wait): the critic's params and Adam state (where not offloaded), its cast weights,
    a no-grad forward of its micro-batch with no vocabulary logits, and its values."""
    config, seq, c = s.config, s.config.sequence_length, s.compute_bytes
    rows = s.rows(share.responses_per_step, "critic_update")
    psi_c = critic_param_count(s)
    params = shard_bytes(PARAM_BYTES, psi_c, s.shards)
    adam = 0 if config.critic_offload_optimizer else shard_bytes(ADAM_BYTES, psi_c, s.shards)
    states = {"resident": resident_bytes(s), "critic_params": params, "critic_adam": adam,
              **held}
    values = {"critic_cast_weights": critic_cast_bytes(s),
              "critic_activations": forward_bytes(s, rows, seq) + rows * seq * (c + 4)}
    return PhaseEstimate(sum(states.values()), sum(values.values()), context,
                         {**states, **values}, params + adam + sum(values.values()))


def critic_update_phase(s: Sizing, share: DeviceShare, held: dict[str, int],
                        context: int) -> PhaseEstimate:
    """PPO's critic update (before the actor's): its 16 bytes per parameter, the actor's
    resident states, its backward (cast weights, saved activations, fp32 values) or its
    optimizer step, whichever is more."""
    config, seq = s.config, s.config.sequence_length
    rows = s.rows(share.responses_per_minibatch, "critic_update")
    critic = critic_states(s)
    states = {"critic_params_grads_adam": critic.update_bytes, "resident": resident_bytes(s),
              **held}
    text, vision = saved_activation_bytes(s, rows, config.critic_gradient_checkpointing)
    backward = {"critic_cast_weights": critic_cast_bytes(s), "critic_activations": text,
                "critic_vision_activations": vision,
                "critic_values": rows * seq * (s.compute_bytes + 3 * 4)}
    step = optimizer_step_bytes(s, critic_param_count(s))
    transient = max(sum(backward.values()), step)
    return PhaseEstimate(sum(states.values()), transient, context,
                         {**states, **backward, "critic_optimizer_step": step},
                         critic.update_bytes + transient)


def update_phase(s: Sizing, share: DeviceShare, held: dict[str, int],
                 context: int) -> PhaseEstimate:
    """The actor's update: its 16 bytes per parameter and the resident reference, then its
    backward (cast weights, saved activations, logits), the root's backward or the optimizer
    step, whichever is more."""
    config = s.config
    rows = s.rows(share.responses_per_minibatch, "update")
    states = {"params_grads_adam": actor_states(s).update_bytes,
              "reference": reference_resident_bytes(s), **critic_held(s), **held}
    text, vision = saved_activation_bytes(s, rows, config.gradient_checkpointing)
    backward = {"cast_weights": actor_cast_bytes(s), "activations": text,
                "vision_activations": vision, "logits": update_logits_bytes(s, rows)}
    root, step = root_backward_bytes(s), optimizer_step_bytes(s, trained_param_count(s))
    return PhaseEstimate(sum(states.values()), max(sum(backward.values()), root, step), context,
                         {**states, **backward, "root_backward": root, "optimizer_step": step},
                         critic_states(s).resident_bytes)


def sliced_config(config: ProbeConfig) -> ProbeConfig:
    """The config as one rank of the trained phases runs it: with Ulysses sequence
    parallelism each rank runs a slice of every sequence, a 1/sp of it padded to a multiple
    of sp (probe/ulysses.py), and takes every local position's fp32 log-prob: as a sequence of
    that many response tokens and no prompt (a per-GPU token budget then fits sp times the
    sequences, verl's rule). Unchanged without."""
    sp = config.ulysses_sequence_parallel_size
    if sp == 1:
        return config
    return config.replace(max_prompt_length=0,
                          max_response_length=-(-config.sequence_length // sp))


def sequence_slice(s: Sizing) -> Sizing:
    """The trained phases' sizing (sliced_config)."""
    return dataclasses.replace(s, config=sliced_config(s.config))


def with_allocator_reserve(phases: dict[str, PhaseEstimate],
                           reserve: dict[str, int]) -> dict[str, PhaseEstimate]:
    """`phases` with what the caching allocator reserves beyond the tensors (reserve.py) added
    to the transient part of each phase `reserve` names."""
    reserved = dict(phases)
    for name, extra in reserve.items():
        if name in reserved and extra:
            phase = reserved[name]
            reserved[name] = dataclasses.replace(
                phase, transient_bytes=phase.transient_bytes + extra,
                parts={**phase.parts, "allocator_reserve": extra})
    return reserved


def host_offload_bytes(s: Sizing) -> int:
    """What this GPU's offload holds in host memory: the actor's and the critic's offloaded
    states, the reference where it waits on the host, an engine's weights asleep."""
    reference = reference_bytes(s) if s.config.ref_on_host else 0
    return (actor_states(s).host_offload_bytes + reference + engine_asleep_bytes(s)
            + critic_states(s).host_offload_bytes)


def estimate_memory(shape: ModelShape, config: ProbeConfig, num_gpus: int = 1,
                    on_gpu: bool = True, compute_bytes: int | None = None,
                    state_shards: int | None = None,
                    engine_capacity_bytes: int | None = None,
                    outside_bytes: int | None = None,
                    reserve_bytes: dict[str, int] | None = None) -> MemoryEstimate:
    """Peak bytes per GPU of each phase of one colocated GRPO or PPO step on `num_gpus` GPUs.

    Each GPU runs its share of the batches (config.share). The model states are sharded over
    `state_shards` GPUs (FSDP over the whole run by default, as the built-in probe shards
    them). `compute_bytes` is the width of the compute dtype (by default --dtype auto's,
    config.compute_dtype: bf16 on a GPU, fp32 on a CPU). The rollout engine keeps a
    compute-dtype copy of the weights on each GPU, split over `rollout_tensor_parallel` GPUs
    (with the KV heads of its cache), and generates `max_num_seqs` sequences at a time. The
    vllm-like engine instead reserves `gpu_memory_utilization` x `engine_capacity_bytes` (the
    device, or its memory limit) whatever the batch, and holds it through the other phases
    too unless it sleeps; sleeping at level 1 keeps its weights in host memory. On a GPU each
    training phase adds the caching allocator's reserve: `reserve_bytes` where given, else
    reserve.py's sketch.
    """
    s = Sizing(shape, config, state_shards or num_gpus,
               compute_bytes or DTYPE_BYTES[compute_dtype("auto", on_gpu)], on_gpu)
    share = config.share(num_gpus)
    trained, trained_share = sequence_slice(s), config.trained_share(num_gpus)
    context = context_bytes(config, num_gpus, on_gpu, outside_bytes)
    reservation = engine_reservation_bytes(s, engine_capacity_bytes)
    held, between = engine_held(s, reservation), rollout_states(s, reservation)
    phases = {"rollout": rollout_phase(s, share.responses_per_step, between, context),
              "experience": experience_phase(trained, trained_share, held, context)}
    if config.has_critic:
        phases["critic_update"] = critic_update_phase(trained, trained_share, held, context)
    phases["update"] = update_phase(trained, trained_share, held, context)
    if share.val_prompts:
        phases["validation"] = validation_phase(s, share.val_prompts, between, context)
    if on_gpu:
        reserve = reserve_bytes if reserve_bytes is not None else allocator_reserve(
            shape, config, num_gpus=num_gpus, compute_bytes=s.compute_bytes,
            state_shards=s.shards)
        phases = with_allocator_reserve(phases, reserve)
    return MemoryEstimate(phases, host_offload_bytes(s), share)


def allocator_reserve(shape: ModelShape, config: ProbeConfig,
                      **args: Unpack[ModelArgs]) -> dict[str, int]:
    """What the caching allocator reserves beyond the tensors in each training phase of
    `config` on a GPU (reserve.py's sketch, replayed; {} on a CPU), asked as estimate_memory
    is (the arguments it does not need are ignored). A search over one knob (a length, a
    micro-batch) holds it fixed at the config asked about, passing it to estimate_memory as
    `reserve_bytes`: the sketch takes tens of milliseconds a config, and a fragmentation
    figure is no order along an axis, which the searches assume."""
    on_gpu, num_gpus = args.get("on_gpu", True), args.get("num_gpus", 1)
    if not on_gpu:
        return {}
    shards = args.get("state_shards") or num_gpus
    width = args.get("compute_bytes") or DTYPE_BYTES[compute_dtype("auto", on_gpu)]
    return phase_reserve_bytes(step_shape(shape, sliced_config(config), shards, width,
                                          config.trained_share(num_gpus)),
                               AllocatorSettings(expandable_segments=config.expandable_segments))


def step_shape(shape: ModelShape, config: ProbeConfig, shards: int, compute_bytes: int,
               share: DeviceShare) -> StepShape:
    """The numbers reserve.py lays the step's allocations out with: one decoder layer's
    parameters by block (attention's, the MLP's three, the norms), the root unit's, a VL
    model's vision block, and each training phase's rows at their worst case."""
    layer, block = shape.layer_tensors, shape.vision_block_tensors
    knobs = config.as_dict()
    rows_u = max(1, worst_case_rows(knobs, share.responses_per_minibatch, "update"))
    rows_e = max(1, worst_case_rows(knobs, share.responses_per_step, "experience"))
    patches = (config.image_size_px // shape.patch_px) ** 2 if shape.is_vl else 0
    return StepShape(
        vocab=shape.vocab, hidden=shape.hidden, intermediate=shape.intermediate,
        layers=shape.layers,
        # q, k, v and o with their biases as one block, the MLP's three, the two norms
        layer_params=(sum(layer[:7]), *layer[7:10], sum(layer[10:])),
        root_params=(shape.embedding_params,) * (1 if shape.tied_embeddings else 2),
        shards=shards, compute_bytes=compute_bytes,
        seq=config.max_prompt_length + config.max_response_length,
        response=config.max_response_length, update_rows=rows_u, experience_rows=rows_e,
        forwards=int(config.runs_old_logprob_pass) + int(config.use_kl),
        checkpointing=config.gradient_checkpointing, fused_logits=config.fused_logprob,
        with_reference=config.holds_ref_copy, fused_optimizer=config.fused_optimizer,
        frozen_base=config.uses_lora,
        # the two norms as one block
        vision_block_params=(sum(block[:2]), *block[2:]) if block else (),
        vision_blocks=shape.vision_layers, vision_hidden=shape.vision_hidden,
        vision_intermediate=shape.vision_intermediate,
        patches_per_row=patches)


