"""Model states: what each model holds on one GPU between phases and in its update.

Model states follow the standard mixed-precision Adam accounting as verl and EasyR1 run it
(actor in fp32, FSDP full sharding over N GPUs): 4 bytes of fp32 params, 4 of fp32 grads and 8
of Adam m and v per parameter, 16 in all, divided by N; LoRA's frozen base keeps its 4-byte
params only. Offload (verl/EasyR1 semantics) moves params and optimizer state to host
*between* phases: it lowers the rollout and log-prob phases, never the update. The reference
model (use_kl) is a compute-dtype copy sharded as the actor's, the rollout engine a
compute-dtype copy split over its tensor-parallel ranks. PPO's critic
(probe/modeling/critic.py) is the decoder without the LM head plus a scalar head, with the same
16 bytes per parameter and its own offload between phases.

Sharded over W > 1 GPUs, each phase peaks at one of FSDP's moments, each sized here: the root
unit (embeddings, LM head) stays gathered between phases and is gathered anew beside the
last forward's copy (experience); a sleeping engine wakes one whole fp32 tensor at a time
(rollout); the root's backward holds its fp32 gradient for the reduce-scatter beside its
compute-dtype gradients (update). A forward's compute-dtype weights and AdamW's step are
sized here too, as a model of that many parameters holds them.

Sizing is what every term of one GPU's step reads (here, in logits.py and in phases.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.batching import worst_case_rows
from autotune.config import ProbeConfig, autocast_casts_weights
from autotune.memory.shape import ModelShape

PARAM_BYTES = 4  # fp32 master params
GRAD_BYTES = 4  # fp32 grads (FSDP reduces in fp32)
ADAM_BYTES = 8  # fp32 m and v


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on one GPU, in the update and between phases, and on the host."""

    update_bytes: int  # params + grads + Adam state during the update
    resident_bytes: int  # what stays on the GPU between phases (grads freed)
    host_offload_bytes: int  # what offload holds in host memory for this GPU


def model_state_bytes(num_params: int, num_gpus: int = 1, offload_params: bool = False,
                      offload_optimizer: bool = False,
                      trained_params: int | None = None) -> ModelStates:
    """16 bytes per trained parameter in the update, sharded over `num_gpus` (FSDP / ZeRO-3);
    a frozen one (LoRA's base: `trained_params` of the `num_params` are trained) keeps its
    4-byte fp32 param only."""
    if num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus}: need at least one GPU")
    trained = num_params if trained_params is None else trained_params
    params = PARAM_BYTES * num_params // num_gpus
    grads = GRAD_BYTES * trained // num_gpus
    adam = ADAM_BYTES * trained // num_gpus
    offloaded = (params if offload_params else 0) + (adam if offload_optimizer else 0)
    return ModelStates(update_bytes=params + grads + adam,
                       resident_bytes=params + adam - offloaded,
                       host_offload_bytes=offloaded)


@dataclass(frozen=True)
class Sizing:
    """What every term of one GPU's step reads: the model's numbers, the knobs, the ranks the
    model states are sharded over (FSDP; 1: none), the compute dtype's width, and whether the
    device is a GPU (a CPU stands in for one in the demo and the tests)."""

    shape: ModelShape
    config: ProbeConfig
    shards: int
    compute_bytes: int
    on_gpu: bool

    def rows(self, sequences: int, phase: str) -> int:
        """Sequences in `phase`'s largest micro-batch of `sequences`, every response at full
        length (batching.worst_case_rows)."""
        return worst_case_rows(self.config.as_dict(), sequences, phase)

    @property
    def autocast_casts(self) -> bool:
        """Whether autocast casts the fp32 weights op by op (one GPU, a narrower compute
        dtype: config.autocast_casts_weights)."""
        return autocast_casts_weights(self.shards, self.compute_bytes)

    @property
    def patches(self) -> int:
        """Vision patches of one sequence's image (0: a text model)."""
        return (self.config.image_size_px // self.shape.patch_px) ** 2 if self.shape.is_vl else 0


def shard_bytes(bytes_per_param: int, params: int, shards: int) -> int:
    """One rank's FSDP shard of `params` parameters held at `bytes_per_param` each."""
    return bytes_per_param * params // shards


def lora_param_count(s: Sizing) -> int:
    """The actor's LoRA adapters' parameters (0 without LoRA)."""
    return s.shape.lora_params(s.config.lora_rank, s.config.lora_target_modules)


def trained_param_count(s: Sizing) -> int:
    """The actor's parameters with a gradient and AdamW state: all, or LoRA's adapters."""
    return lora_param_count(s) if s.config.uses_lora else s.shape.num_params


def actor_states(s: Sizing) -> ModelStates:
    """The actor's fp32 params, grads and Adam state (model_state_bytes; with LoRA the frozen
    base's params and the adapters' all three), its offload applied."""
    config = s.config
    return model_state_bytes(s.shape.num_params + lora_param_count(s), s.shards,
                             config.offload_params, config.offload_optimizer,
                             trained_params=trained_param_count(s))


def critic_param_count(s: Sizing) -> int:
    """PPO's critic's parameters (ModelShape.critic_params; 0 without a critic)."""
    return s.shape.critic_params if s.config.has_critic else 0


def critic_states(s: Sizing) -> ModelStates:
    """PPO's critic (probe/modeling/critic.py): its own 16 bytes per parameter in its update,
    where its offload puts it between phases (all zero without a critic)."""
    config = s.config
    return model_state_bytes(critic_param_count(s), s.shards, config.critic_offload_params,
                             config.critic_offload_optimizer)


def critic_held(s: Sizing) -> dict[str, int]:
    """The critic where it waits through the actor's phases ({} without one)."""
    return {"critic": critic_states(s).resident_bytes} if s.config.has_critic else {}


def reference_bytes(s: Sizing) -> int:
    """The reference model (use_kl): its params in the compute dtype, sharded as the actor's
    (none with LoRA: the reference is the actor with its adapters off)."""
    return shard_bytes(s.compute_bytes, s.shape.num_params, s.shards) \
        if s.config.holds_ref_copy else 0


def reference_resident_bytes(s: Sizing) -> int:
    """The reference on the device between its forwards (none where it waits on the host)."""
    return 0 if s.config.ref_on_host else reference_bytes(s)


def resident_bytes(s: Sizing) -> int:
    """What stays on the device between phases: the actor's states (grads freed, offload
    applied) and the reference where it waits there."""
    return actor_states(s).resident_bytes + reference_resident_bytes(s)


def engine_weight_bytes(s: Sizing) -> int:
    """The rollout engine's compute-dtype copy of the weights, one rank's share of a
    `rollout_tensor_parallel` engine (none where the actor generates itself: no copy)."""
    if s.config.actor_generates:
        return 0
    return s.compute_bytes * s.shape.engine_params(s.config.rollout_tensor_parallel)


def cast_weight_bytes(s: Sizing, params: int, root: int) -> int:
    """Compute-dtype weights the forward of a model of `params` parameters uses: autocast's
    cast cache on one GPU (none in fp32), the gathered FSDP units on several (its root unit of
    `root` parameters and about two layers in flight). None for a model that is not there."""
    if not params:
        return 0
    if s.shards == 1:
        return s.compute_bytes * params if s.autocast_casts else 0
    return s.compute_bytes * (root + 2 * s.shape.layer_params)


def adapter_cast_bytes(s: Sizing) -> int:
    """LoRA's adapters cast to the compute dtype on one GPU under autocast, whose cache keeps
    the cast of every leaf that requires a gradient to the forward's end (torch's
    autocast_mode.cpp, `cached_cast`), under no_grad too; the frozen base's casts are not
    kept. None sharded (FSDP's mixed precision gathers them in the compute dtype) or in
    fp32."""
    return s.compute_bytes * lora_param_count(s) if s.autocast_casts else 0


def actor_cast_bytes(s: Sizing) -> int:
    """The actor's (and the reference's) compute-dtype weights in a forward (cast_weight_bytes)."""
    return cast_weight_bytes(s, s.shape.num_params, s.shape.root_unit_params)


def update_cast_bytes(s: Sizing) -> int:
    """The actor's compute-dtype weights through its update's backward. On one GPU with LoRA
    and checkpointing, autocast caches no cast of the frozen base (it caches only leaves that
    need a gradient) and no layer saves one (checkpointing saves the layer's input): one
    layer's casts at a time and the head's, which its matmul saves outside the checkpoints
    (traced: a 7B on one GPU held 14 GiB less than all the casts). Without checkpointing
    each layer's matmuls save their casts, the head's too, and autocast's cache the
    adapters'; no vision tower's (frozen, nothing before it needs a gradient: its casts go
    op by op) and no embedding's (a lookup): model_vs_trace.py's VL-7B LoRA row on one GPU
    traced 13.0 GiB of casts where every parameter's put 15.4."""
    if s.autocast_casts and s.config.uses_lora:
        layers = 1 if s.config.gradient_checkpointing else s.shape.layers
        return s.compute_bytes * (s.shape.embedding_params + layers * s.shape.layer_params) \
            + (0 if s.config.gradient_checkpointing else adapter_cast_bytes(s))
    return actor_cast_bytes(s)


def critic_cast_bytes(s: Sizing) -> int:
    """The critic's compute-dtype weights in a forward: its root unit has no LM head."""
    return cast_weight_bytes(s, critic_param_count(s), s.shape.embedding_params)


# Sharded over W > 1 GPUs each phase peaks at one of FSDP's moments: the four below, the
# moments a 7B rank peaks at (benchmarks/results/gpu: the traced tensors at each peak).
def fsdp_root_bytes(s: Sizing) -> int:
    """The root unit (embeddings, LM head, a VL model's vision merger) gathered, one rank's
    compute-dtype copy: FSDP keeps it from its forward to the end of the next backward; a
    no-grad forward's (the reference's) to its next forward (kept_root_bytes), so the
    rollout holds that one."""
    return s.compute_bytes * s.shape.root_unit_params if s.shards > 1 else 0


def wake_gather_bytes(s: Sizing) -> int:
    """A sharded rank's engine wakes one whole fp32 tensor at a time: the largest, the
    embedding (none without an engine copy). Under FSDP1 the weight sync first reads a
    sharded state dict, which copies the rank's whole fp32 shard (its chunk of each flat
    parameter cloned), and holds it while the tensors are gathered: 3.5 GiB on the H200's
    7B rank (benchmarks/results/gpu/gpu_evidence_rerun.txt, FSDP1 against FSDP2). With
    offload_params the rank's shard comes back to the device for the sync and leaves after
    it (verl's sharding manager: load_fsdp_model_to_gpu, then the state dict): held-out H200
    row 06's rollout was 3.4 GiB over the model without it."""
    if s.shards == 1 or s.config.actor_generates:
        return 0
    shard = shard_bytes(PARAM_BYTES, s.shape.num_params + lora_param_count(s), s.shards)
    state_dict = shard if s.config.flat_shards(s.shards) else 0
    loaded = shard if s.config.offload_params else 0
    return loaded + state_dict + 4 * s.shape.embedding_params


def forward_units_bytes(s: Sizing) -> int:
    """The layer units gathered at once in a sharded no-grad forward, beside its root: FSDP1
    unshards each flat parameter at its unit's pre-forward and reshards it at its
    post-forward, with no forward prefetch (torch's default, and verl's): one layer;
    FSDP2 copies a unit out of its all-gather buffer and keeps the buffer until the next
    unit's is made: two. model_vs_trace.py's 7B FSDP1 LoRA ranks of 8 and 4 traced one."""
    layers = 1 if s.config.flat_shards(s.shards) else 2
    return s.compute_bytes * layers * s.shape.layer_params if s.shards > 1 else 0


def fsdp_gather_bytes(s: Sizing) -> int:
    """A forward's gathered units: the root twice over (the last forward's copy, kept, beside
    the one the next forward gathers anew) and about two layers in flight."""
    if s.shards == 1:
        return 0
    return 3 * fsdp_root_bytes(s) + s.compute_bytes * 2 * s.shape.layer_params


def keeps_gathered_root(config: ProbeConfig, shards: int, placed: bool) -> bool:
    """Whether a sharded model's root unit stays gathered after a no-grad forward until its
    next forward (the probe does not reshard it, which verl and EasyR1 do after each
    log-prob pass: fsdp_workers.py, `_handle.reshard(True)`). Not when its states are
    `placed` in between under FSDP2 (moved to the host, or put on the device as the
    update starts: the probe's `_place_module` goes through `_apply`, which reshards every
    FSDP2 unit first, torch's FSDPModule._apply); FSDP1 moves its flat shards alone and
    keeps the unsharded storage. (The `grpo` space's safe config on a VL-7B rank of 8,
    traced: no reference root at the update's peak, 21.8 GiB of tensors where the model
    had 23.7 with it.)"""
    return shards > 1 and not (placed and not config.flat_shards(shards))


def kept_root_bytes(s: Sizing, actor: bool) -> int:
    """A sharded model's root unit kept gathered from its last no-grad forward
    (keeps_gathered_root): the reference's through the update and the next rollout, and
    with `actor` the actor's too until its update's forward (a PPO critic's update runs
    between). Held-out H200 rows 03 and 09: the critic's update held both, 4.2 GiB on a
    VL-7B rank of 4."""
    config = s.config
    if s.shards == 1:
        return 0
    reference = fsdp_root_bytes(s) if config.holds_ref_copy and \
        keeps_gathered_root(config, s.shards, config.ref_on_host) else 0
    old_pass = config.runs_old_logprob_pass or (config.uses_lora and config.use_kl)
    actor_kept = actor and old_pass and \
        keeps_gathered_root(config, s.shards, config.offload_params)
    return reference + (fsdp_root_bytes(s) if actor_kept else 0)


def root_gather_bytes(s: Sizing) -> int:
    """The root unit gathered anew at an update micro-batch's forward, the last one's
    resharded first (FSDP2's post-backward reshards it; the first micro-batch reshards the
    root the experience kept). FSDP2 all-gathers into one buffer and copies it out into each
    parameter's own before the buffer goes (torch's _fsdp_collectives.py,
    foreach_all_gather_copy_out), so the root is there twice; FSDP1 gathers its flat
    parameter in place, once. Held-out H200 grid 3, row 01 (a VL-7B FSDP2 LoRA rank of
    8): its update peaked there, the 2.12 GiB buffer beside the parameters' copies of it;
    without LoRA the root's backward holds more. FSDP2 keeps that buffer until the next
    unit's is made, so the first unit the forward gathers after the root is there too, as
    its own buffer and copies: a VL model's first vision block (its tower runs first), a text
    model's first layer (model_vs_trace.py's two 7B FSDP2 LoRA ranks of 4: two
    roots and two layers at the update's peak); FSDP1 gathers it in place beside the root."""
    unit = fsdp_root_bytes(s)
    first = s.compute_bytes * (sum(s.shape.vision_block_tensors) if s.shape.is_vl
                               else s.shape.layer_params) if s.shards > 1 else 0
    return unit + first if s.config.flat_shards(s.shards) else 2 * (unit + first)


def root_backward_bytes(s: Sizing) -> int:
    """The root's backward: its fp32 gradient made for the reduce-scatter beside its
    compute-dtype embedding and head gradients; the root is resharded first (FSDP2's
    FSDPParamGroup.post_backward and FSDP1's _post_backward_hook reshard, then reduce: a 7B
    rank's trace holds 6.1 GiB there, not 8.1). With LoRA no gradient: the root frozen,
    still gathered."""
    if s.shards == 1:
        return 0
    if s.config.uses_lora:
        return fsdp_root_bytes(s)
    return 2 * s.compute_bytes * s.shape.embedding_params + 4 * s.shape.root_params


def optimizer_step_bytes(s: Sizing, params: int) -> int:
    """AdamW's step over a model of `params` parameters: foreach on a GPU keeps one fp32
    shard-sized temporary; the CPU's per-tensor loop, one of the largest tensor (the
    embedding); the fused kernel, none (one kernel per tensor, in place)."""
    if s.config.fused_optimizer:
        return 0
    return shard_bytes(4, params, s.shards) if s.on_gpu else 4 * s.shape.embedding_params
