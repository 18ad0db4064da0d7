"""The canonical knobs of a GRPO or PPO run: one spelling, one type and the rules that are
properties of a config (what the algorithm trains, what the engine holds, who generates, how a
batch splits over GPUs).

The names here are the ones used in search-space YAML, the Optuna param names, results tables,
`--set key=value` and the trainer adapters' mapping tables.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from autotune.batching import ALGORITHM_WITH_CRITIC, BATCHED_PHASES, KnobValue
from autotune.config.kernels import IMAGE_TOKEN_PX

# a knob's value, and knobs by name where only some are given (a space's fixed values, a
# trainer's translation, --set): a whole config is a ProbeConfig
Knobs: TypeAlias = "dict[str, KnobValue]"

MAX_KNOB_VALUE = 2**24  # no batch, length or count in a real run comes near 16.7 million
# the phases of one step, in the trainers' order: PPO's critic is updated before the actor
# (verl's and EasyR1's RayPPOTrainer.fit: update_critic, then update_actor)
PHASES = ("rollout", "experience", "critic_update", "update", "validation")
# placement=separate: the engine's GPUs run the rollout, the trainer's every other phase and,
# once a step, the weight sync to the engine (memory/roles.py, config/pipeline.py)
ENGINE_PHASES = frozenset({"rollout"})
SYNC_PHASE = "weight_sync"
# grpo: no critic, group-relative advantages; ppo: GAE with a critic (a value model of the
# actor's architecture, trained on the same GPUs)
ALGORITHMS = ("grpo", "ppo")
CRITIC_KNOBS = ("critic_micro_batch_size_update", "critic_max_token_len_update",
                "critic_gradient_checkpointing", "critic_offload_params",
                "critic_offload_optimizer")  # read only where the algorithm has a critic
ALL_LINEAR = "all-linear"  # peft's (and the trainers') every linear layer but the LM head
# the linear layers of a decoder layer, by the names peft matches (every model autotune builds:
# Qwen2, Qwen2.5, Qwen2.5-VL's language model, Llama-style checkpoints)
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_KNOBS = ("lora_alpha", "lora_target_modules")  # read only where lora_rank > 0
# float knobs that are a loss coefficient (0 or more), not a share of the device
COEFFICIENT_KNOBS = ("entropy_coeff",)
# the engines with vLLM's memory: a KV pool reserved at start, sized by gpu_memory_utilization
# (or kv_cache_memory_bytes), that the rollout stays inside; vllm is the real one
VLLM_ENGINES = ("vllm", "vllm-like")
# where the engine runs: on every GPU beside the trainer, or on GPUs of its own
PLACEMENTS = ("colocated", "separate")
PLACEMENT_KNOBS = ("rollout_gpus", "staleness")  # read only with placement=separate


def trains_critic(algorithm: KnobValue) -> bool:
    """Whether `algorithm` trains a critic on the run's GPUs (PPO); ProbeConfig.has_critic."""
    return algorithm == ALGORITHM_WITH_CRITIC


def engine_reserves(engine: KnobValue) -> bool:
    """Whether `engine` has vLLM's memory (a KV pool reserved at start, sleep mode);
    ProbeConfig.engine_reserves."""
    return engine in VLLM_ENGINES


def describe_engine(engine: str | None, versions: dict[str, str] | None = None) -> str:
    """Which rollout engine a probe ran, in words (show, best.yaml's export, the report)."""
    if engine == "vllm":
        return f"vLLM {(versions or {}).get('vllm', '?')} (the real engine, in the probe)"
    if engine == "vllm-like":
        return "the probe's stand-in with vLLM's memory (vllm-like)"
    if engine == "policy":
        return "generation by the trained model itself, no engine copy (policy)"
    return "HF generation by an engine copy of the actor (hf)" if engine == "hf" \
        else str(engine)


DTYPE_BYTES = {"bf16": 2, "fp32": 4}  # the compute dtypes a probe runs in, and their width
DTYPE_CHOICES = ("auto", *DTYPE_BYTES)  # --dtype; auto: bf16 on a GPU, fp32 on a CPU


def compute_dtype(dtype: str, on_gpu: bool) -> str:
    """--dtype resolved: auto is bf16 on a GPU (as the trainers compute), fp32 on a CPU."""
    return dtype if dtype != "auto" else ("bf16" if on_gpu else "fp32")


def compute_bytes(dtype: str, on_gpu: bool) -> int:
    """Bytes per element of the compute dtype `dtype` resolves to on this device."""
    return DTYPE_BYTES[compute_dtype(dtype, on_gpu)]


def autocast_casts_weights(shards: int, compute_bytes: int) -> bool:
    """Whether a forward's weights stay fp32 and autocast casts them op by op to a compute
    dtype `compute_bytes` wide: on one GPU in a dtype narrower than fp32. Sharded over
    `shards` > 1 ranks, FSDP's mixed precision gathers them in the compute dtype; in fp32
    nothing is cast. The one place the memory model and its sketch read it from."""
    return shards == 1 and compute_bytes < DTYPE_BYTES["fp32"]



@dataclass(frozen=True)
class ProbeConfig:
    """One candidate configuration: the searched knobs and the fixed inputs of a GRPO step.

    One batch vocabulary, as EasyR1 and verl count (and users type): `rollout_batch_size`,
    `global_batch_size` and `val_batch_size` count prompts for the whole training run, over
    all its GPUs; micro-batch sizes count responses (prompt + response sequences) per GPU.
    What one GPU of a W-GPU run gets is `device_share(config, W)`, the one place that splits.
    """

    rollout_batch_size: int = field(
        default=8, metadata={"help": "prompts per training step, whole run"})
    rollout_n: int = field(default=4, metadata={"help": "responses per prompt"})
    global_batch_size: int = field(
        default=4, metadata={"help": "prompts per optimizer step, whole run"})
    micro_batch_size_update: int = field(
        default=4, metadata={"help": "responses per device per forward/backward"})
    micro_batch_size_experience: int = field(
        default=8, metadata={"help": "responses per device per log-prob forward"})
    dynamic_batching: bool = field(default=False, metadata={
        "help": "cut micro-batches by a token budget, padding removed (verl use_dynamic_bsz, "
                "EasyR1 dynamic_batching): batching.py"})
    max_token_len_update: int | None = field(default=None, metadata={
        "help": "dynamic batching: tokens per device per forward/backward (none: "
                "micro_batch_size_update x the sequence length, EasyR1's rule)"})
    max_token_len_experience: int | None = field(default=None, metadata={
        "help": "dynamic batching: tokens per device per log-prob forward (none: "
                "micro_batch_size_experience x the sequence length)"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute activations"})
    offload_params: bool = field(
        default=False, metadata={"help": "fp32 params to host between phases"})
    offload_optimizer: bool = field(
        default=False, metadata={"help": "optimizer state to host between phases"})
    val_batch_size: int | None = field(
        default=None, metadata={"help": "prompts per validation batch, whole run (none: no "
                                        "validation)"})
    max_prompt_length: int = field(default=256, metadata={"help": "prompt tokens (fixed input)"})
    max_response_length: int = field(
        default=256, metadata={"help": "response tokens, always generated in full"})
    max_num_seqs: int = field(
        default=256, metadata={"help": "sequences the rollout engine generates at once"})
    rollout_tensor_parallel: int = field(
        default=1, metadata={"help": "GPUs one rollout engine spans (tensor parallel); "
                                    "divides the run's GPUs"})
    rollout_engine: str = field(default="hf", metadata={
        "help": "vllm: the real vLLM, in the probe's process (where it is installed); "
                "vllm-like: the probe's stand-in with vLLM's memory (a reserved KV pool, "
                "EasyR1 and verl); hf: a compute-dtype engine copy of the weights with a KV "
                "cache that grows with the batch; policy: the trained model generates itself, "
                "no copy (TRL without vLLM)",
        "choices": ("hf", "vllm-like", "vllm", "policy")})
    gpu_memory_utilization: float = field(default=0.6, metadata={
        "help": "vllm-like: share of the device the engine reserves (weights, KV pool)"})
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "vllm, vllm-like: the KV pool's bytes, in place of what gpu_memory_utilization "
                "leaves (vLLM's kv_cache_memory_bytes; on a CPU the real engine's budget)"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "vllm-like: tokens per prefill forward, and the engine's profile run"})
    enable_sleep: bool = field(default=True, metadata={
        "help": "vllm-like: free the KV pool and weights after rollout (vLLM sleep mode)"})
    sleep_level: int = field(default=1, metadata={
        "help": "vllm-like: 1 keeps the weights in host memory asleep (EasyR1), 2 drops them"})
    fused_logprob: bool = field(default=False, metadata={
        "help": "log-probs from the hidden states and the LM head in chunks of 512 tokens, "
                "never the whole logits (verl's use_fused_kernels)"})
    fused_logprob_kernel: str = field(default="torch", metadata={
        "help": "fused_logprob's kernel: torch (512-token chunks, verl's default backend), or "
                "triton (verl's Triton linear cross-entropy: a CUDA device and verl installed; "
                "verl's fused_kernel_options.impl_backend), or trl (TRL's fused LM head: "
                "vocabulary chunks of 32,768, every position's entropy beside its log-prob)",
        "choices": ("torch", "triton", "trl")})
    entropy_metric: bool = field(default=False, metadata={
        "help": "the old-log-prob forward also takes every response position's entropy (verl's "
                "actor/entropy metric: a --trainer verl study has it on unless named)"})
    entropy_coeff: float = field(default=0.0, metadata={
        "help": "entropy bonus in the actor's loss (verl's actor.entropy_coeff): non-zero, the "
                "update takes every position's entropy with its gradient"})
    entropy_chunking: bool = field(default=False, metadata={
        "help": "the entropy 2048 positions at a time (verl's "
                "entropy_from_logits_with_chunking)"})
    entropy_checkpointing: bool = field(default=False, metadata={
        "help": "the update's entropy recomputed in the backward, not kept (verl's "
                "entropy_checkpointing)"})
    expandable_segments: bool = field(default=False, metadata={
        "help": "GPU: the CUDA caching allocator's expandable segments outside the rollout "
                "(verl turns them on for its training phases; EasyR1 and TRL run without)"})
    fsdp_strategy: str = field(default="fsdp2", metadata={
        "help": "how the actor, reference and critic are sharded over W > 1 ranks: fsdp "
                "(FSDP1's FullyShardedDataParallel with flat parameters, as EasyR1 and "
                "verl's default strategy wrap) or fsdp2 (fully_shard, per-parameter DTensor "
                "shards: verl's strategy=fsdp2)",
        "choices": ("fsdp", "fsdp2")})
    fused_optimizer: bool = field(default=False, metadata={
        "help": "AdamW's fused kernel, one pass with no temporaries (HF Trainer's "
                "adamw_torch_fused, TRL's default with torch >= 2.8); off: torch's default "
                "step, foreach on a GPU (an fp32 temporary the size of the params), a loop "
                "per tensor on a CPU (verl, EasyR1)"})
    use_kl: bool = field(
        default=True, metadata={"help": "KL to a reference model (adds ref log-prob forwards)"})
    old_logprob_pass: bool | None = field(default=True, metadata={
        "help": "the experience phase's old-log-prob forward (verl, EasyR1: always); off, the "
                "update takes its own log-probs, detached, as the old ones, which needs "
                "rollout_batch_size = global_batch_size; none: only where a generation feeds "
                "several optimizer steps (TRL at num_iterations 1)"})
    offload_ref_params: bool | None = field(default=None, metadata={
        "help": "the reference model's params to host between its forwards (none: as "
                "offload_params)"})
    algorithm: str = field(default="grpo", metadata={
        "help": "grpo: no critic; ppo: GAE with a critic of the actor's architecture (a value "
                "head), trained on the same GPUs", "choices": ALGORITHMS})
    critic_micro_batch_size_update: int = field(default=4, metadata={
        "help": "ppo: responses per device per critic forward/backward, and per value forward "
                "(verl's critic forward micro-batch follows it by default)"})
    critic_max_token_len_update: int | None = field(default=None, metadata={
        "help": "ppo, dynamic batching: tokens per device per critic micro-batch (none: "
                "critic_micro_batch_size_update x the sequence length)"})
    critic_gradient_checkpointing: bool = field(
        default=False, metadata={"help": "ppo: recompute the critic's activations"})
    critic_offload_params: bool = field(
        default=False, metadata={"help": "ppo: the critic's fp32 params to host between phases"})
    critic_offload_optimizer: bool = field(
        default=False, metadata={"help": "ppo: the critic's optimizer state to host between "
                                         "phases"})
    lora_rank: int = field(default=0, metadata={
        "help": "LoRA adapters' rank (0: full fine-tuning): the base weights frozen, gradients "
                "and AdamW state for the adapters only, the reference model the actor with its "
                "adapters off (verl's lora_rank, EasyR1's lora.rank, TRL's peft_config.r)",
        "minimum": 0})
    lora_alpha: int = field(default=16, metadata={
        "help": "LoRA's scaling numerator (verl's lora_alpha; no effect on memory)"})
    lora_target_modules: str = field(default=ALL_LINEAR, metadata={
        "help": "the linear layers that get adapters: all-linear (every linear layer but the "
                "LM head, as peft reads it) or their names, comma-separated "
                "(q_proj,v_proj)", "pattern": "modules"})
    ulysses_sequence_parallel_size: int = field(default=1, metadata={
        "help": "Ulysses sequence parallelism: each sequence's tokens split over this many "
                "ranks, all-to-all around attention; divides the run's GPUs and the attention "
                "heads; the data-parallel size is the GPUs over it (verl's "
                "ulysses_sequence_parallel_size, EasyR1's ulysses_size)"})
    placement: str = field(default="colocated", metadata={
        "help": "colocated: every GPU holds the trainer and the engine, the phases taking "
                "turns (verl's and EasyR1's hybrid engine, TRL's colocate mode); separate: "
                "the engine has rollout_gpus of the run's GPUs to itself and the rest train "
                "(verl's one-step-off and fully async recipes, TRL's server mode)",
        "choices": PLACEMENTS})
    rollout_gpus: int = field(default=0, metadata={
        "help": "separate: the run's GPUs the engine has to itself (0 with colocated)",
        "minimum": 0})
    staleness: int = field(default=0, metadata={
        "help": "separate: steps the rollout may run ahead of the trainer (0: the trainer "
                "waits for each rollout; 1: one step off policy; more: asynchronous with a "
                "bounded lag)", "minimum": 0})
    image_size_px: int = field(
        default=336, metadata={"help": "side of the square synthetic image (VL models): 144 "
                                        "tokens, room in the default 256-token prompt"})

    def as_dict(self) -> dict[str, Any]:
        """Every knob by name. Every field is a scalar, so a shallow dict (dataclasses.asdict
        deep-copies field by field: 80% of a space's rule checks went to it)."""
        return {name: getattr(self, name) for name in KNOB_NAMES}

    @property
    def ref_on_host(self) -> bool:
        """Whether the reference model's params wait in host memory between its forwards."""
        return self.offload_params if self.offload_ref_params is None \
            else self.offload_ref_params

    @property
    def runs_old_logprob_pass(self) -> bool:
        """Whether the experience phase runs the old-log-prob forward."""
        return old_pass_runs(self.old_logprob_pass, self.rollout_batch_size,
                             self.global_batch_size)

    @property
    def runs_experience_forward(self) -> bool:
        """Whether the experience phase runs any log-prob forward: the old-log-prob pass or
        the reference's (TRL at beta 0 and one optimizer step a generation runs neither)."""
        return self.runs_old_logprob_pass or self.use_kl

    @property
    def has_critic(self) -> bool:
        """PPO trains a critic (a value model of the actor's architecture) on the same GPUs."""
        return trains_critic(self.algorithm)

    @property
    def engine_reserves(self) -> bool:
        """The engine has vLLM's memory: a KV pool reserved at start (gpu_memory_utilization
        or kv_cache_memory_bytes) that the rollout stays inside, and sleep mode."""
        return engine_reserves(self.rollout_engine)

    @property
    def runs_real_vllm(self) -> bool:
        """The rollout is the real vLLM, in the probe's process (not the stand-in with its
        memory)."""
        return self.rollout_engine == "vllm"

    @property
    def actor_generates(self) -> bool:
        """The trained model generates itself: no engine copy of the weights (TRL without
        vLLM)."""
        return self.rollout_engine == "policy"

    @property
    def separate(self) -> bool:
        """The engine runs on rollout_gpus of the run's GPUs, the trainer on the rest."""
        return self.placement == "separate"

    def trainer_gpus(self, world_size: int) -> int:
        """The run's GPUs the trained phases shard over: every GPU colocated, the ones the
        engine does not have where it is separate."""
        return world_size - self.rollout_gpus if self.separate else world_size

    def flat_shards(self, world_size: int) -> bool:
        """FSDP1 over several ranks: each unit one flat parameter, sharded, gathered and
        freed as one (EasyR1's and verl's fsdp), where FSDP2 and one GPU hold a tensor per
        parameter."""
        return self.fsdp_strategy == "fsdp" and world_size > 1

    @property
    def uses_lora(self) -> bool:
        """LoRA: the base weights frozen, adapters trained, the reference the actor with its
        adapters off (no copy)."""
        return self.lora_rank > 0

    @property
    def holds_ref_copy(self) -> bool:
        """A reference model of its own: KL without LoRA (with LoRA the trainers take the
        reference log-probs from the actor with its adapters off)."""
        return self.use_kl and not self.uses_lora

    @property
    def batched_phases(self) -> tuple[str, ...]:
        """The phases cut into micro-batches: the critic's only where there is one."""
        return tuple(phase for phase in BATCHED_PHASES
                     if phase != "critic_update" or self.has_critic)

    def share(self, world_size: int = 1) -> DeviceShare:
        """What one of `world_size` GPUs runs of each batch (device_share)."""
        return device_share(self, world_size)

    def trained_share(self, world_size: int = 1) -> DeviceShare:
        """What one of `world_size` GPUs trains of each batch: a sequence-parallel group of
        sp GPUs trains the same sequences, so the data-parallel size is W / sp (the
        rollout's share stays `share`'s)."""
        return device_share(self, max(1, world_size // self.ulysses_sequence_parallel_size))

    def batching_knobs(self) -> dict[str, KnobValue]:
        """The knobs by name as batching.py cuts micro-batches by them: a token budget is per
        GPU, and a sequence-parallel group's is sp times it (verl's dp_actor: max_token_len
        x ulysses_sequence_parallel_size), cut over whole sequences."""
        knobs = self.as_dict()
        sp = self.ulysses_sequence_parallel_size
        for key in ("max_token_len_update", "max_token_len_experience",
                    "critic_max_token_len_update"):
            if sp > 1 and knobs[key] is not None:
                knobs[key] = int(knobs[key]) * sp
        return knobs

    @classmethod
    def from_knobs(cls, knobs: Mapping[str, KnobValue]) -> ProbeConfig:
        """A config from knobs by name, the defaults for the rest: the one place a map of knobs
        becomes a config (each value already of its knob's type: config.parse_knob_value)."""
        return cls(**knobs)  # type: ignore[arg-type]  # a union per name, typed when parsed

    def replace(self, **changes: Any) -> ProbeConfig:
        """This config with `changes` (knob names to values), unchecked."""
        return dataclasses.replace(self, **changes)

    @property
    def sequence_length(self) -> int:
        """Tokens of one text sequence (image tokens of VL models come on top)."""
        return self.max_prompt_length + self.max_response_length


def old_pass_runs(flag: bool | None, rollout_batch_size: int, global_batch_size: int) -> bool:
    """Whether a config's experience phase runs the old-log-prob forward: old_logprob_pass,
    or where that is none, whether a generation feeds several optimizer steps (TRL's rule)."""
    return flag if flag is not None else rollout_batch_size > global_batch_size



@dataclass(frozen=True)
class Topology:
    """The training run's GPUs: `nnodes` x `gpus_per_node` ranks share each batch."""

    nnodes: int = 1
    gpus_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    def without_engine(self, rollout_gpus: int) -> Topology | None:
        """The trainer's GPUs where the engine has `rollout_gpus` of these to itself
        (placement=separate): the rest of a single node, or on several nodes the nodes the
        engine leaves whole (verl's and TRL's pools are whole nodes of one size); None where it
        would take part of a node of a multi-node run, or none or all of the GPUs."""
        if not 0 < rollout_gpus < self.world_size:
            return None
        if self.nnodes == 1:
            return Topology(1, self.gpus_per_node - rollout_gpus)
        if rollout_gpus % self.gpus_per_node:
            return None
        return Topology(self.nnodes - rollout_gpus // self.gpus_per_node, self.gpus_per_node)

    def engine_of(self, rollout_gpus: int) -> Topology | None:
        """The engine's GPUs where it has `rollout_gpus` of these to itself: part of a single
        node, or whole nodes of a multi-node run; None where without_engine is None."""
        trainers = self.without_engine(rollout_gpus)
        if trainers is None:
            return None
        if self.nnodes == 1:
            return Topology(1, rollout_gpus)
        return Topology(rollout_gpus // self.gpus_per_node, self.gpus_per_node)


@dataclass(frozen=True)
class DeviceShare:
    """One GPU's share of a GRPO step when `world_size` GPUs split its batches evenly (as
    EasyR1 and verl chunk them). Uneven splits round up: the GPU that binds memory."""

    world_size: int
    prompts_per_step: int  # rollout_batch_size / W
    responses_per_step: int  # rollout_batch_size * rollout_n / W
    responses_per_minibatch: int  # global_batch_size * rollout_n / W: one optimizer step
    minibatches: int  # optimizer steps per training step: rollout / global batch
    val_prompts: int  # val_batch_size / W (0: no validation)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def device_share(config: ProbeConfig, world_size: int = 1) -> DeviceShare:
    """What one of `world_size` GPUs runs of each batch of `config`."""
    def per_gpu(count: int) -> int:
        return -(-count // world_size)

    n = config.rollout_n
    return DeviceShare(
        world_size=world_size, prompts_per_step=per_gpu(config.rollout_batch_size),
        responses_per_step=per_gpu(config.rollout_batch_size * n),
        responses_per_minibatch=per_gpu(config.global_batch_size * n),
        minibatches=max(1, config.rollout_batch_size // config.global_batch_size),
        val_prompts=per_gpu(config.val_batch_size) if config.val_batch_size else 0)


KNOB_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ProbeConfig))


def image_tokens(config: ProbeConfig) -> int:
    """LLM tokens of the square synthetic image a VL probe puts in each prompt."""
    return (config.image_size_px // IMAGE_TOKEN_PX) ** 2



# How each knob moves peak device memory when its value grows (True counts as 1): +1 needs
# more, -1 needs less, 0 no monotone effect. Feasibility reasoning and the safe first trial
# rest on this table (memory is monotone along these axes).
MEMORY_DIRECTION: dict[str, int] = {
    "rollout_batch_size": +1, "rollout_n": +1, "global_batch_size": 0,
    "micro_batch_size_update": +1, "micro_batch_size_experience": +1,
    "max_token_len_update": +1, "max_token_len_experience": +1, "dynamic_batching": 0,
    "gradient_checkpointing": -1, "offload_params": -1, "offload_optimizer": -1,
    "val_batch_size": +1, "max_prompt_length": +1, "max_response_length": +1,
    "max_num_seqs": +1, "use_kl": +1, "image_size_px": +1, "rollout_tensor_parallel": -1,
    # vllm-like engine: the reservation grows with the utilisation; sleeping frees it for
    # the other phases; the prefill budget and the sleep level move memory inside the
    # reservation or on the host only; the engine kind is not ordered
    "gpu_memory_utilization": +1, "enable_sleep": -1, "max_num_batched_tokens": 0,
    "sleep_level": 0, "rollout_engine": 0, "kv_cache_memory_bytes": +1,
    # the allocator's slack, not the tensors: less on every GPU measured so far (an H200,
    # benchmarks/results/gpu), but one card is no order
    "expandable_segments": 0,
    "fsdp_strategy": 0,  # the wrapper: which units are gathered when, on which streams
    "fused_logprob": -1,  # a chunk's logits at a time instead of the micro-batch's
    "fused_logprob_kernel": 0,  # the values name kernels
    "fused_optimizer": -1,  # no step temporaries
    # chunking saves in experience what it adds to an update with an entropy bonus (each
    # chunk's copies kept for the backward): no order across phases
    "entropy_metric": +1, "entropy_chunking": 0, "entropy_checkpointing": -1,
    "old_logprob_pass": 0,  # none follows the batches: its values are not ordered
    "entropy_coeff": 0,  # zero or not decides; the value does not order memory
    "offload_ref_params": 0,  # none follows offload_params: its values are not ordered
    # the critic (ppo): its micro-batch and budget, checkpointing and offload as the actor's
    "critic_micro_batch_size_update": +1, "critic_max_token_len_update": +1,
    "critic_gradient_checkpointing": -1, "critic_offload_params": -1,
    "critic_offload_optimizer": -1,
    "algorithm": 0,  # not ordered (a critic adds memory, but the values name algorithms)
    # LoRA: more rank, more adapters (with their gradients and AdamW state); on (any rank)
    # drops the base's gradients, AdamW state and the reference copy, but the order of the
    # values starts at 0: rank 0 needs the most, so no monotone direction across 0
    "lora_rank": 0, "lora_alpha": 0, "lora_target_modules": 0,
    # each rank holds 1/sp of each sequence's activations and logits, but sp x the
    # sequences of a W-rank share (its data-parallel group is W/sp): less per token budget
    "ulysses_sequence_parallel_size": -1,
    # separate placement moves the engine off the trainer's GPUs: not one order for both
    # roles (the engine's GPUs hold more of it, the trainer's none); more engine GPUs leave
    # fewer ranks to shard the trainer's states; staleness moves no device memory
    "placement": 0, "rollout_gpus": 0, "staleness": 0,
}
