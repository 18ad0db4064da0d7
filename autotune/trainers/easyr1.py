"""EasyR1 (hiyouga/EasyR1): where each knob goes in its config, and its start-up rules.

Counts as autotune does: data.rollout_batch_size and worker.actor.global_batch_size in prompts
for the whole run, micro-batches in responses per GPU.
"""

from __future__ import annotations

from collections.abc import Collection

from autotune.config import ProbeConfig, Topology, old_pass_problem, torch_adamw_problem
from autotune.trainers.adapter import (
    Adapter,
    Derived,
    Getter,
    Setting,
    TrainerKeys,
    even_share,
)
from autotune.trainers.classes_easyr1 import KEY_CLASSES


def _easyr1_rules(config: ProbeConfig, topo: Topology, get: Getter) -> list[str]:
    """verl/trainer/ray_trainer.py and verl/workers/fsdp_workers.py of hiyouga/EasyR1, and
    the equal splits (DataProto.split) of a device's share in workers/actor/dp_actor.py."""
    world, length = topo.world_size, config.sequence_length
    ulysses = get("worker.actor.ulysses_size", 1)
    problems = []
    if config.entropy_coeff:
        problems.append(f"entropy_coeff={config.entropy_coeff}: EasyR1 has no entropy bonus "
                        "(its loss never takes the entropy): probe with entropy_coeff=0")
    if config.fused_logprob:
        problems.append("fused_logprob: EasyR1 has no fused log-prob kernel (its "
                        "models/monkey_patch.py leaves linear cross-entropy a TODO): probe "
                        "with fused_logprob=false")
    if world % ulysses:
        problems.append(f"worker.actor.ulysses_size={ulysses} must divide the {world} GPUs (the "
                        "(dp, sp) device mesh; the global batch per device is global_batch_size "
                        "// (GPUs // ulysses_size))")
        ulysses = 1
    problems += _easyr1_batch_rules(config, world, ulysses, get)
    problems += _easyr1_rollout_rules(config, world, get)
    problems += old_pass_problem(config, "EasyR1")
    problems += torch_adamw_problem(config, "EasyR1")
    if config.has_critic:
        problems += _easyr1_critic_rules(config, world, get("worker.critic.ulysses_size", 1),
                                         length)
    return problems


def _easyr1_batch_rules(config: ProbeConfig, world: int, ulysses: int, get: Getter
                        ) -> list[str]:
    """ray_trainer.py's batch checks, fsdp_workers.py's normalisation of the global batch
    per device, and dp_actor.py's equal splits of a device's share."""
    n, rbs, gbs = config.rollout_n, config.rollout_batch_size, config.global_batch_size
    mbu, mbe = config.micro_batch_size_update, config.micro_batch_size_experience
    mini = get("data.mini_rollout_batch_size", 0)  # prompts per generation round when set
    problems = []
    if rbs % gbs:
        problems.append(f"data.rollout_batch_size={rbs} must be divisible by "
                        f"worker.actor.global_batch_size={gbs}")
    if mini and mini % world:
        problems.append(f"data.mini_rollout_batch_size={mini} must be divisible by the {world} "
                        "GPUs (each generation round is chunked equally)")
    if (not mini and rbs % world) or (rbs * n) % world:
        problems.append(f"data.rollout_batch_size={rbs} (and x rollout.n={n}) must be "
                        f"divisible by the {world} GPUs (batches are chunked equally)")
    if (rbs * n) % mbe:
        problems.append(f"data.rollout_batch_size*worker.rollout.n={rbs * n} must be divisible "
                        f"by worker.actor.micro_batch_size_per_device_for_experience={mbe}")
    per_device = gbs * (n if n > 1 else 1) // max(1, world // ulysses)
    if per_device == 0:
        problems.append(f"worker.actor.global_batch_size={gbs} x rollout.n={n} x ulysses_size="
                        f"{ulysses} must be at least the {world} GPUs")
    elif per_device % mbu:
        problems.append(f"global batch size per device {per_device} (global_batch_size={gbs} "
                        f"x n={n} / {world} GPUs) must be divisible by "
                        f"worker.actor.micro_batch_size_per_device_for_update={mbu}")
    shard = rbs * n // world * ulysses  # responses one device's actor sees (Ulysses gathers)
    if not (rbs * n) % world and per_device and shard % per_device:
        problems.append(f"the {shard} responses on each device must split into whole "
                        f"mini-batches of {per_device} (global batch size per device)")
    if not config.dynamic_batching and not (rbs * n) % world and shard % mbe:  # DataProto.split
        problems.append(f"the {shard} responses on each device must split into whole "
                        f"micro-batches of worker.actor.micro_batch_size_per_device_for_"
                        f"experience={mbe}")
    if get("worker.actor.fsdp.enable_cpu_offload", False) and per_device != mbu:
        problems.append(f"worker.actor.fsdp.enable_cpu_offload needs no gradient accumulation: "
                        f"micro_batch_size_per_device_for_update={mbu} must equal the global "
                        f"batch size per device {per_device}")
    return problems


def _easyr1_rollout_rules(config: ProbeConfig, world: int, get: Getter) -> list[str]:
    """The token budgets dp_actor.py makes of the micro-batches, vLLM's rollout (its tensor
    parallel size, prefill budget and sleep), and the estimator's need for groups."""
    length, problems = config.sequence_length, []
    for knob, budget, micro, key in (
            ("max_token_len_update", config.max_token_len_update,
             config.micro_batch_size_update, "update"),
            ("max_token_len_experience", config.max_token_len_experience,
             config.micro_batch_size_experience, "experience")):
        if config.dynamic_batching and budget not in (None, micro * length):
            problems.append(f"{knob}={budget}: EasyR1's token budget is worker.actor.micro_"
                            f"batch_size_per_device_for_{key} x the padded sequence length "
                            f"({length}), so it can only be {micro * length} here; search "
                            "micro-batches for EasyR1")
    # the keys as the file holds them: the knobs' values where the export writes them
    tp = get("worker.rollout.tensor_parallel_size", 2)
    tokens = get("worker.rollout.max_num_batched_tokens", 8192)
    if world % tp:
        problems.append(f"the {world} GPUs must be divisible by "
                        f"worker.rollout.tensor_parallel_size={tp}")
    if tokens < length:
        problems.append(f"worker.rollout.max_num_batched_tokens={tokens} must be at least "
                        f"max_prompt_length+max_response_length={length}")
    if not config.enable_sleep:
        problems.append("EasyR1 always puts vLLM to sleep after rollout (enable_sleep_mode="
                        "True, no key to turn it off): enable_sleep=false cannot be exported")
    estimator = "gae" if config.has_critic else get("algorithm.adv_estimator", "grpo")
    if estimator in ("grpo", "rloo") and config.rollout_n <= 1:
        problems.append(f"GRPO and RLOO need worker.rollout.n > 1 (got {config.rollout_n})")
    return problems


def _easyr1_critic_rules(config: ProbeConfig, world: int, ulysses: int, length: int
                         ) -> list[str]:
    """ray_trainer.py's critic checks and fsdp_workers.py's for the critic role: the critic's
    global batch (written as the actor's) and its micro-batch (update and experience, both
    written as critic_micro_batch_size_update)."""
    n, rbs, gbs = config.rollout_n, config.rollout_batch_size, config.global_batch_size
    mbc, problems = config.critic_micro_batch_size_update or 4, []
    if world % ulysses:
        return [f"worker.critic.ulysses_size={ulysses} must divide the {world} GPUs (the "
                "critic's (dp, sp) mesh)"]
    if (rbs * n) % mbc:
        problems.append(f"Rollout batch size * rollout.n ({rbs * n}) must be divisible by "
                        f"worker.critic.micro_batch_size_per_device_for_experience={mbc}")
    per_device = gbs * n // max(1, world // ulysses)
    if per_device and per_device % mbc:
        problems.append(f"critic global batch size per device {per_device} must be divisible "
                        f"by worker.critic.micro_batch_size_per_device_for_update={mbc}")
    budget = config.critic_max_token_len_update
    if config.dynamic_batching and budget not in (None, mbc * length):
        problems.append(f"critic_max_token_len_update={budget}: EasyR1's critic budget is its "
                        f"micro-batch x the padded sequence length ({mbc * length}); search "
                        "critic micro-batches for EasyR1")
    return problems


REF_OFFLOAD = "worker.ref.offload.offload_params"

# The keys of EasyR1's config besides its knob table (EASYR1.keys, below) that change what
# runs: each holds the value the probe ran, or is refused (--force writes the value, and the
# header says so). The critic's model is compared with the study's (measured.py).
EASYR1_SETTINGS = (
    # fsdp_workers.py: FSDP's CPUOffload for the actor (parameters, gradients and the
    # optimizer step on the host), which no probe ran (offload_params/offload_optimizer are
    # EasyR1's worker.actor.offload keys, between phases)
    Setting("worker.actor.fsdp.enable_cpu_offload", False, "FSDP's CPU offload keeps the "
            "actor's parameters and gradients on the host and steps the optimizer there, which "
            "no probe ran", ok=lambda value: value is False, default_ok=True, refuse=True),
    Setting("worker.critic.fsdp.enable_cpu_offload", False, "FSDP's CPU offload keeps the "
            "critic's parameters and gradients on the host, which no probe ran",
            ok=lambda value: value is False, default_ok=True, refuse=True),
    # verl/workers/config/critic.py (b44b311): the critic's padding_free defaults to false,
    # unlike the actor's (set in examples/config.yaml); the probe's critic removes padding
    # as its actor does. Read only where the run trains a critic.
    Setting("worker.critic.padding_free", True, "the probe's critic removes padding in its "
            "forwards, as the actor does; EasyR1's default (false) pads every sequence to the "
            "batch's longest", ok=lambda value: value is True, default_ok=False, refuse=True,
            applies=lambda config: config.has_critic),
)
REF_CPU_OFFLOAD = "worker.ref.fsdp.enable_cpu_offload"


def _easyr1_ref_offload(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    on = config.offload_ref_params
    return {REF_OFFLOAD: True} if on else {REF_OFFLOAD: False, REF_CPU_OFFLOAD: False}


def _easyr1_unheld(config: ProbeConfig, topo: Topology, recorded: Collection[str]
                   ) -> list[str]:
    """What EasyR1's config has no key for: vLLM's max_num_seqs, its sleep level (1), the
    CUDA allocator (its Ray runtime env turns expandable segments off), and its FSDP wrapper
    (FSDP1 always)."""
    lines = ["allocator: the study trained with the CUDA allocator's expandable segments; "
             "EasyR1's Ray runtime env sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False "
             "(verl/trainer/main.py), so its training phases may hold more than measured: set "
             "it to True there to run as probed"] if config.expandable_segments else []
    if config.entropy_metric:
        lines.append("entropy: the study took every position's entropy in its experience phase; "
                     "EasyR1 never does, so its experience phase holds less than measured")
    if topo.world_size > 1 and "fsdp_strategy" in recorded and config.fsdp_strategy == "fsdp2":
        lines.append("sharding: the study's ranks ran FSDP2 (fully_shard); EasyR1 wraps with "
                     "FSDP1 (flat parameters, its own streams and state-dict copies at weight "
                     "sync), so its memory may differ from what was measured (probe with "
                     "--trainer easyr1: it runs FSDP1)")
    if not config.engine_reserves:
        return lines
    lines += [f"rollout: EasyR1 has no key for max_num_seqs (the study's engine ran "
              f"{config.max_num_seqs}); vLLM's own default applies, inside the same "
              "gpu_memory_utilization"]
    if config.sleep_level != 1:
        lines.append(f"rollout: the study's engine slept at level {config.sleep_level}; EasyR1 "
                     "sleeps at level 1 (weights kept in host memory)")
    return lines


def _easyr1_short_run(steps: int, validate: bool, trial_dir: str) -> TrainerKeys:
    """verl/trainer/config.py TrainerConfig of EasyR1: stop after `steps` steps, validate
    only before training when asked, log to the console, keep checkpoints out of the way."""
    return {"trainer.max_steps": steps, "trainer.val_freq": -1,
            "trainer.val_before_train": validate, "trainer.save_freq": -1,
            "trainer.logger": ["console"], "trainer.find_last_checkpoint": False,
            "trainer.save_model_only": True,
            "trainer.save_checkpoint_path": f"{trial_dir}/checkpoints"}


EASYR1 = Adapter(
    key_classes=KEY_CLASSES,
    name="easyr1",
    no_separate_placement="worker.hybrid_engine=false raises NotImplementedError "
                          "(verl/trainer/ray_trainer.py at b44b311)",
    keys={"rollout_batch_size": ("data.rollout_batch_size",),
          "rollout_n": ("worker.rollout.n",),
          "global_batch_size": ("worker.actor.global_batch_size",),
          "micro_batch_size_update": ("worker.actor.micro_batch_size_per_device_for_update",),
          "micro_batch_size_experience":
              ("worker.actor.micro_batch_size_per_device_for_experience",),
          # with it on, each micro-batch is a token budget of micro-batch x padded length
          # (dp_actor.py), padding removed where padding_free is on (its default)
          "dynamic_batching": ("worker.actor.dynamic_batching",),
          "gradient_checkpointing": ("worker.actor.model.enable_gradient_checkpointing",),
          "offload_params": ("worker.actor.offload.offload_params",),
          "offload_optimizer": ("worker.actor.offload.offload_optimizer",),
          "max_prompt_length": ("data.max_prompt_length",),
          "max_response_length": ("data.max_response_length",),
          "val_batch_size": ("data.val_batch_size",),
          "rollout_tensor_parallel": ("worker.rollout.tensor_parallel_size",),
          "gpu_memory_utilization": ("worker.rollout.gpu_memory_utilization",),
          "max_num_batched_tokens": ("worker.rollout.max_num_batched_tokens",),
          # LoRA on the actor (verl/workers/actor/config.py LoraConfig); the reference is the
          # actor with its adapters off
          "lora_rank": ("worker.actor.model.lora.rank",),
          "lora_alpha": ("worker.actor.model.lora.alpha",),
          # a string, all-linear or comma-separated names (LoraConfig.post_init refuses a
          # list; fsdp_workers.py splits it), the knob's own form
          "lora_target_modules": ("worker.actor.model.lora.target_modules",),
          # Ulysses: the reference copies the actor's (WorkerConfig.post_init)
          "ulysses_sequence_parallel_size": ("worker.actor.ulysses_size",)},
    topology_keys=("trainer.nnodes", "trainer.n_gpus_per_node"),
    companions={},
    rules=_easyr1_rules,
    launch="python3 -m verl.trainer.main config={path}",  # EasyR1's OmegaConf entry point
    derived=(
        # ray_trainer.py: a reference model unless algorithm.disable_kl (false by default)
        Derived(("use_kl",), lambda config, topo: {"algorithm.disable_kl": not config.use_kl},
                lambda get, topo: {"use_kl": not get("algorithm.disable_kl", False)},
                ("algorithm.disable_kl",)),
        # the reference's params are off the GPU with its offload, or with FSDP's CPU offload
        # (fsdp_workers.py: CPUOffload(offload_params=True)), as examples/config.yaml has it
        Derived(("offload_ref_params",), _easyr1_ref_offload, lambda get, topo: {
            "offload_ref_params": bool(get(REF_OFFLOAD, False) or get(REF_CPU_OFFLOAD, False))},
            (REF_OFFLOAD, REF_CPU_OFFLOAD)),
        # ray_trainer.py: a critic exactly when the estimator is gae
        Derived(("algorithm",), lambda config, topo: {
            "algorithm.adv_estimator": "gae" if config.has_critic else "grpo"},
            lambda get, topo: {"algorithm": "ppo" if get("algorithm.adv_estimator", "grpo")
                               == "gae" else "grpo"}, ("algorithm.adv_estimator",)),
        ),
    defaults={"micro_batch_size_update": 1, "micro_batch_size_experience": 2,  # examples/
              "gradient_checkpointing": True, "offload_params": True,  # config.yaml
              "offload_optimizer": True, "dynamic_batching": True,  # its default too
              "use_kl": True, "offload_ref_params": True,
              "critic_gradient_checkpointing": True},  # its critic's ModelConfig default
    # fsdp_workers.py: global_batch_size *= rollout.n, then // (world_size // ulysses_size);
    # the rollout batch (rollout_batch_size x n responses) is chunked equally over the world
    share=even_share,
    short_run=_easyr1_short_run,
    settings=EASYR1_SETTINGS,
    model_key="worker.actor.model.model_path",
    unheld=_easyr1_unheld,
    # verl/workers/critic/config.py of EasyR1: nothing follows the actor's (post_init fills
    # only the reference), so the critic's batch, micro-batches and batching are all written
    critic_keys={
        "critic_micro_batch_size_update": (
            "worker.critic.micro_batch_size_per_device_for_update",
            "worker.critic.micro_batch_size_per_device_for_experience"),
        "critic_gradient_checkpointing": ("worker.critic.model.enable_gradient_checkpointing",),
        "critic_offload_params": ("worker.critic.offload.offload_params",),
        "critic_offload_optimizer": ("worker.critic.offload.offload_optimizer",),
        "global_batch_size": ("worker.critic.global_batch_size",),
        "dynamic_batching": ("worker.critic.dynamic_batching",),
        "ulysses_sequence_parallel_size": ("worker.critic.ulysses_size",)},
    critic_model_key="worker.critic.model.model_path",
)
