"""The phases of one GPU's step: what each holds at its peak, as named terms.

The rollout, the experience, PPO's critic update, the update and the validation each add up
to a PhaseEstimate: the model states and copies present through the phase (states.py), what
grows with its micro-batch (activations, the logits by kernel from logits.py, the KV cache,
vision patches) and the fixed context they are given. A vllm-like rollout engine is the
resident states plus its reservation, gpu_memory_utilization x the device (section 4.2), held
through the other phases unless it sleeps. PPO's critic has its own update phase
(`critic_update`, before the actor's); its value forward in the experience phase holds its
params and no vocabulary logits.

Each phase's peak is split into `states_bytes` (tensors whose size is known exactly: model
states, the reference model, the rollout engine's weights), `transient_bytes` (what grows with
the micro-batch: activations, logits, KV cache, vision patches, the allocator's reserve; the
arithmetic here is the uncalibrated prior) and a fixed context. Calibration (calibration.py)
fits the context and a scale on the transient part per phase and device; the states are never
fitted.

PHASE_KNOBS names the knobs each phase's peak reads here, CARRIED_KNOBS the update's it also
reads through the segments the run's first update left; dominance
(sweep/feasibility/dominance.py) compares configs on both alone, the carried ones as equal.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import ENGINE_PHASES, DeviceShare, ProbeConfig
from autotune.memory.logits import autocast_logits_bytes, logprob_logits_bytes, update_logits_bytes
from autotune.memory.shape import (
    activation_bytes_per_token,
    forward_bytes_per_token,
    kv_cache_bytes,
    vision_activation_bytes_per_patch,
)
from autotune.memory.states import (
    ADAM_BYTES,
    GRAD_BYTES,
    PARAM_BYTES,
    Sizing,
    actor_cast_bytes,
    actor_states,
    adapter_cast_bytes,
    critic_cast_bytes,
    critic_held,
    critic_param_count,
    critic_states,
    engine_weight_bytes,
    forward_units_bytes,
    fsdp_gather_bytes,
    fsdp_root_bytes,
    kept_root_bytes,
    lora_param_count,
    optimizer_step_bytes,
    reference_bytes,
    reference_resident_bytes,
    resident_bytes,
    root_backward_bytes,
    root_gather_bytes,
    shard_bytes,
    trained_param_count,
    update_cast_bytes,
    wake_gather_bytes,
)

# The knobs that move each phase's peak in this model (a test checks every other knob leaves
# the phase unchanged). Offload moves states between phases, so it moves the rollout, and
# the update loads them back: not its tensors, but an offloaded optimizer's state comes back
# whole as the update starts, into segments of its own, where a resident one stays in the
# blocks its first step found among the freed activations (the allocator's reserve,
# step_reserve.py); the log-prob forwards load the actor params back too.
# The allocator's settings and the FSDP wrapper move what every phase holds on the card
# (the trace's replay sees them; this model only expandable segments, in the training
# phases' reserve): declared for every phase, so dominance never compares across them.
ALLOCATOR_KNOBS = ("expandable_segments", "fsdp_strategy")
# separate placement: which GPUs run a phase and over how many ranks the trainer's states are
# sharded move every phase (memory/roles.py sizes them; the colocated model here does not)
SPLIT_KNOBS = ("placement", "rollout_gpus")
_SHAPE_KNOBS = ("max_prompt_length", "max_response_length", "use_kl", "image_size_px",
                "algorithm",  # a critic is one more model on the GPU in every phase
                "lora_rank", "lora_target_modules",  # the states, the reference copy
                *SPLIT_KNOBS, *ALLOCATOR_KNOBS)
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
# the batches: how many micro-batches and optimizer steps an update runs, up to the few the
# allocator's sketch lays out (step_reserve.py: one optimizer step an update leaves no freed
# AdamW temporaries behind; a third micro-batch finds the cache as the second left it)
_MINIBATCH_KNOBS = ("rollout_batch_size", "global_batch_size", "rollout_n")
PHASE_KNOBS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"rollout_batch_size", "rollout_n", "max_num_seqs", *_REF_KNOBS,
                          *_CRITIC_HELD,
                          "offload_optimizer", "rollout_tensor_parallel", *_ENGINE_KNOBS,
                          *_SHAPE_KNOBS}),
    "experience": frozenset({"micro_batch_size_experience", "offload_optimizer",
                             *_REF_KNOBS,  # a reference on the host: there for its pass only
                             *_LOGITS_KNOBS, "entropy_metric", *_OLD_PASS_KNOBS,
                             "dynamic_batching",
                             "max_token_len_experience", *_CRITIC_HELD, *_SEQUENCE_KNOBS,
                             *_CRITIC_BATCH, *_HELD_KNOBS, *_SHAPE_KNOBS}),
    "critic_update": frozenset({*_CRITIC_BATCH, "critic_gradient_checkpointing",
                                "critic_offload_optimizer",  # its AdamW state laid out anew
                                "fused_optimizer",
                                "offload_params", "offload_optimizer", *_REF_KNOBS,
                                "dynamic_batching", *_MINIBATCH_KNOBS, *_HELD_KNOBS,
                                *_SHAPE_KNOBS, *_SEQUENCE_KNOBS}),
    "update": frozenset({"micro_batch_size_update", "gradient_checkpointing", *_REF_KNOBS,
                         "offload_optimizer",
                         *_LOGITS_KNOBS, "entropy_coeff", "fused_optimizer",
                         "dynamic_batching", "max_token_len_update", *_CRITIC_HELD,
                         *_SEQUENCE_KNOBS, *_MINIBATCH_KNOBS,
                         *_HELD_KNOBS, *_SHAPE_KNOBS}),
    "validation": frozenset({"val_batch_size", "max_num_seqs", *_REF_KNOBS,
                             "offload_optimizer", "rollout_tensor_parallel", *_ENGINE_KNOBS,
                             *_CRITIC_HELD, *_SHAPE_KNOBS}),
}
# The update's knobs that size its transient blocks, carried into the phases after it: the
# run's first optimizer step makes AdamW's state among those freed blocks, and the autograd
# thread's first GEMM its cuBLAS workspace, so each later phase finds those segments held,
# holes and all (sketch/step_reserve.first_update; the committed 0.5B experience: a 1.2 GiB
# segment cut for the update's fp32 logits that the 32 MiB workspace keeps). Their effect
# there has no order (a larger micro-batch cuts larger segments, whose holes a later phase
# may or may not fill): dominance compares them as equal in those phases. Not declared,
# and so not compared there, though the card reads them: the update's entropy and
# optimizer-kernel knobs (the sketch lays out neither's blocks), and PPO's critic update,
# which finds the segments too (its sketch, an update of the critic's own model, lays out
# no history).
_CARRIED = frozenset({"micro_batch_size_update", "max_token_len_update", "dynamic_batching",
                      "gradient_checkpointing", "fused_logprob", *_SEQUENCE_KNOBS,
                      # how many micro-batches its first optimizer step runs, and with
                      # dynamic batching their rows
                      "rollout_n", "global_batch_size"})
CARRIED_KNOBS: dict[str, frozenset[str]] = {
    phase: _CARRIED for phase in ("rollout", "experience", "validation")}


def carried_knobs(phase: str | None, separate: bool = False) -> frozenset[str]:
    """The update's knobs `phase` reads through the segments the run's first update left
    (CARRIED_KNOBS): none for a phase the engine's own GPUs run (a separate placement's
    config.ENGINE_PHASES), nor for one that is no phase."""
    if phase is None or (separate and phase in ENGINE_PHASES):
        return frozenset()
    return CARRIED_KNOBS.get(phase, frozenset())



def phase_knobs(phase: str, config: ProbeConfig) -> frozenset[str]:
    """The knobs that move `phase`'s peak for `config`: PHASE_KNOBS, less the engine's
    reservation in the trained phases of a config whose engine sleeps (engine_held holds
    nothing of it there)."""
    moving = PHASE_KNOBS[phase]
    if phase in ("rollout", "validation") or not (config.engine_reserves
                                                  and config.enable_sleep):
        return moving
    return moving - frozenset(_ENGINE_KNOBS)


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


def vision_forward_bytes(s: Sizing) -> int:
    """The ViT's no-grad forward for one sequence's image: 4 hv + 3 Iv values per patch (its
    SwiGLU's three I-wide tensors), in the compute dtype."""
    shape = s.shape
    return (4 * shape.vision_hidden + 3 * shape.vision_intermediate) * s.compute_bytes \
        * s.patches


def forward_bytes(s: Sizing, rows: int, tokens: int, adapters: bool = False) -> int:
    """A no-grad forward of `rows` sequences of `tokens` tokens: one layer's live tensors
    (forward_bytes_per_token, or through LoRA's `adapters` lora_forward_bytes_per_token)
    and each image's (vision_forward_bytes)."""
    per_token = lora_forward_bytes_per_token(s) if adapters \
        else forward_bytes_per_token(s.shape, s.compute_bytes)
    return rows * (tokens * per_token + vision_forward_bytes(s))


def lora_forward_bytes_per_token(s: Sizing) -> int:
    """One layer's live tensors per token in a no-grad forward through LoRA-wrapped
    projections. peft's Linear.forward (0.21, tuners/lora/layer.py) runs the base layer,
    casts its input to lora_A's dtype (tuners_utils.py, `_cast_input_dtype`), then adds
    `lora_B(lora_A(x)) * scaling` to the base's result, not in place: one I-wide tensor
    beyond the SwiGLU's three at the MLP. Under FSDP1 the adapters are units of their own,
    still fp32 when the input is cast: the input's fp32 copy too (h wide: the peak is at
    up_proj; model_vs_trace.py's 7B FSDP1 LoRA rank of 4, to 0.1%). On one GPU
    under autocast over fp32 weights the peak is at down_proj's adapters: its input (the
    SwiGLU's product), peft's fp32 copy of it and autocast's cast of that back for lora_A;
    the base's result and the fp32 residual stream's four h-wide tensors (model_vs_trace.py's
    1.5B LoRA row on one GPU, traced: 8 I + 18 h bytes a token, to 0.2%)."""
    shape, c = s.shape, s.compute_bytes
    if s.autocast_casts:
        return (2 * c + PARAM_BYTES) * shape.intermediate + (c + 4 * PARAM_BYTES) * shape.hidden
    fp32_input = PARAM_BYTES * shape.hidden if s.config.flat_shards(s.shards) else 0
    return forward_bytes_per_token(shape, c) + c * shape.intermediate + fp32_input


# Autocast over fp32 weights (one GPU: no FSDP mixed precision makes them bf16) casts the
# fp32 residual stream's normed hidden states to bf16 for each input projection on its own
# (q, k, v, the MLP's gate and up) and saves each cast for the backward, beside the
# rotary's fp32 products: bytes per token per layer beyond the formula, measured by the trace
# of a 0.5B update on one GPU (12.4 h there: a measured term, not derived op by op).
AUTOCAST_INPUT_CAST_BYTES_PER_HIDDEN = 12
# With LoRA's frozen base there, the base's matmuls save no input, but each adapter's
# lora_A saves its own cast of peft's fp32 copy of its input (q, k, v, o, gate and up each,
# down's I-wide one in the formula's place): 4.5 h bytes a token a layer beyond the formula,
# measured by the traces of a 1.5B (4.56 h) and a VL-7B (4.48 h) LoRA update on one GPU
# (benchmarks/model_vs_trace.py's LoRA rows on one GPU: a measured term).
AUTOCAST_ADAPTER_INPUT_HALF_BYTES_PER_HIDDEN = 9  # 4.5 h: halves of a byte a hidden value


def saved_activation_bytes(s: Sizing, rows: int, checkpointing: bool,
                           recomputing: bool = True,
                           frozen_base: bool | None = None) -> tuple[int, int]:
    """What a micro-batch of `rows` sequences saves for its backward: the decoder's
    activations (Korthikanti et al. 2022, activation_bytes_per_token) and the ViT's (per
    patch, vision_activation_bytes_per_patch); with checkpointing, and `recomputing`, one
    layer's recomputed in the backward. On one GPU under autocast, each input projection's
    own cast of its input too (AUTOCAST_INPUT_CAST_BYTES_PER_HIDDEN), unless the base is
    frozen (`frozen_base`, LoRA's: its matmuls save no input; on a sharded rank, whose FSDP
    runs the layers in bf16, its norms keep no cast input: the traces of held-out grid 3's
    FSDP1 LoRA ranks, rows 00 and 08; on one GPU, fp32 weights under autocast, each
    adapter saves its own cast input: AUTOCAST_ADAPTER_INPUT_HALF_BYTES_PER_HIDDEN). A
    frozen base's vision tower
    saves nothing: it has no adapters (lora.py, EasyR1's `exclude_modules`) and nothing in
    it or before it needs a gradient (row 08's trace: no ViT tensor live at its peak)."""
    seq, c, shape = s.config.sequence_length, s.compute_bytes, s.shape
    frozen = s.config.uses_lora if frozen_base is None else frozen_base
    per_token = activation_bytes_per_token(shape, checkpointing, c, recomputing,
                                           frozen_norms=frozen and s.shards > 1)
    if s.autocast_casts:
        layers = (1 if recomputing else 0) if checkpointing else shape.layers
        per_token += (AUTOCAST_ADAPTER_INPUT_HALF_BYTES_PER_HIDDEN * shape.hidden // 2
                      if frozen else AUTOCAST_INPUT_CAST_BYTES_PER_HIDDEN * shape.hidden) * layers
    vision = 0 if frozen else \
        rows * s.patches * vision_activation_bytes_per_patch(shape, checkpointing, c, recomputing)
    return rows * seq * per_token, vision


def generation_bytes(s: Sizing, sequences: int) -> dict[str, int]:
    """An engine generating `sequences` (max_num_seqs at a time) that grows with its batch, at
    the larger of its two moments: the prefill's last layer (the prompts' KV cache and one
    layer's forward) or the decode's last step (the whole KV cache); the KV cache
    (kv_cache_bytes) with its KV heads split over the tensor-parallel ranks, the sampler's
    logits in the compute dtype and fp32 at both. {} for an engine with vLLM's memory: it
    generates inside its reservation."""
    config, c = s.config, s.compute_bytes
    if config.engine_reserves:
        return {}
    batch, tp = min(sequences, config.max_num_seqs), config.rollout_tensor_parallel
    prompts = kv_cache_bytes(s.shape, batch * config.max_prompt_length, c) // tp
    whole = kv_cache_bytes(s.shape, batch * config.sequence_length, c) // tp
    prefill = forward_bytes(s, batch, config.max_prompt_length)
    kv, prefill = (prompts, prefill) if prompts + prefill > whole else (whole, 0)
    return {"kv_cache": kv, "prefill": prefill,
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
        return engine_weight_bytes(s) + config.kv_cache_memory_bytes + engine_profile_bytes(s)
    if engine_capacity_bytes is None:
        raise ValueError("a vllm-like engine reserves a share of the device: pass "
                         "engine_capacity_bytes")
    return int(config.gpu_memory_utilization * engine_capacity_bytes)


def engine_profile_bytes(s: Sizing) -> int:
    """What an engine with vLLM's memory keeps of its reservation for its forwards, outside
    its weights and KV pool: its profile run's peak, a prefill chunk of at most
    max_num_batched_tokens and a sampler of max_num_seqs rows' fp32 logits (the probe's
    engine.py, _size_pool: the pool is the reservation less the weights and this)."""
    config = s.config
    rows = max(1, min(config.max_num_seqs,
                      config.max_num_batched_tokens // config.max_prompt_length))
    return forward_bytes(s, rows, config.max_prompt_length) \
        + config.max_num_seqs * s.shape.vocab * 4


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
    and the reference's FSDP root, kept gathered from its last forward (kept_root_bytes;
    the actor's is resharded by its update's backward: model_vs_trace.py's sharded ranks
    with LoRA, which has no reference model, and FSDP2's with the reference on the host
    traced no root at the rollout's peak, where the model had one: 0.56 to 2.0 GiB over)."""
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
    root = kept_root_bytes(s, actor=False)
    return {**states, "reference_root": root} if root else states


def rollout_phase(s: Sizing, sequences: int, states: dict[str, int],
                  context: int) -> PhaseEstimate:
    """The rollout: `states` (rollout_states) and generating `sequences`, or a sharded engine
    waking, whichever is more. An engine with vLLM's memory wakes its weights and KV pool,
    which leave its profile's share of the reservation free (engine_profile_bytes), and
    loads the gathered tensors into that first: the profile's share is counted off the
    wake (model_vs_trace.py's sharded vllm-like ranks traced their wake with the pool and
    the gathered embedding, the reservation less the profile: 0.15 to 1.2 GiB over)."""
    generating, wake = generation_bytes(s, sequences), wake_gather_bytes(s)
    if s.config.engine_reserves:
        wake = max(0, wake - engine_profile_bytes(s))
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
               "activations": forward_bytes(s, rows, config.sequence_length,
                                            adapters=config.uses_lora)}
    return forward if config.runs_experience_forward else dict.fromkeys(forward, 0)


def experience_phase(s: Sizing, share: DeviceShare, held: dict[str, int],
                     context: int) -> PhaseEstimate:
    """The experience phase: the actor's params and Adam state, the reference and the log-prob
    forwards (logprob_forward_bytes), or with a critic its value forward where that is more."""
    config = s.config
    psi, trained = s.shape.num_params + lora_param_count(s), trained_param_count(s)
    states = {"actor": shard_bytes(PARAM_BYTES, psi, s.shards),
              "adam": 0 if config.offload_optimizer
              else shard_bytes(ADAM_BYTES, trained, s.shards),
              "reference": reference_resident_bytes(s), **critic_held(s), **held}
    forward = logprob_forward_bytes(s, s.rows(share.responses_per_step, "experience"))
    gathering = fsdp_gather_bytes(s) if config.runs_experience_forward else 0
    if s.shards > 1 and config.uses_lora and gathering:
        # LoRA: the reference pass is the actor's own module with its adapters off, so one
        # root unit, gathered by the first forward and kept (the probe does not reshard it),
        # serves both; the head's logits come once the last layer is resharded (held-out
        # H200 grid 3, row 00: a 7B rank of 8 peaked at the root, the logits and a chunk).
        # FSDP2 copies a gathered unit out of its all-gather buffer into each parameter's
        # own (torch's _fsdp_collectives.py, foreach_all_gather_copy_out), and keeps the
        # last unit's buffer until the next one's is made: the root twice while the first
        # unit is gathered and copied out (root_gather_bytes; grid 3, row 07: two
        # embedding-sized blocks, a layer's buffer and its copies at the peak; a VL model's
        # first unit is a vision block: grid 2's row 01, a VL-7B rank of 8, held two roots
        # and 0.16 GiB, not two decoder layers); a layer's activations are live beside
        # the units in flight, not beside the logits (model_vs_trace.py's 7B, 3B and 0.5B
        # LoRA ranks of 8 and 4 traced their peaks without them, where counting them there
        # put the model over by exactly their size)
        root = fsdp_root_bytes(s)
        gathering = root_gather_bytes(s)
        at_layer = root + forward_units_bytes(s) + forward["activations"]
        ref_pass = peak = max(gathering, at_layer, root + forward["logits"])
    elif s.shards > 1:  # FSDP's gathered units (the reference's root among them, kept
        # from its last forward: kept_root_bytes), or a layer's activations beside the units
        # in flight and that kept root, or the logits once the last layer is resharded and
        # its activations gone, beside the gathered root and the other model's (the actor's
        # root stays gathered through the reference's pass, the reference's kept into the
        # actor's: held-out H200 grid 3, row 05, a 0.5B FSDP1 rank of 8, peaked at two roots
        # and two logits-sized blocks; model_vs_trace.py's 1.5B FSDP1 rank of 4 and grid 2's
        # 0.5B FSDP2 rank of 4 with its reference arriving from the host, the same to the
        # byte, where the layer's activations and units counted beside the logits put them
        # 0.8 and 0.15 GiB over)
        kept, root = kept_root_bytes(s, actor=False), fsdp_root_bytes(s)
        both_passes = config.runs_old_logprob_pass and config.holds_ref_copy
        at_layer = forward["cast_weights"] + forward["activations"] + kept
        at_logits = root + (root if both_passes else kept) + forward["logits"]  # kept <= root
        ref_pass = peak = max(at_layer, at_logits, gathering)
    else:  # one GPU: autocast's cache keeps the cast of each weight that requires a
        # gradient to the forward's end, under no_grad too, so it peaks with the logits
        # made inside autocast (held-out H200 rows: readme, 02), not with the unfused
        # path's fp32 copy of them, made once autocast has emptied its cache
        # (autocast_logits_bytes; the committed 0.5B rows' traces: the head's and the
        # layers' casts freed at that peak); LoRA's frozen base is cast op by op, not
        # kept (01), its adapters are (model_vs_trace.py's 1.5B and 3B LoRA rows, traced)
        cast = adapter_cast_bytes(s) if config.uses_lora else forward["cast_weights"]
        # the fused log-prob casts the head's weight once for all its chunks, so a frozen
        # head's cast (LoRA: not kept by autocast's cache) is live beside them (held-out H200
        # grid 3, row 02: a 0.5B LoRA rank peaked at the head's cast and two chunks; row 04,
        # unfused, frees it after its matmul)
        head = s.compute_bytes * s.shape.embedding_params if config.uses_lora \
            and config.fused_logprob and s.autocast_casts else 0
        ref_pass = max(forward["logits"] + head, forward["activations"])  # weights: bf16
        inside = autocast_logits_bytes(s, s.rows(share.responses_per_step, "experience"),
                                       config.entropy_metric and config.runs_old_logprob_pass) \
            if config.runs_experience_forward else 0
        peak = max(cast + max(inside + head, forward["activations"]), ref_pass)
    # a reference waiting on the host is on the device for its own pass only
    arriving = reference_bytes(s) - states["reference"]
    peak = max(peak, arriving + ref_pass if arriving else 0)
    phase = PhaseEstimate(sum(states.values()), peak, context,
                          {**states, **forward, "fsdp_gather": gathering,
                           "reference_pass": arriving},
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
              "kept_roots": kept_root_bytes(s, actor=True), **held}
    text, vision = saved_activation_bytes(s, rows, config.critic_gradient_checkpointing,
                                          frozen_base=False)
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
    """The actor's update: its 16 bytes per parameter and the resident reference, then the
    most of its moments (a 7B rank's, traced, peaks at the third; one GPU's at the first):
    the logits' backward (what the forward saved, the weights it holds: FSDP's root or one
    GPU's casts; no gradient yet when one micro-batch makes the optimizer step), the layers'
    backward (cast weights, saved activations, one recomputed layer), the root's backward,
    the optimizer step."""
    config = s.config
    rows = s.rows(share.responses_per_minibatch, "update")
    states = {"params_grads_adam": actor_states(s).update_bytes,
              "reference": reference_resident_bytes(s),
              "kept_roots": kept_root_bytes(s, actor=False), **critic_held(s), **held}
    text, vision = saved_activation_bytes(s, rows, config.gradient_checkpointing)
    kept, kept_vision = saved_activation_bytes(s, rows, config.gradient_checkpointing,
                                               recomputing=False)
    logits = update_logits_bytes(s, rows)
    backward = {"cast_weights": update_cast_bytes(s), "activations": text,
                "vision_activations": vision}
    no_grads_yet = 0 if share.responses_per_minibatch > rows \
        else shard_bytes(GRAD_BYTES, trained_param_count(s), s.shards)
    at_logits = (fsdp_root_bytes(s) if s.shards > 1 else update_cast_bytes(s)) + kept \
        + kept_vision + logits - no_grads_yet
    # a micro-batch that makes the optimizer step alone makes the layers' gradients as its
    # backward frees their activations: beside all of them, the head's alone (made first, at
    # the logits' backward; LoRA trains no head). model_vs_trace.py's 1.5B on one
    # GPU with one micro-batch a step: 31.1 GiB of tensors at its backward's peak (30.4 so;
    # its optimizer step's 31.6 the phase's), where every gradient beside every activation
    # put the backward at 35.3
    head_grads = 0 if config.uses_lora or not no_grads_yet \
        else shard_bytes(GRAD_BYTES, s.shape.root_params, s.shards)
    layers = sum(backward.values()) - no_grads_yet + head_grads
    root, step = root_backward_bytes(s), optimizer_step_bytes(s, trained_param_count(s))
    gather = root_gather_bytes(s)
    return PhaseEstimate(sum(states.values()),
                         max(gather, at_logits, layers, root, step), context,
                         {**states, **backward, "root_gather": gather, "logits": logits,
                          "layers_backward": layers, "root_backward": root,
                          "optimizer_step": step},
                         critic_states(s).resident_bytes)
