"""The memory model: peak bytes per GPU and per phase of a GRPO step, from plain numbers.

No torch here: the inputs are the model's config numbers and the knobs, so `autotune estimate`
answers in milliseconds and the sweep can screen configs before running them.

Model states follow the standard mixed-precision Adam accounting as verl and EasyR1 run it
(actor in fp32, FSDP full sharding over N GPUs): 4 bytes of fp32 params, 4 of fp32 grads and 8
of Adam m and v per parameter, 16 in all, divided by N. Offload (verl/EasyR1 semantics) moves
params and optimizer state to host *between* phases: it lowers the rollout and log-prob phases,
never the update. Activations follow Korthikanti et al. 2022 (arXiv:2205.05198) adapted to
Qwen2's SwiGLU, GQA and RMSNorm; logits are [tokens, vocabulary]; the KV cache is
2 x layers x KV heads x head dim per token, as vLLM sizes it; a vllm-like rollout engine is the
resident states plus its reservation, gpu_memory_utilization x the device (section 4.2).
PPO's critic (probe/critic.py) is the decoder without the LM head plus a scalar head, with
the same 16 bytes per parameter in its own update phase (`critic_update`, before the actor's)
and its own offload between phases; its value forward in the experience phase holds its
params and no vocabulary logits.

Sharded over W > 1 GPUs, each phase peaks at one of FSDP's moments, all counted: the root
unit (embeddings, LM head) stays gathered between phases and is gathered anew beside the
last forward's copy (experience); a sleeping engine wakes one whole fp32 tensor at a time
(rollout); the root's backward holds its fp32 gradient for the reduce-scatter beside its
compute-dtype gradients (update).

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
from pathlib import Path
from typing import Any

from autotune.batching import worst_case_rows
from autotune.config import (
    ENTROPY_CHUNK_ROWS,
    FUSED_CHUNK_TOKENS,
    TRITON_DLOGITS_COLUMNS,
    TRITON_VOCAB_SPLIT,
    TRL_TOKEN_TILE,
    TRL_VOCAB_CHUNK,
    VLLM_ENGINES,
    DeviceShare,
    ProbeConfig,
    device_share,
)
from autotune.errors import ConfigError
from autotune.memory.allocator import AllocatorSettings
from autotune.memory.outside_torch import outside_torch
from autotune.memory.reserve import StepShape, phase_reserve_bytes
from autotune.registry import get_model_spec, read_model_path_config

PARAM_BYTES = 4  # fp32 master params
GRAD_BYTES = 4  # fp32 grads (FSDP reduces in fp32)
ADAM_BYTES = 8  # fp32 m and v

# The knobs that move each phase's peak in this model (a test checks every other knob leaves
# the phase unchanged). Offload moves states between phases, so it moves the rollout but not
# the update, which loads them back; the log-prob forwards load the actor params back too.
# The allocator's settings and the FSDP wrapper move what every phase holds on the card
# (the trace's replay sees them; this model only expandable segments, in the training
# phases' reserve): declared for every phase, so dominance never compares across them.
ALLOCATOR_KNOBS = ("expandable_segments", "fsdp_strategy")
_SHAPE_KNOBS = ("max_prompt_length", "max_response_length", "use_kl", "image_size_px",
                "algorithm",  # a critic is one more model on the GPU in every phase
                *ALLOCATOR_KNOBS)
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
                             "max_token_len_experience", *_CRITIC_HELD,
                             *_CRITIC_BATCH, *_HELD_KNOBS, *_SHAPE_KNOBS}),
    "critic_update": frozenset({*_CRITIC_BATCH, "critic_gradient_checkpointing",
                                "fused_optimizer",
                                "offload_params", "offload_optimizer", *_REF_KNOBS,
                                "dynamic_batching", *_HELD_KNOBS, *_SHAPE_KNOBS}),
    "update": frozenset({"micro_batch_size_update", "gradient_checkpointing", *_REF_KNOBS,
                         *_LOGITS_KNOBS, "entropy_coeff", "fused_optimizer",
                         "dynamic_batching", "max_token_len_update", *_CRITIC_HELD,
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
        shape: dict[str, Any] = {
                 "hidden": int(text["hidden_size"]), "layers": int(text["num_hidden_layers"]),
                 "heads": heads, "kv_heads": int(text.get("num_key_value_heads", heads)),
                 "head_dim": int(head_dim), "intermediate": int(text["intermediate_size"]),
                 "vocab": int(text["vocab_size"]), "tied_embeddings": bool(tied_embeddings),
                 "context_tokens": int(text.get("max_position_embeddings") or 32768)}
        if vision:
            shape.update(vision_hidden=int(vision["hidden_size"]),
                         vision_layers=int(vision["depth"]),
                         vision_intermediate=int(vision["intermediate_size"]),
                         vision_out_hidden=int(vision.get("out_hidden_size", text["hidden_size"])),
                         patch_px=int(vision.get("patch_size", 14)),
                         merge=int(vision.get("spatial_merge_size", 2)))
        return cls(**shape)

    @property
    def is_vl(self) -> bool:
        return self.vision_layers > 0

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

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


def vision_activation_bytes_per_patch(shape: ModelShape, checkpointing: bool,
                                      bytes_per_element: int = 2) -> int:
    """Saved tensors of the ViT per patch: 24 hv + 8 Iv bytes per block in bf16."""
    block = (24 * shape.vision_hidden + 8 * shape.vision_intermediate) * bytes_per_element // 2
    if checkpointing:
        return bytes_per_element * shape.vision_hidden * shape.vision_layers + block
    return shape.vision_layers * block


def kv_cache_bytes(shape: ModelShape, tokens: int, bytes_per_element: int = 2) -> int:
    """K and V of every layer for `tokens` tokens: 2 x bytes x L x kv_heads x head_dim each."""
    return 2 * bytes_per_element * shape.layers * shape.kv_heads * shape.head_dim * tokens


def forward_bytes_per_token(shape: ModelShape, bytes_per_element: int) -> int:
    """Live tensors of one layer's no-grad forward per token (SwiGLU's three I-wide tensors)."""
    return bytes_per_element * (4 * shape.hidden + 3 * shape.intermediate)


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


def estimate_memory(shape: ModelShape, config: ProbeConfig, num_gpus: int = 1,
                    on_gpu: bool = True, compute_bytes: int | None = None,
                    state_shards: int | None = None,
                    engine_capacity_bytes: int | None = None,
                    outside_bytes: int | None = None,
                    reserve_bytes: dict[str, int] | None = None) -> MemoryEstimate:
    """Peak bytes per GPU of each phase of one colocated GRPO step on `num_gpus` GPUs.

    Each GPU runs its share of the batches (config.device_share). The model states are
    sharded over `state_shards` GPUs (FSDP over the whole run by default, as the built-in
    probe shards them). `compute_bytes` is the width of the compute
    dtype: 2 (bf16) on a GPU, 4 (fp32) on a CPU by default. The rollout engine keeps a
    compute-dtype copy of the weights on each GPU, split over `rollout_tensor_parallel` GPUs
    (with the KV heads of its cache), and generates `max_num_seqs` sequences at a time.
    The vllm-like engine instead reserves `gpu_memory_utilization` x `engine_capacity_bytes`
    (the device, or its memory limit) whatever the batch, and holds it through the other
    phases too unless it sleeps; sleeping at level 1 keeps its weights in host memory.
    """
    c = compute_bytes or (2 if on_gpu else 4)
    share = device_share(config, num_gpus)
    n, psi = state_shards or num_gpus, shape.num_params
    states = model_state_bytes(psi, n, config.offload_params, config.offload_optimizer)
    actor = PARAM_BYTES * psi // n
    adam = ADAM_BYTES * psi // n
    ref = c * psi // n if config.use_kl else 0
    ref_resident = 0 if config.ref_on_host else ref
    tp = config.rollout_tensor_parallel
    policy = config.rollout_engine == "policy"  # the actor generates: no engine copy
    engine = 0 if policy else c * shape.engine_params(tp)
    # Compute-dtype weights the actor's forward uses: autocast's cast cache on one GPU, the
    # gathered FSDP units (root + about two layers in flight) on several.
    if n == 1:
        cast = c * psi if c < PARAM_BYTES else 0
    else:
        root = shape.embedding_params * (1 if shape.tied_embeddings else 2)
        cast = c * (root + 2 * shape.layer_params)
    # FSDP keeps the root unit (embeddings, LM head) gathered from its forward to the end of
    # the next backward, so between phases too (the rollout holds it), and twice over while
    # the next forward gathers it anew; a sharded rank's engine wakes one whole fp32 tensor
    # at a time (the largest, the embedding); the root's backward holds its fp32 gradient
    # for the reduce-scatter beside its compute-dtype embedding and head gradients: the
    # moments a 7B rank peaks at (benchmarks/results/gpu: the traced tensors at each peak)
    root_params = shape.embedding_params * (1 if shape.tied_embeddings else 2)
    root_held = c * root_params if n > 1 else 0
    wake_gather = 4 * shape.embedding_params if n > 1 and not policy else 0
    fsdp_gather = c * (3 * root_params + 2 * shape.layer_params) if n > 1 else 0
    root_backward = (2 * c * shape.embedding_params + 4 * root_params + root_held) \
        if n > 1 else 0
    # Optimizer step: foreach AdamW on a GPU keeps one fp32 shard-sized temporary; the CPU's
    # per-tensor loop, one of the largest tensor.
    step_temp = 4 * psi // n if on_gpu else 4 * shape.embedding_params
    if config.fused_optimizer:  # one kernel per tensor, in place
        step_temp = 0
    if on_gpu:
        context = outside_bytes if outside_bytes is not None else outside_torch(
            num_gpus, False, config.rollout_tensor_parallel).total_bytes
    else:
        context = CPU_CONTEXT_BYTES
    # PPO's critic: its own 16 bytes per parameter in its update, where its offload puts it
    # between phases; its forward gathers FSDP units as the actor's does (no LM head)
    psi_c = shape.critic_params if config.has_critic else 0
    critic = model_state_bytes(psi_c, n, config.critic_offload_params,
                               config.critic_offload_optimizer)
    critic_params = PARAM_BYTES * psi_c // n
    critic_adam = 0 if config.critic_offload_optimizer else ADAM_BYTES * psi_c // n
    if n == 1:
        critic_cast = c * psi_c if c < PARAM_BYTES else 0
    else:
        critic_cast = c * (shape.embedding_params + 2 * shape.layer_params) if psi_c else 0
    critic_held = {"critic": critic.resident_bytes} if psi_c else {}
    resting = critic.resident_bytes  # the critic's share of a phase it does not run in

    prompt, response = config.max_prompt_length, config.max_response_length
    seq = prompt + response
    vocab = shape.vocab
    patches = (config.image_size_px // shape.patch_px) ** 2 if shape.is_vl else 0
    vision_fwd = (4 * shape.vision_hidden + 3 * shape.vision_intermediate) * c * patches

    def generation(prompts: int) -> dict[str, int]:
        batch = min(prompts, config.max_num_seqs)
        return {"kv_cache": kv_cache_bytes(shape, batch * seq, c) // tp,
                "prefill": batch * (prompt * forward_bytes_per_token(shape, c) + vision_fwd),
                "sampling_logits": batch * vocab * (c + 4)}

    def fused_chunk(micro: int) -> int:
        return min(FUSED_CHUNK_TOKENS, micro * seq)

    triton = config.fused_logprob and config.fused_logprob_kernel == "triton"
    splits = -(-vocab // TRITON_VOCAB_SPLIT)
    trl = config.fused_logprob and config.fused_logprob_kernel == "trl"

    def trl_positions(micro: int) -> int:
        # TRL's head scores the completion tokens where Triton runs (a GPU), else every
        # position but each sequence's last
        return micro * response if on_gpu else micro * (seq - 1)

    def trl_logits(micro: int, backward: bool) -> int:
        # one reused [4,096 tokens, 32,768 columns] buffer in the compute dtype, a copy of
        # the scored hidden states and TRL's seven fp32 accumulators per token; without
        # Triton (a CPU) the fold's fp32 temporaries of a tile, 3 in the forward and 8 in
        # the backward; the backward's fp32 gradients of the hidden states and the weight
        positions = trl_positions(micro)
        rows = min(positions, TRL_TOKEN_TILE)
        held = rows * TRL_VOCAB_CHUNK * c + positions * (shape.hidden * c + 28)
        fold = 0 if on_gpu else rows * min(vocab, TRL_VOCAB_CHUNK) * 4 * (8 if backward else 3)
        grads = 4 * (positions * shape.hidden + vocab * shape.hidden) if backward else 0
        return held + fold + grads

    def triton_forward(micro: int) -> int:
        # every position's fp32 partials per vocabulary split (max, sum, entropy's b), then
        # the log-prob, entropy, max and the two reduced sums per position
        return micro * seq * (12 * splits + 20)

    def triton_backward(micro: int) -> int:
        # the logits' gradient for one band of vocabulary columns in the compute dtype, and
        # the three fp32 per-position values the forward saved
        return micro * seq * (min(TRITON_DLOGITS_COLUMNS, vocab) * c + 12)

    def logprob_logits(micro: int, with_entropy: bool = False) -> int:
        # the full [seq, vocab] logits and the fp32 response log-softmax; on a GPU the bf16
        # logits are freed once their fp32 response slice exists. With the entropy (no
        # gradient), its softmax and logsumexp's exponentials beside the fp32 slice, or a
        # chunk's of them. Fused: one chunk's logits in the compute dtype and fp32, then its
        # fp32 log-softmax (and the entropy's two)
        if triton:  # the entropy comes with the log-probs at no extra memory
            return triton_forward(micro)
        if trl:
            return trl_logits(micro, backward=False)
        if config.fused_logprob:
            return fused_chunk(micro) * vocab * max(c + 4, 12 if with_entropy else 8)
        entropy = 0
        if with_entropy:
            positions = micro * response
            entropy = 4 * vocab * (positions + 2 * (min(ENTROPY_CHUNK_ROWS, positions)
                                                    if config.entropy_chunking else positions))
        return max(micro * (c * seq + 4 * response) * vocab, micro * 8 * response * vocab,
                   entropy)

    def entropy_grad(micro: int) -> int:
        # entropy_coeff: the entropy's fp32 softmax, product and exponentials kept for the
        # backward and its gradient (recomputed, checkpointed, at the same point: the same
        # peak), one more fp32 tensor with chunks (each chunk's copies); measured by the
        # trace (tests/test_logprob.py)
        if not config.entropy_coeff:
            return 0
        return micro * response * vocab * (20 if config.entropy_chunking else 16)

    phases: dict[str, PhaseEstimate] = {}
    rollout_states = {"resident": states.resident_bytes + ref_resident, **critic_held,
                      "engine_weights": engine}
    if policy:  # the actor's own params on the device (offloaded ones come back) and the
        # compute-dtype weights its forward uses
        rollout_states = {"resident": states.resident_bytes + ref_resident, **critic_held,
                          "actor_params": actor if config.offload_params else 0,
                          "cast_weights": cast}
    rollout = generation(share.responses_per_step)
    held: dict[str, int] = {}  # what a vllm-like engine that does not sleep keeps
    engine_host = 0
    vllm_like = config.rollout_engine in VLLM_ENGINES
    if vllm_like:
        if config.kv_cache_memory_bytes is not None:  # the pool in bytes: what it takes
            rows = max(1, min(config.max_num_seqs,
                              config.max_num_batched_tokens // config.max_prompt_length))
            profile = (rows * (prompt * forward_bytes_per_token(shape, c) + vision_fwd)
                       + config.max_num_seqs * vocab * 4)  # a prefill chunk, the sampler
            reservation = engine + config.kv_cache_memory_bytes + profile
        elif engine_capacity_bytes is None:
            raise ValueError("a vllm-like engine reserves a share of the device: pass "
                             "engine_capacity_bytes")
        else:
            reservation = int(config.gpu_memory_utilization * engine_capacity_bytes)
        rollout_states = {"resident": states.resident_bytes + ref_resident, **critic_held,
                          "engine_reservation": reservation}
        rollout = {}
        if not config.enable_sleep:
            held = {"engine_reservation": reservation}
        elif config.sleep_level == 1:
            engine_host = engine
    if root_held:
        rollout_states["fsdp_root"] = root_held
    phases["rollout"] = PhaseEstimate(
        sum(rollout_states.values()), max(sum(rollout.values()), wake_gather), context,
        {**rollout_states, **rollout, "wake_gather": wake_gather}, resting)

    knobs = config.as_dict()  # rows of the largest micro-batch, every response at full length
    mbe = worst_case_rows(knobs, share.responses_per_step, "experience")
    exp_states = {"actor": actor, "adam": 0 if config.offload_optimizer else adam,
                  "reference": ref, **critic_held, **held}
    # the old-log-prob forward (the actor's cast weights, the entropy's), then the
    # reference's (its own compute-dtype weights: gathered like the actor's when sharded);
    # with neither (TRL at beta 0 and one optimizer step), no forward at all
    old_pass = config.runs_old_logprob_pass
    experience = {"cast_weights": cast if old_pass or n > 1 else 0,
                  "logits": logprob_logits(mbe, config.entropy_metric and old_pass),
                  "activations": mbe * (seq * forward_bytes_per_token(shape, c) + vision_fwd)}
    if not (old_pass or config.use_kl):
        experience = dict.fromkeys(experience, 0)
    gathering = fsdp_gather if old_pass or config.use_kl else 0
    # on one GPU the no-grad forward keeps no cast weights (autocast caches only for a
    # gradient) and each layer's activations are gone by the logits: those peak apart
    forward = sum(experience.values()) if n > 1 else max(
        experience["logits"], experience["cast_weights"] + experience["activations"])
    phases["experience"] = PhaseEstimate(
        sum(exp_states.values()), max(forward, gathering), context,
        {**exp_states, **experience, "fsdp_gather": gathering}, resting)
    if psi_c:  # the critic's value forward, after the actor's and the reference's
        mbc = worst_case_rows(knobs, share.responses_per_step, "critic_update")
        values_states = {"resident": states.resident_bytes + ref_resident,
                         "critic_params": critic_params, "critic_adam": critic_adam, **held}
        values = {"critic_cast_weights": critic_cast,
                  "critic_activations": mbc * (seq * forward_bytes_per_token(shape, c)
                                               + vision_fwd) + mbc * seq * (c + 4)}
        values_phase = PhaseEstimate(
            sum(values_states.values()), sum(values.values()), context,
            {**values_states, **values}, critic_params + critic_adam + sum(values.values()))
        if values_phase.total_bytes > phases["experience"].total_bytes:
            phases["experience"] = values_phase

    mbu = worst_case_rows(knobs, share.responses_per_minibatch, "update")
    ckpt = config.gradient_checkpointing
    if psi_c:
        mbc = worst_case_rows(knobs, share.responses_per_minibatch, "critic_update")
        ckpt_c = config.critic_gradient_checkpointing
        critic_states = {"critic_params_grads_adam": critic.update_bytes,
                         "resident": states.resident_bytes + ref_resident, **held}
        critic_backward = {
            "critic_cast_weights": critic_cast,
            "critic_activations": mbc * seq * activation_bytes_per_token(shape, ckpt_c, c),
            "critic_vision_activations": mbc * patches * vision_activation_bytes_per_patch(
                shape, ckpt_c, c),
            "critic_values": mbc * seq * (c + 3 * 4)}
        critic_step = 0 if config.fused_optimizer else \
            4 * psi_c // n if on_gpu else 4 * shape.embedding_params
        critic_transient = max(sum(critic_backward.values()), critic_step)
        phases["critic_update"] = PhaseEstimate(
            sum(critic_states.values()), critic_transient, context,
            {**critic_states, **critic_backward, "critic_optimizer_step": critic_step},
            critic.update_bytes + critic_transient)
    upd_states = {"params_grads_adam": states.update_bytes, "reference": ref_resident,
                  **critic_held, **held}
    backward = {"cast_weights": cast,
                "activations": mbu * seq * activation_bytes_per_token(shape, ckpt, c),
                "vision_activations": mbu * patches * vision_activation_bytes_per_patch(
                    shape, ckpt, c),
                # unfused, the fp32 log-softmax is kept for the backward; fused, the backward
                # recomputes one chunk at a time: its logits, softmax and gradient
                "logits": max(triton_forward(mbu), triton_backward(mbu)) if triton else
                trl_logits(mbu, backward=True) if trl else
                fused_chunk(mbu) * vocab * (max(c + 4, 8) + c) if config.fused_logprob else
                logprob_logits(mbu) + mbu * 4 * response * vocab + entropy_grad(mbu)}
    transient = max(sum(backward.values()), root_backward, step_temp)
    parts = {**upd_states, **backward, "root_backward": root_backward,
             "optimizer_step": step_temp}
    phases["update"] = PhaseEstimate(sum(upd_states.values()), transient, context, parts,
                                     resting)

    if share.val_prompts:
        validation = {} if vllm_like else generation(share.val_prompts)
        phases["validation"] = PhaseEstimate(sum(rollout_states.values()),
                                             sum(validation.values()), context,
                                             {**rollout_states, **validation}, resting)
    if on_gpu:  # what the caching allocator reserves beyond the tensors (reserve.py)
        reserve = reserve_bytes if reserve_bytes is not None else \
            allocator_reserve(shape, config, num_gpus, on_gpu, compute_bytes, state_shards)
        for name, extra in reserve.items():
            if name in phases and extra:
                phase = phases[name]
                phases[name] = dataclasses.replace(
                    phase, transient_bytes=phase.transient_bytes + extra,
                    parts={**phase.parts, "allocator_reserve": extra})
    offload_host = states.host_offload_bytes + (ref if config.ref_on_host else 0) \
        + engine_host + critic.host_offload_bytes
    return MemoryEstimate(phases, offload_host, share)


def allocator_reserve(shape: ModelShape, config: ProbeConfig, num_gpus: int = 1,
                      on_gpu: bool = True, compute_bytes: int | None = None,
                      state_shards: int | None = None, **_: Any) -> dict[str, int]:
    """What the caching allocator reserves beyond the tensors in each training phase of
    `config` on a GPU (reserve.py's sketch, replayed; {} on a CPU). A search over one knob
    (a length, a micro-batch) holds it fixed at the config asked about, passing it to
    estimate_memory as `reserve_bytes`: the sketch takes tens of milliseconds a config, and
    a fragmentation figure is no order along an axis, which the searches assume."""
    if not on_gpu:
        return {}
    n, c = state_shards or num_gpus, compute_bytes or 2
    return phase_reserve_bytes(step_shape(shape, config, n, c, device_share(config, num_gpus)),
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
        with_reference=config.use_kl, fused_optimizer=config.fused_optimizer,
        # the two norms as one block
        vision_block_params=(sum(block[:2]), *block[2:]) if block else (),
        vision_blocks=shape.vision_layers, vision_hidden=shape.vision_hidden,
        vision_intermediate=shape.vision_intermediate,
        patches_per_row=patches)


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
