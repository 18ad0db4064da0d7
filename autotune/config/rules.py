"""The rules every config must pass, whatever the trainer: how its batches split over the
run's GPUs, the critic's, vLLM's start-up rules, what a device or a model kind cannot run.
Each returns every broken rule as one line that says what to do."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from autotune.batching import KnobMapping, budget_problems
from autotune.config.kernels import IMAGE_FRAME_TOKENS, IMAGE_TOKEN_PX
from autotune.config.schema import (
    ALL_LINEAR,
    CRITIC_KNOBS,
    DECODER_LINEARS,
    LORA_KNOBS,
    PLACEMENT_KNOBS,
    Knobs,
    ProbeConfig,
    image_tokens,
    trains_critic,
)
from autotune.errors import ConfigError


def torch_adamw_problem(config: ProbeConfig, trainer: str) -> list[str]:
    """verl and EasyR1 build torch.optim.AdamW with its default step (foreach on a GPU)."""
    return [f"fused_optimizer=true: {trainer} builds torch.optim.AdamW with torch's default "
            "step, not the fused kernel the probe ran; probe with fused_optimizer=false"] \
        if config.fused_optimizer else []


def old_pass_problem(config: ProbeConfig, trainer: str) -> list[str]:
    """verl and EasyR1 always take the old log-probs in a forward of their own."""
    return [] if config.runs_old_logprob_pass else [
        f"old_logprob_pass: {trainer} takes the old log-probs in a forward of their own "
        "(compute_log_prob); set old_logprob_pass=true"]


def make_probe_config(values: Mapping[str, Any], world_size: int = 1) -> ProbeConfig:
    """Build a ProbeConfig from typed values and check the rules every trainer shares."""
    config = ProbeConfig.from_knobs(values)
    problems = validate_probe_config(config, world_size)
    if problems:
        raise ConfigError(problems)
    return config


def validate_probe_config(config: ProbeConfig, world_size: int = 1) -> list[str]:
    """The trainer-independent rules of a GRPO step on `world_size` GPUs; returns every broken
    rule as one line. Each GPU takes an equal share of the prompts, and its share of each
    optimizer step (and of each step) must split into whole micro-batches."""
    problems = placement_problems(config, world_size)
    if problems:  # the split itself is wrong: the rules below read it
        return problems
    trainers, sp = config.trainer_gpus(world_size), config.ulysses_sequence_parallel_size
    problems = parallel_problems(config, trainers)
    problems += batch_problems(config, trainers // sp if not trainers % sp else trainers)
    problems += budget_problems(config.as_dict())
    problems += critic_problems(config, trainers)
    problems += rollout_problems(config, config.rollout_gpus if config.separate
                                 else world_size)
    if config.image_size_px % 28:
        problems.append(
            f"image_size_px={config.image_size_px} is not a multiple of 28 "
            "(14-pixel patches merged 2x2 in Qwen2.5-VL)")
    return problems + logprob_problems(config)


def placement_problems(config: ProbeConfig, world_size: int) -> list[str]:
    """Separate placement: the engine takes 1 to W - 1 of the run's GPUs and is a served one
    (vLLM's memory); its knobs are read only there. The trainers check their batches on the
    trainer's GPUs alone (verl's validate_config counts trainer.n_gpus_per_node x nnodes:
    docs/research/placement.md, section 1), which the rules after this one do."""
    if not config.separate:
        named = [f"{k}={getattr(config, k)}" for k in PLACEMENT_KNOBS if getattr(config, k)]
        return [f"{', '.join(named)}: read only with placement=separate (the engine on GPUs "
                "of its own); set placement=separate or remove them"] if named else []
    problems, w, gpus = [], world_size, config.rollout_gpus
    if gpus == 0 and w > 1:
        problems.append(f"placement=separate needs rollout_gpus, the GPUs the engine has to "
                        f"itself (1 to {w - 1} of the run's {w}): add --set rollout_gpus=N")
    elif not 0 < gpus < w:
        problems.append(f"placement=separate with rollout_gpus={gpus}: the engine takes 1 to "
                        f"{w - 1} of the run's {w} GPU{'s' if w > 1 else ''} and the rest "
                        "train" + (" (one GPU cannot be split: use placement=colocated)"
                                   if w == 1 else ""))
    if not config.engine_reserves:
        problems.append(f"placement=separate with rollout_engine={config.rollout_engine}: an "
                        "engine on GPUs of its own is a served one; use vllm or vllm-like")
    return problems


def parallel_problems(config: ProbeConfig, world_size: int) -> list[str]:
    """Ulysses sequence parallelism divides the run's GPUs (its data-parallel size is the
    GPUs over it); LoRA's knobs are read only with a rank."""
    problems = []
    sp = config.ulysses_sequence_parallel_size
    if world_size % sp:
        problems.append(f"ulysses_sequence_parallel_size={sp} does not divide the {world_size} "
                        f"GPU{'s' if world_size > 1 else ''} of the run (each sequence is "
                        f"split over {sp} ranks); use a divisor of {world_size}")
    if sp > 1 and config.has_critic:
        problems.append(f"ulysses_sequence_parallel_size={sp} with algorithm=ppo: the probe "
                        "splits the actor's and the reference's sequences, not the critic's "
                        "(its own ulysses size); probe PPO with 1")
    if sp > 1 and config.fused_logprob:
        problems.append(f"ulysses_sequence_parallel_size={sp} with fused_logprob: the probe "
                        "takes a slice's log-probs from its whole logits; set fused_logprob="
                        "false")
    defaults = ProbeConfig()
    lora_knobs = [k for k in LORA_KNOBS if getattr(config, k) != getattr(defaults, k)]
    if not config.uses_lora and lora_knobs:
        problems.append(f"{', '.join(lora_knobs)}: LoRA knobs, but lora_rank=0 (full "
                        "fine-tuning); set lora_rank (e.g. 64) or remove them")
    targets = config.lora_target_modules
    unknown = [] if targets == ALL_LINEAR else \
        [name for name in targets.split(",") if name not in DECODER_LINEARS]
    if config.uses_lora and unknown:
        problems.append(f"lora_target_modules={targets}: {', '.join(unknown)} is no linear "
                        f"layer of the model's decoder layers; use {ALL_LINEAR} or names among "
                        f"{', '.join(DECODER_LINEARS)}")
    return problems


def batch_problems(config: ProbeConfig, world_size: int) -> list[str]:
    """How the batches split over `world_size` data-parallel ranks (the GPUs over the
    sequence-parallel size): an optimizer step within a step, equal shares per rank, whole
    micro-batches (dynamic batching cuts by tokens: no whole-count rule)."""
    problems = []
    w, n = world_size, config.rollout_n
    rbs, gbs = config.rollout_batch_size, config.global_batch_size
    mbu, mbe = config.micro_batch_size_update, config.micro_batch_size_experience
    on = "" if w == 1 else f"/{w} GPUs"
    whose = "that train (the run's less rollout_gpus)" if config.separate else "of the run"
    dynamic = config.dynamic_batching
    if gbs > rbs:
        problems.append(
            f"global_batch_size={gbs} exceeds rollout_batch_size={rbs}: an optimizer step "
            "cannot take more prompts than a training step has")
    elif rbs % gbs:
        problems.append(f"rollout_batch_size={rbs} is not divisible by global_batch_size={gbs}")
    if rbs % w:
        problems.append(f"rollout_batch_size={rbs} prompts are not divisible by the {w} GPUs "
                        f"{whose} (each takes an equal share)")
    if (gbs * n) % w:
        problems.append(f"global_batch_size*rollout_n={gbs * n} responses per optimizer step "
                        f"are not divisible by the {w} GPUs {whose}")
    elif not dynamic and (gbs * n // w) % mbu:
        problems.append(f"global_batch_size*rollout_n{on}={gbs * n // w} is not divisible by "
                        f"micro_batch_size_update={mbu}")
    if not dynamic and (rbs * n) % w == 0 and (rbs * n // w) % mbe:
        problems.append(f"rollout_batch_size*rollout_n{on}={rbs * n // w} is not divisible by "
                        f"micro_batch_size_experience={mbe}")
    return problems


def rollout_problems(config: ProbeConfig, world_size: int) -> list[str]:
    """The rollout engine's: tensor parallelism divides its GPUs (`world_size`: the run's, or
    the engine's own where it is separate), vLLM's start-up rules, and
    what generation by the trained model itself cannot do."""
    problems = []
    w, tp = world_size, config.rollout_tensor_parallel
    whose = "the engine has to itself (rollout_gpus)" if config.separate else "of the run"
    if w % tp:
        problems.append(f"rollout_tensor_parallel={tp} does not divide the {w} GPU"
                        f"{'s' if w > 1 else ''} {whose} (each engine spans {tp})")
    if config.engine_reserves:
        problems += engine_problems(config)
    elif config.kv_cache_memory_bytes is not None:
        problems.append(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} sizes a vLLM "
                        f"engine's KV pool; rollout_engine={config.rollout_engine} ignores it "
                        "(its cache grows with the batch); remove it, or use --engine vllm-like")
    if config.actor_generates and tp > 1:
        problems.append(f"rollout_engine=policy with rollout_tensor_parallel={tp}: the trained "
                        "model generates itself, with nothing to split; set it to 1")
    if config.actor_generates and config.flat_shards(w):
        problems.append("rollout_engine=policy with fsdp_strategy=fsdp: FSDP1 gathers its flat "
                        "parameters only in the wrapped forward, which generation does not "
                        "call; use fsdp_strategy=fsdp2 (TRL's generation under FSDP gathers "
                        "the whole model, which the probe does not run)")
    return problems


def logprob_problems(config: ProbeConfig) -> list[str]:
    """The old-log-prob pass and the entropy's: what each needs of the other."""
    problems = []
    rbs, gbs = config.rollout_batch_size, config.global_batch_size
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


def algorithm_defaults(named: KnobMapping) -> Knobs:
    """The knobs other knobs set when nothing else names them: PPO's rollout.n is 1 (one
    response per prompt, the value model is the baseline; verl's ppo_trainer.yaml); the
    engine's prefill budget (max_num_batched_tokens) at least one whole sequence, vLLM's
    max_model_len (what users set beside long responses, and EasyR1 requires)."""
    defaults: Knobs = {}
    if trains_critic(named.get("algorithm")) and "rollout_n" not in named:
        defaults["rollout_n"] = 1
    if "max_num_batched_tokens" not in named:
        base = ProbeConfig()
        lengths = [named.get(k, getattr(base, k))
                   for k in ("max_prompt_length", "max_response_length")]
        sequence = sum(n for n in lengths if isinstance(n, int))
        if sequence > base.max_num_batched_tokens:
            defaults["max_num_batched_tokens"] = sequence
    return defaults


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
    if config.separate and on_gpu:
        problems.append("placement=separate: the split probe runs on a CPU only so far (its "
                        "sides' GPUs are not assigned yet); `autotune estimate --set "
                        "placement=separate --set rollout_gpus=N` sizes each role's GPUs")
    if config.separate and (config.runs_real_vllm or config.uses_lora):
        problems.append(f"placement=separate with "
                        f"{'rollout_engine=vllm' if config.runs_real_vllm else 'lora_rank'}: "
                        "the split probe runs the vllm-like engine and syncs whole weights; "
                        "probe the split with rollout_engine=vllm-like and no LoRA")
    if config.fused_logprob and config.fused_logprob_kernel == "triton" and not on_gpu:
        problems.append("fused_logprob_kernel=triton runs on a CUDA device only; probe on a "
                        "GPU, or with fused_logprob_kernel=torch")
    engine = config.rollout_engine
    if config.engine_reserves and not on_gpu and not capped \
            and config.kv_cache_memory_bytes is None:
        problems.append(f"rollout_engine={engine} on the CPU reserves a share of the device "
                        "cap: add --gpu-memory-limit (e.g. 1GiB), set kv_cache_memory_bytes "
                        "(e.g. 64MiB), or use --engine hf")
    if config.runs_real_vllm and config.rollout_tensor_parallel > 1:
        problems.append(f"rollout_engine=vllm with rollout_tensor_parallel="
                        f"{config.rollout_tensor_parallel}: the probe runs one vLLM in its "
                        "process, on one GPU; use rollout_engine=vllm-like for tensor-parallel "
                        "rollouts")
    if config.runs_real_vllm and is_vl:
        problems.append("rollout_engine=vllm runs text models only for now (a VL prompt's "
                        "image would go through vLLM's processor); use rollout_engine=vllm-like")
    return problems




def model_problems(config: ProbeConfig, is_vl: bool,
                   heads: tuple[int, int] | None = None) -> list[str]:
    """The rules a config must pass for this kind of model (a VL prompt holds its image) and,
    given its attention and KV `heads`, how its heads split (the engine's tensor parallelism,
    Ulysses')."""
    problems = head_problems(config, *heads) if heads else []
    return problems + kind_problems(config, is_vl)


def head_problems(config: ProbeConfig, heads: int, kv_heads: int) -> list[str]:
    """The rollout engine's tensor parallelism divides the attention and KV heads; Ulysses'
    rule (sequence_parallel_problems)."""
    tp = config.rollout_tensor_parallel
    problems = [f"rollout_tensor_parallel={tp} must divide the model's {heads} attention and "
                f"{kv_heads} KV heads"] if heads % tp or kv_heads % tp else []
    return problems + sequence_parallel_problems(config.ulysses_sequence_parallel_size, heads,
                                                 kv_heads)


def kind_problems(config: ProbeConfig, is_vl: bool) -> list[str]:
    """What a VL model's prompt needs (its image fits the prompt; no Ulysses split)."""
    sp = config.ulysses_sequence_parallel_size
    if is_vl and sp > 1:
        return [f"ulysses_sequence_parallel_size={sp} with a VL model: the probe splits text "
                "sequences only (a VL prompt's image embeddings would be sliced after the "
                "vision tower); probe it with 1"]
    if is_vl and image_tokens(config) + IMAGE_FRAME_TOKENS > config.max_prompt_length:
        fits = IMAGE_TOKEN_PX * int((config.max_prompt_length - IMAGE_FRAME_TOKENS) ** 0.5)
        return [f"image_size_px={config.image_size_px} makes {image_tokens(config)} image "
                f"tokens, more than max_prompt_length={config.max_prompt_length} holds; "
                f"--set max_prompt_length={image_tokens(config) + 64} or "
                f"image_size_px={max(IMAGE_TOKEN_PX, fits)}"]
    return []


def sequence_parallel_problems(sp: int, heads: int, kv_heads: int) -> list[str]:
    """Ulysses' rule for a model of `heads` attention and `kv_heads` KV heads: sp divides the
    heads (each rank attends with heads/sp of them), and the KV heads divide sp or sp them
    (fewer than sp are repeated up to sp: verl's check in its Ulysses attention)."""
    if sp == 1 or (not heads % sp and not (kv_heads % sp if kv_heads >= sp else sp % kv_heads)):
        return []
    return [f"ulysses_sequence_parallel_size={sp} must divide the model's {heads} attention "
            f"heads, and its {kv_heads} KV heads must divide it or be divisible by it"]
