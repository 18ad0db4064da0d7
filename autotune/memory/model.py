"""The memory model: peak bytes per GPU and per phase of a GRPO or PPO step, from numbers.

No torch here: the inputs are the model's config numbers and the knobs, so `autotune estimate`
answers in milliseconds and the sweep can screen configs before running them.

estimate_memory adds up one GPU's share of the step phase by phase (phases.py), from the
model's numbers (shape.py), what each model holds (states.py) and the logits by kernel
(logits.py). With Ulysses sequence parallelism the trained phases size one rank's slice of
every sequence (sliced_config).

On a GPU the card holds more than the tensors: the caching allocator's reserve, sketched by
step_reserve.py (the step's large allocations in order, replayed through allocator.py) for the
experience and the update, and by rollout_reserve.py for an HF-generation rollout
(`allocator_reserve`), and what lives outside torch
(outside_torch.py: the CUDA context, NCCL's buffers) as the fixed context; on a CPU the fixed
context is the process's own (CPU_CONTEXT_BYTES). The traced estimate's fixed term is here
too (TRACE_CPU_CONTEXT_BYTES). Calibration (calibration.py) fits each phase's context and a
scale on its transient part, per device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from autotune.batching import worst_case_rows
from autotune.config import DTYPE_BYTES, DeviceShare, ProbeConfig, compute_dtype
from autotune.memory.replay import AllocatorSettings
from autotune.memory.outside_torch import outside_torch
from autotune.memory.phases import (
    PhaseEstimate,
    critic_update_phase,
    engine_asleep_bytes,
    engine_held,
    engine_reservation_bytes,
    experience_phase,
    rollout_phase,
    rollout_states,
    update_phase,
    validation_phase,
)
from autotune.memory.shape import ModelShape
from autotune.memory.sketch.layout import MICRO_BATCHES, OPTIMIZER_STEPS, StepShape
from autotune.memory.sketch.rollout_reserve import GenerationShape, generation_reserve_bytes
from autotune.memory.sketch.step_reserve import phase_reserve_bytes
from autotune.memory.states import (
    Sizing,
    actor_states,
    critic_states,
    keeps_gathered_root,
    reference_bytes,
)
from autotune.memory.workspaces import CUBLAS_WORKSPACES_BYTES

if TYPE_CHECKING:
    from typing_extensions import Unpack


class ModelArgs(TypedDict, total=False):
    """How a run is asked of the memory model beyond its config and model (estimate_memory's
    keyword arguments, as sweep/feasibility/prescreen.py's memory_model_args builds them)."""

    num_gpus: int  # the run's GPUs, each runs its share of the batches
    on_gpu: bool
    compute_bytes: int  # the compute dtype's width
    state_shards: int  # ranks the model states are sharded over
    engine_capacity_bytes: int  # what a vllm-like engine reserves its share of
    outside_bytes: int  # what a process holds outside torch
    reserve_bytes: dict[str, int]  # the allocator's reserve per phase, held


# The fixed context of one probe process before calibration (the prior a study's calibration
# replaces): on a GPU what lives outside torch (outside_torch.py), on a CPU the anonymous RSS
# of Python, torch and transformers (docs/memory-and-trace.md).
GPU_CONTEXT_BYTES = 1 << 30  # the traced estimate's old prior (benchmarks' landscapes keep it)
CPU_CONTEXT_BYTES = 255 << 20
# The traced estimate's fixed term (probe/trace.py counts every tensor; this is the rest): on
# a GPU the CUDA context and NCCL's buffers (the rounding and cuBLAS's workspaces replayed); on
# a CPU the interpreter with torch and transformers, and what glibc's heap holds beyond the
# live tensors (the median of benchmarks/trace_accuracy.py's grids). The sweep replaces it
# with what its own probes held beyond their traces.
TRACE_GPU_CONTEXT_BYTES = GPU_CONTEXT_BYTES
TRACE_CPU_CONTEXT_BYTES = 264 << 20


@dataclass(frozen=True)
class MemoryEstimate:
    """One GPU's estimate: each phase's peak, what offload holds on the host for it, and the
    share of the step it sizes."""

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


def sliced_config(config: ProbeConfig) -> ProbeConfig:
    """The config as one rank of the trained phases runs it: with Ulysses sequence
    parallelism each rank runs a slice of every sequence, a 1/sp of it padded to a multiple
    of sp (probe/modeling/ulysses.py), and takes every local position's fp32 log-prob: as a
    sequence of that many response tokens and no prompt (a per-GPU token budget then fits sp
    times the sequences, verl's rule). Unchanged without."""
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
    """`phases` with what the caching allocator reserves beyond the tensors (step_reserve.py) added
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
    step_reserve.py's sketch.
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
    """What the caching allocator reserves beyond the tensors in each phase of `config` on a
    GPU (step_reserve.py's and rollout_reserve.py's sketches, replayed, and cuBLAS's
    workspaces; {} on a CPU), asked as estimate_memory
    is (the arguments it does not need are ignored). A search over one knob (a length, a
    micro-batch) holds it fixed at the config asked about, passing it to estimate_memory as
    `reserve_bytes`: the sketch takes tens of milliseconds a config, and a fragmentation
    figure is no order along an axis, which the searches assume."""
    on_gpu, num_gpus = args.get("on_gpu", True), args.get("num_gpus", 1)
    if not on_gpu:
        return {}
    shards = args.get("state_shards") or num_gpus
    width = args.get("compute_bytes") or DTYPE_BYTES[compute_dtype("auto", on_gpu)]
    sliced, share = sliced_config(config), config.trained_share(num_gpus)
    settings = AllocatorSettings(expandable_segments=config.expandable_segments)
    step = step_shape(shape, sliced, shards, width, share)
    reserve = dict(phase_reserve_bytes(step, settings))
    whole = config.share(num_gpus)  # the generating phases (rollout_reserve.py)
    for phase, sequences in (("rollout", whole.responses_per_step),
                             ("validation", whole.val_prompts)):
        if sequences:
            reserve[phase] = generation_reserve_bytes(
                generation_shape(shape, config, shards, width, sequences, step), settings)
    if config.has_critic:  # the critic's update, laid out as an update of its own model
        reserve["critic_update"] = phase_reserve_bytes(
            critic_step_shape(shape, sliced, shards, width, share), settings,
            ("update",))["update"]
    # and cuBLAS's workspaces, held by the allocator from the first step on (workspaces.py)
    return {phase: value + CUBLAS_WORKSPACES_BYTES for phase, value in reserve.items()}


def generation_shape(shape: ModelShape, config: ProbeConfig, shards: int, compute_bytes: int,
                     sequences: int, step: StepShape | None = None) -> GenerationShape:
    """The numbers rollout_reserve.py lays a rollout of `sequences` out with: HF
    generation's `max_num_seqs` at a time (a vllm-like engine's: none), one rank's share of
    a tensor-parallel engine (its heads and its layers' weights but the norms), the states
    the rollout finds on the device (the actor's params and AdamW's state unless offloaded,
    the reference, the critic's), the engine's copy gathered from FSDP shards, or a sharded
    policy gathering its layers as it generates. The vision tower's prefill is not laid
    out."""
    tp, copy = config.rollout_tensor_parallel, not config.actor_generates
    rows = max(1, min(sequences, config.max_num_seqs))
    actor = ((() if config.offload_params else (4,))
             + (() if config.offload_optimizer or config.uses_lora else (4, 4)))
    # AdamW's state where the first update made it, when it and the params stay on the device
    first = step if step is not None and actor == (4, 4, 4) else None
    actor = actor[:1] if first is not None else actor
    reference = (compute_bytes,) if config.holds_ref_copy and not config.ref_on_host else ()
    critic = ((() if config.critic_offload_params else (4,))
              + (() if config.critic_offload_optimizer else (4, 4))) \
        if config.has_critic else ()
    return GenerationShape(
        layers=shape.layers, hidden=shape.hidden, intermediate=shape.intermediate,
        heads_width=shape.heads * shape.head_dim // tp,
        kv_width=shape.kv_heads * shape.head_dim // tp, vocab=shape.vocab,
        layer_tensors=tuple(p // tp for p in shape.layer_tensors[:10])
        + shape.layer_tensors[10:],
        root_tensors=(shape.embedding_params,) * (1 if shape.tied_embeddings else 2),
        compute_bytes=compute_bytes, rows=rows, prompt=config.max_prompt_length,
        response=config.max_response_length,
        # a vllm-like engine's pool is one block made at wake-up: no batch laid out, only
        # the states the rollout finds and the engine's weights as it wakes
        batches=0 if config.engine_reserves else -(-sequences // rows),
        engine_copy=copy, held_copies=actor + reference + critic, first_update=first,
        state_layer=shape.layer_tensors, shards=shards,
        wake_gather=copy and shards > 1, policy_gathers=not copy and shards > 1,
        wake_shard_copies=(int(config.flat_shards(shards)) + int(config.offload_params))
        if copy and shards > 1 else 0)


def critic_step_shape(shape: ModelShape, config: ProbeConfig, shards: int, compute_bytes: int,
                      share: DeviceShare) -> StepShape:
    """step_shape for PPO's critic's update: the same decoder, a value head of one output for
    the LM head (its root unit the embedding alone), the critic's micro-batch, checkpointing
    and optimizer offload, no reference, no LoRA (probe/modeling/critic.py)."""
    actor = step_shape(shape, config, shards, compute_bytes, share)
    rows = max(1, worst_case_rows(config.as_dict(), share.responses_per_minibatch,
                                  "critic_update"))
    return dataclasses.replace(actor, vocab=1, root_params=(shape.embedding_params,),
                               update_rows=rows, critic_rows=0, critic_states=(),
                               value_head=True,
                               update_micro_batches=_laid_out(share.responses_per_minibatch,
                                                              rows, MICRO_BATCHES),
                               checkpointing=config.critic_gradient_checkpointing,
                               fused_logits=False, with_reference=False, frozen_base=False,
                               optimizer_offloaded=config.critic_offload_optimizer)


def _layer_blocks(layer: tuple[int, ...], shards: int) -> tuple[int, ...]:
    """A decoder layer's parameters as the sketch lays them out (shape.layer_tensors' order:
    q, k and v with their biases, o, the MLP's three, the two norms). One GPU's a weight a
    block, as its AdamW states, gradients and casts are each a tensor of their own (their
    segments are what a later phase finds: at the committed 0.5B experience's peak 2.46 GiB
    free in held segments laid out so, 1.73 with attention one block, 2.41 in its trace),
    the biases and norms one block (small-pool sizes all); a sharded rank's attention one
    block, the MLP's three, the norms one."""
    if shards == 1:
        return (layer[0], layer[2], layer[4], layer[6], *layer[7:10],
                layer[1] + layer[3] + layer[5] + layer[10] + layer[11])
    return (sum(layer[:7]), *layer[7:10], sum(layer[10:]))


def _laid_out(sequences: int, rows: int, most: int) -> int:
    """Micro-batches of `rows` the sketch lays out of a loop over `sequences`: the run's
    count, `most` at most."""
    return max(1, min(most, -(-sequences // rows)))


def step_shape(shape: ModelShape, config: ProbeConfig, shards: int, compute_bytes: int,
               share: DeviceShare) -> StepShape:
    """The numbers step_reserve.py lays the step's allocations out with: one decoder layer's
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
        layer_params=_layer_blocks(layer, shards),
        root_params=(shape.embedding_params,) * (1 if shape.tied_embeddings else 2),
        shards=shards, compute_bytes=compute_bytes,
        seq=config.max_prompt_length + config.max_response_length,
        response=config.max_response_length, update_rows=rows_u, experience_rows=rows_e,
        forwards=int(config.runs_old_logprob_pass) + int(config.use_kl),
        checkpointing=config.gradient_checkpointing, fused_logits=config.fused_logprob,
        with_reference=config.holds_ref_copy, reference_on_host=config.ref_on_host,
        reference_root_kept=keeps_gathered_root(config, shards, config.ref_on_host),
        actor_root_kept=keeps_gathered_root(config, shards, placed=True),
        fused_optimizer=config.fused_optimizer,
        frozen_base=config.uses_lora, optimizer_offloaded=config.offload_optimizer,
        fsdp1=config.flat_shards(shards),
        critic_rows=max(1, worst_case_rows(knobs, share.responses_per_step, "critic_update"))
        if config.has_critic else 0,
        update_micro_batches=_laid_out(share.responses_per_minibatch, rows_u, MICRO_BATCHES),
        optimizer_steps=min(OPTIMIZER_STEPS, share.minibatches),
        critic_states=((4,) + (() if config.critic_offload_optimizer else (4, 4)))
        if config.has_critic and not config.critic_offload_params else (),
        # the two norms as one block
        vision_block_params=(sum(block[:2]), *block[2:]) if block else (),
        vision_blocks=shape.vision_layers, vision_hidden=shape.vision_hidden,
        vision_intermediate=shape.vision_intermediate,
        patches_per_row=patches)


