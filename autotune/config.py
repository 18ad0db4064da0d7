"""The canonical knobs of a GRPO run: one spelling, one type and one rule set for each.

The names here are the ones used in search-space YAML, the Optuna param names, results tables,
`--set key=value` and the trainer adapters' mapping tables.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from autotune.batching import budget_problems
from autotune.errors import ConfigError

_BYTE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}


MAX_KNOB_VALUE = 2**24  # no batch, length or count in a real run comes near 16.7 million
MAX_BYTES = 2**60  # an exabyte: past it a size is a typo
# the phases of one step, in the trainers' order: PPO's critic is updated before the actor
# (verl's and EasyR1's RayPPOTrainer.fit: update_critic, then update_actor)
PHASES = ("rollout", "experience", "critic_update", "update", "validation")
# grpo: no critic, group-relative advantages; ppo: GAE with a critic (a value model of the
# actor's architecture, trained on the same GPUs)
ALGORITHMS = ("grpo", "ppo")
CRITIC_KNOBS = ("critic_micro_batch_size_update", "critic_max_token_len_update",
                "critic_gradient_checkpointing", "critic_offload_params",
                "critic_offload_optimizer")  # read only where the algorithm has a critic
# float knobs that are a loss coefficient (0 or more), not a share of the device
COEFFICIENT_KNOBS = ("entropy_coeff",)
# fused_logprob: tokens per chunk of the LM head's logits (verl's FusedLinearForPPO, torch
# backend: verl/utils/experimental/torch_functional.py chunk_size=512)
FUSED_CHUNK_TOKENS = 512
# entropy_chunking: positions per chunk of the entropy (verl's entropy_from_logits_with_chunking,
# verl/utils/torch_functional.py chunk_size=2048)
ENTROPY_CHUNK_ROWS = 2048
# fused_logprob_kernel=triton: verl's Triton linear cross-entropy
# (verl/utils/kernel/kernels.py): the forward reduces the vocabulary in splits of 1,024
# ([tokens, splits] fp32 partials of the max, the sum and the entropy's b), the backward
# (its default _Split_Dlogits_N) writes the logits' gradient 9,504 vocabulary columns at a time
TRITON_VOCAB_SPLIT = 1024
TRITON_DLOGITS_COLUMNS = 9504
# fused_logprob_kernel=trl: TRL's fused LM head (trl/trainer/utils.py add_fused_lm_head,
# trl/kernels/chunked_logprob.py ChunkedLogProbFunction): the logits of 4,096 tokens x 32,768
# vocabulary columns at a time, every position on a device without Triton (a CPU), the
# completion tokens only on one with it
TRL_VOCAB_CHUNK = 32768
TRL_TOKEN_TILE = 4096
# the engines with vLLM's memory: a KV pool reserved at start, sized by gpu_memory_utilization
# (or kv_cache_memory_bytes), that the rollout stays inside; vllm is the real one
VLLM_ENGINES = ("vllm", "vllm-like")


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
    image_size_px: int = field(
        default=336, metadata={"help": "side of the square synthetic image (VL models): 144 "
                                        "tokens, room in the default 256-token prompt"})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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
    def has_critic(self) -> bool:
        return self.algorithm == "ppo"

    @property
    def sequence_length(self) -> int:
        """Tokens of one text sequence (image tokens of VL models come on top)."""
        return self.max_prompt_length + self.max_response_length


def old_pass_runs(flag: bool | None, rollout_batch_size: int, global_batch_size: int) -> bool:
    """Whether a config's experience phase runs the old-log-prob forward: old_logprob_pass,
    or where that is none, whether a generation feeds several optimizer steps (TRL's rule)."""
    return flag if flag is not None else rollout_batch_size > global_batch_size


def torch_adamw_problem(knobs: dict[str, Any], trainer: str) -> list[str]:
    """verl and EasyR1 build torch.optim.AdamW with its default step (foreach on a GPU)."""
    return [f"fused_optimizer=true: {trainer} builds torch.optim.AdamW with torch's default "
            "step, not the fused kernel the probe ran; probe with fused_optimizer=false"] \
        if knobs.get("fused_optimizer") else []


def old_pass_problem(knobs: dict[str, Any], trainer: str) -> list[str]:
    """verl and EasyR1 always take the old log-probs in a forward of their own."""
    runs = old_pass_runs(knobs.get("old_logprob_pass", True), knobs["rollout_batch_size"],
                         knobs["global_batch_size"])
    return [] if runs else [
        f"old_logprob_pass: {trainer} takes the old log-probs in a forward of their own "
        "(compute_log_prob); set old_logprob_pass=true"]


@dataclass(frozen=True)
class Topology:
    """The training run's GPUs: `nnodes` x `gpus_per_node` ranks share each batch."""

    nnodes: int = 1
    gpus_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node


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
_KNOB_TYPES: dict[str, str] = {f.name: str(f.type) for f in dataclasses.fields(ProbeConfig)}
_KNOB_CHOICES: dict[str, tuple[str, ...]] = {
    f.name: f.metadata["choices"] for f in dataclasses.fields(ProbeConfig)
    if "choices" in f.metadata}


def engine_choices() -> tuple[str, ...]:
    """The rollout engines a probe has (the `rollout_engine` knob's choices)."""
    return _KNOB_CHOICES["rollout_engine"]


def parse_knob_value(key: str, raw: Any) -> Any:
    """Turn a YAML or command-line value into the knob's type, or raise ConfigError."""
    if key not in _KNOB_TYPES:
        raise ConfigError(unknown_key_message(key, KNOB_NAMES, "knob"))
    kind = _KNOB_TYPES[key]
    text = str(raw).strip().lower()
    if kind.endswith(" | None") and (raw is None or text in ("none", "null", "")):
        return None
    kind = kind.removesuffix(" | None")
    if kind == "bool":
        if isinstance(raw, bool):
            return raw
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}={raw!r}: expected true or false")
    if kind == "str":
        choices = _KNOB_CHOICES[key]
        if isinstance(raw, str) and text in choices:
            return text
        raise ConfigError(f"{key}={raw!r}: expected one of {', '.join(choices)}")
    if kind == "float" and key in COEFFICIENT_KNOBS:
        try:
            coefficient = float(str(raw).strip())
        except ValueError:
            coefficient = -1.0
        if isinstance(raw, bool) or not 0 <= coefficient < float("inf"):
            raise ConfigError(f"{key}={raw!r}: expected a coefficient of 0 or more, e.g. 0.001")
        return coefficient
    if kind == "float":
        return parse_share(raw, f"{key}={raw!r}: expected a share of the device, more than 0 "
                                "and at most 1, e.g. 0.6")
    if key.endswith("_bytes"):
        return parse_bytes(str(raw), key)
    if isinstance(raw, bool):
        raise ConfigError(f"{key}={raw!r}: expected a positive integer")
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{key}={raw!r}: expected a positive integer") from None
    if value < 1:
        raise ConfigError(f"{key}={value}: must be at least 1")
    if value > MAX_KNOB_VALUE:
        raise ConfigError(f"{key}={value}: must be at most {MAX_KNOB_VALUE}")
    return value


def parse_share(raw: Any, problem: str) -> float:
    """A share in (0, 1] (of a device, of a node's memory); ConfigError(`problem`) else."""
    try:
        value = float(str(raw).strip()) if not isinstance(raw, bool) else -1.0
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise ConfigError(problem)
    return value


def parse_assignments(assignments: list[str] | tuple[str, ...],
                      translate: Callable[[dict[str, Any]], dict[str, Any]] | None = None
                      ) -> dict[str, Any]:
    """Parse `key=value` strings from `--set` into typed knob values; report every problem.
    `translate` turns the keys that are not knobs (a trainer's own keys, their values read as
    YAML) into the knobs they set, all at once, or raises ConfigError naming what it cannot."""
    import yaml

    values: dict[str, Any] = {}
    foreign: dict[str, Any] = {}  # keys that are not knobs, for `translate`
    problems: list[str] = []

    def add(knob: str, value: Any) -> None:
        if knob in values and values[knob] != value:
            problems.append(f"--set {knob} given twice ({values[knob]}, then {value}); give "
                            "it once")
        values[knob] = value

    for item in assignments:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if key.replace("-", "_") in _KNOB_TYPES or translate is None:
            key = key.replace("-", "_")
        if not sep or not key:
            problems.append(f"--set {item!r}: expected key=value, e.g. micro_batch_size_update=4")
            continue
        try:
            if translate is not None and key not in _KNOB_TYPES:
                foreign[key] = yaml.safe_load(raw)
            else:
                add(key, parse_knob_value(key, raw))
        except (ConfigError, yaml.YAMLError) as err:
            lines = err.problems if isinstance(err, ConfigError) else [f"{key}: {raw!r} is "
                                                                      "not a YAML value"]
            problems.extend(f"--set {p}" for p in lines)
    if foreign and translate is not None:
        try:
            for knob, value in translate(foreign).items():
                add(knob, parse_knob_value(knob, value))
        except ConfigError as err:
            problems.extend(f"--set {p}" for p in err.problems)
    if problems:
        raise ConfigError(problems)
    return values


def make_probe_config(values: dict[str, Any], world_size: int = 1) -> ProbeConfig:
    """Build a ProbeConfig from typed values and check the rules every trainer shares."""
    config = ProbeConfig(**values)
    problems = validate_probe_config(config, world_size)
    if problems:
        raise ConfigError(problems)
    return config


def validate_probe_config(config: ProbeConfig, world_size: int = 1) -> list[str]:
    """The trainer-independent rules of a GRPO step on `world_size` GPUs; returns every broken
    rule as one line. Each GPU takes an equal share of the prompts, and its share of each
    optimizer step (and of each step) must split into whole micro-batches."""
    problems = []
    w, n = world_size, config.rollout_n
    rbs, gbs = config.rollout_batch_size, config.global_batch_size
    mbu, mbe = config.micro_batch_size_update, config.micro_batch_size_experience
    on = "" if w == 1 else f"/{w} GPUs"
    dynamic = config.dynamic_batching  # micro-batches cut by tokens: no whole-count rule
    if gbs > rbs:
        problems.append(
            f"global_batch_size={gbs} exceeds rollout_batch_size={rbs}: an optimizer step "
            "cannot take more prompts than a training step has")
    elif rbs % gbs:
        problems.append(f"rollout_batch_size={rbs} is not divisible by global_batch_size={gbs}")
    if rbs % w:
        problems.append(f"rollout_batch_size={rbs} prompts are not divisible by the {w} GPUs "
                        "of the run (each takes an equal share)")
    if (gbs * n) % w:
        problems.append(f"global_batch_size*rollout_n={gbs * n} responses per optimizer step "
                        f"are not divisible by the {w} GPUs of the run")
    elif not dynamic and (gbs * n // w) % mbu:
        problems.append(f"global_batch_size*rollout_n{on}={gbs * n // w} is not divisible by "
                        f"micro_batch_size_update={mbu}")
    if not dynamic and (rbs * n) % w == 0 and (rbs * n // w) % mbe:
        problems.append(f"rollout_batch_size*rollout_n{on}={rbs * n // w} is not divisible by "
                        f"micro_batch_size_experience={mbe}")
    problems += budget_problems(config.as_dict())
    problems += critic_problems(config, w)
    tp = config.rollout_tensor_parallel
    if w % tp:
        problems.append(f"rollout_tensor_parallel={tp} does not divide the {w} GPU"
                        f"{'s' if w > 1 else ''} of the run (each engine spans {tp})")
    if config.rollout_engine in VLLM_ENGINES:
        problems += engine_problems(config)
    if config.rollout_engine == "policy" and tp > 1:
        problems.append(f"rollout_engine=policy with rollout_tensor_parallel={tp}: the trained "
                        "model generates itself, with nothing to split; set it to 1")
    if config.rollout_engine == "policy" and config.fsdp_strategy == "fsdp" and w > 1:
        problems.append("rollout_engine=policy with fsdp_strategy=fsdp: FSDP1 gathers its flat "
                        "parameters only in the wrapped forward, which generation does not "
                        "call; use fsdp_strategy=fsdp2 (TRL's generation under FSDP gathers "
                        "the whole model, which the probe does not run)")
    if config.image_size_px % 28:
        problems.append(
            f"image_size_px={config.image_size_px} is not a multiple of 28 "
            "(14-pixel patches merged 2x2 in Qwen2.5-VL)")
    if config.old_logprob_pass is False and rbs != gbs:
        problems.append(f"old_logprob_pass=false with rollout_batch_size={rbs} and "
                        f"global_batch_size={gbs}: the optimizer steps after the first need "
                        "the old log-probs (TRL computes them then); set them equal or the "
                        "pass on")
    if not config.runs_old_logprob_pass and config.entropy_metric:
        problems.append("entropy_metric with old_logprob_pass=false: verl's entropy metric "
                        "comes from the old-log-prob pass; set one of them off")
    if config.entropy_coeff < 0:
        problems.append(f"entropy_coeff={config.entropy_coeff}: a bonus is 0 or more")
    if config.entropy_coeff and config.fused_logprob and config.fused_logprob_kernel != "trl":
        problems.append("entropy_coeff with fused_logprob: the probe's fused head gives no "
                        "entropy gradient with this kernel (TRL's does: "
                        "fused_logprob_kernel=trl); set one of them off")
    return problems


def critic_problems(config: ProbeConfig, world_size: int = 1) -> list[str]:
    """The critic's rules: its mini-batch is the actor's (verl's critic.ppo_mini_batch_size
    follows the actor's), split into whole critic micro-batches on each GPU; a GRPO config
    sets no critic knob (nothing would read it)."""
    defaults = ProbeConfig()
    if not config.has_critic:
        set_knobs = [k for k in CRITIC_KNOBS if getattr(config, k) != getattr(defaults, k)]
        return [f"{', '.join(set_knobs)}: critic knobs, but algorithm={config.algorithm} "
                "trains no critic; set algorithm=ppo (--algorithm ppo) or remove them"] \
            if set_knobs else []
    w, n, gbs = world_size, config.rollout_n, config.global_batch_size
    mbc = config.critic_micro_batch_size_update
    if config.dynamic_batching or (gbs * n) % w:
        return []
    on = "" if w == 1 else f"/{w} GPUs"
    problems = []
    if (gbs * n // w) % mbc:
        problems.append(f"global_batch_size*rollout_n{on}={gbs * n // w} is not divisible by "
                        f"critic_micro_batch_size_update={mbc} (the critic's mini-batch is "
                        "the actor's)")
    rbs = config.rollout_batch_size
    if (rbs * n) % w == 0 and (rbs * n // w) % mbc:
        problems.append(f"rollout_batch_size*rollout_n{on}={rbs * n // w} is not divisible "
                        f"by critic_micro_batch_size_update={mbc} (the critic's value "
                        "forward micro-batch)")
    return problems


def algorithm_defaults(named: dict[str, Any]) -> dict[str, Any]:
    """The knobs an algorithm sets when nothing else names them: PPO's rollout.n is 1 (one
    response per prompt, the value model is the baseline; verl's ppo_trainer.yaml)."""
    if named.get("algorithm") == "ppo" and "rollout_n" not in named:
        return {"rollout_n": 1}
    return {}


def engine_problems(config: ProbeConfig) -> list[str]:
    """vLLM's own start-up rules for the vllm and vllm-like engines (EasyR1 checks the first
    too)."""
    problems = []
    if config.max_num_batched_tokens < config.sequence_length:
        problems.append(f"max_num_batched_tokens={config.max_num_batched_tokens} is less "
                        f"than max_prompt_length+max_response_length={config.sequence_length}"
                        " (vLLM's max_model_len); raise it or shorten the lengths")
    if config.sleep_level not in (1, 2):
        problems.append(f"sleep_level={config.sleep_level}: vLLM sleeps at level 1 or 2")
    return problems


def device_problems(config: ProbeConfig, on_gpu: bool, is_vl: bool, capped: bool) -> list[str]:
    """What the engine and kernel knobs cannot run on this device (`capped`: under a
    --gpu-memory-limit), each a line that says what to do instead; the sweep refuses these
    before its first probe, the probe again before it builds anything."""
    problems = []
    if config.fused_logprob and config.fused_logprob_kernel == "triton" and not on_gpu:
        problems.append("fused_logprob_kernel=triton runs on a CUDA device only; probe on a "
                        "GPU, or with fused_logprob_kernel=torch")
    engine = config.rollout_engine
    if engine in VLLM_ENGINES and not on_gpu and not capped \
            and config.kv_cache_memory_bytes is None:
        problems.append(f"rollout_engine={engine} on the CPU reserves a share of the device "
                        "cap: add --gpu-memory-limit (e.g. 1GiB), set kv_cache_memory_bytes "
                        "(e.g. 64MiB), or use --engine hf")
    if engine == "vllm" and config.rollout_tensor_parallel > 1:
        problems.append(f"rollout_engine=vllm with rollout_tensor_parallel="
                        f"{config.rollout_tensor_parallel}: the probe runs one vLLM in its "
                        "process, on one GPU; use rollout_engine=vllm-like for tensor-parallel "
                        "rollouts")
    if engine == "vllm" and is_vl:
        problems.append("rollout_engine=vllm runs text models only for now (a VL prompt's "
                        "image would go through vLLM's processor); use rollout_engine=vllm-like")
    return problems


IMAGE_TOKEN_PX = 28  # Qwen2.5-VL: 14-pixel patches merged 2x2 make one LLM token
IMAGE_FRAME_TOKENS = 3  # vision start, vision end, and at least one text token


def image_tokens(config: ProbeConfig) -> int:
    """LLM tokens of the square synthetic image a VL probe puts in each prompt."""
    return (config.image_size_px // IMAGE_TOKEN_PX) ** 2


def model_problems(config: ProbeConfig, is_vl: bool) -> list[str]:
    """The rules a config must pass for this kind of model (a VL prompt holds its image)."""
    if is_vl and image_tokens(config) + IMAGE_FRAME_TOKENS > config.max_prompt_length:
        fits = IMAGE_TOKEN_PX * int((config.max_prompt_length - IMAGE_FRAME_TOKENS) ** 0.5)
        return [f"image_size_px={config.image_size_px} makes {image_tokens(config)} image "
                f"tokens, more than max_prompt_length={config.max_prompt_length} holds; "
                f"--set max_prompt_length={image_tokens(config) + 64} or "
                f"image_size_px={max(IMAGE_TOKEN_PX, fits)}"]
    return []


def parse_bytes(text: str, what: str = "memory size", allow_zero: bool = False) -> int:
    """Parse '40GiB', '512MiB', '80GB' or a plain byte count into bytes (more than zero unless
    `allow_zero`: a zero-byte device or host limit would only waste a probe)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _BYTE_UNITS:
        raise ConfigError(f"{what} {text!r}: expected a size such as 40GiB, 512MiB or 80GB")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value > MAX_BYTES:
        raise ConfigError(f"{what} {text!r}: more than {MAX_BYTES // 2**50} PiB; check the unit")
    if value <= 0 and not allow_zero:
        raise ConfigError(f"{what} {text!r}: must be more than zero, e.g. 40GiB")
    return value


def parse_duration_s(text: str, what: str = "duration") -> float:
    """Parse '90', '90s', '15m', '8h' or '1d' into seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhd]?)\s*", str(text).lower())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{what} {text!r}: expected a positive duration such as 90s, 15m or 8h")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def parse_headroom(text: str) -> float:
    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"--headroom {text!r}: expected a share of memory kept free, "
                          "e.g. 10% or 0.1")
    return value


def format_bytes(num_bytes: float | None) -> str:
    """Bytes as GiB or MiB for people; the only place units are converted for display."""
    if num_bytes is None:
        return "-"
    if abs(num_bytes) >= 2**30:
        return f"{num_bytes / 2**30:.2f} GiB"
    return f"{num_bytes / 2**20:.0f} MiB"


def unknown_key_message(key: str, valid: tuple[str, ...] | list[str], what: str) -> str:
    """One line naming the unknown key, the closest valid ones, and where the full list is."""
    holding = [name for name in valid if key and key in name]  # a prefix or a part first
    close = (holding + [name for name in difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
                        if name not in holding])[:3]
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return f"unknown {what} {key!r}: {hint}valid: {', '.join(valid)}"


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
}


def load_knob_file(path: str) -> dict[str, Any]:
    """Canonical knobs from a flat YAML mapping (`--base-config`); every problem in one go."""
    import yaml

    from autotune.files import read_text_file

    text = read_text_file(path, "--base-config")
    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError) as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: not valid YAML ({getattr(err, 'problem', err)})") \
            from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of knob names to values, "
                          "e.g. micro_batch_size_update: 4")
    values: dict[str, Any] = {}
    problems: list[str] = []
    for key, raw in data.items():
        try:
            values[str(key)] = parse_knob_value(str(key), raw)
        except ConfigError as err:
            problems.extend(f"{path}: {key}: {p}" for p in err.problems)
    if problems:
        raise ConfigError(problems)
    return values


def describe_params(params: dict[str, Any]) -> str:
    """Params in a short readable form: mbu=4 mbe=8 gc offload_params."""
    short = {"micro_batch_size_update": "mbu", "micro_batch_size_experience": "mbe",
             "gradient_checkpointing": "gc", "rollout_batch_size": "rbs", "rollout_n": "n",
             "global_batch_size": "gbs", "offload_params": "off_p",
             "offload_optimizer": "off_o", "val_batch_size": "vbs",
             "rollout_tensor_parallel": "tp", "gpu_memory_utilization": "util",
             "max_num_batched_tokens": "mnbt", "enable_sleep": "sleep",
             "dynamic_batching": "dyn", "max_token_len_update": "tok_u",
             "max_token_len_experience": "tok_e", "offload_ref_params": "off_ref",
             "critic_micro_batch_size_update": "c_mbu", "critic_max_token_len_update": "c_tok",
             "critic_gradient_checkpointing": "c_gc", "critic_offload_params": "c_off_p",
             "critic_offload_optimizer": "c_off_o"}
    parts = []
    for name, value in params.items():
        label = short.get(name, name)
        if isinstance(value, bool):
            parts.append(label if value else f"no-{label}")
        else:
            parts.append(f"{label}={value}")
    return " ".join(parts)
