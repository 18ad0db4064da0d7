"""verl (volcengine/verl, and its forks Search-R1, Logic-RL): its keys and start-up rules.

data.train_batch_size and actor.ppo_mini_batch_size count prompts for the whole run;
ppo_micro_batch_size_per_gpu and the log-prob micro-batches count responses per GPU.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from autotune.config import Knobs, ProbeConfig, Topology, old_pass_problem, torch_adamw_problem
from autotune.trainers.adapter import (
    Adapter,
    Derived,
    Getter,
    SeparateLaunch,
    Setting,
    TrainerKeys,
    even_share,
    module_list,
    module_names,
)
from autotune.trainers.classes_verl import KEY_CLASSES

ACTOR_MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
CRITIC_MICRO = "critic.ppo_micro_batch_size_per_gpu"
ACTOR_SP = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"
CRITIC_SP = "critic.ulysses_sequence_parallel_size"


def _verl_rules(config: ProbeConfig, topo: Topology, get: Getter) -> list[str]:
    """verl/utils/config.py, workers/config/actor.py and workers/fsdp_workers.py of verl
    (0.7.1 on PyPI, the last release with the FSDP workers; b178a3c the same), read for the
    keys as the file holds them (`get`)."""
    world, n = topo.world_size, config.rollout_n
    rbs, gbs = config.rollout_batch_size, config.global_batch_size
    sp = get(ACTOR_SP, 1)
    infer = (get("actor_rollout_ref.rollout.tensor_model_parallel_size", 2)  # as written
             * get("actor_rollout_ref.rollout.data_parallel_size", 1)
             * get("actor_rollout_ref.rollout.pipeline_model_parallel_size", 1))
    dynamic = config.dynamic_batching  # validate_config skips the batch-count checks then
    problems = []
    if not dynamic and (rbs * n) % world:
        problems.append(f"real_train_batch_size data.train_batch_size*rollout.n={rbs * n} must "
                        f"be divisible by minimal possible batch size {world} (the GPUs)")
    if rbs < gbs:
        problems.append(f"data.train_batch_size={rbs} must be >= "
                        f"actor.ppo_mini_batch_size={gbs}")
    if world % sp:
        problems.append(f"{ACTOR_SP}={sp} must divide the {world} GPUs (fsdp_workers.py: the "
                        "(dp, sp) device mesh)")
        sp = 1
    if sp > 1 and not get("actor_rollout_ref.model.use_remove_padding", True):
        problems.append(f"{ACTOR_SP}={sp}: when using sequence parallelism for actor/ref policy, "
                        "you must enable `use_remove_padding` (actor_rollout_ref.model."
                        "use_remove_padding: true)")
    normalized = gbs * n // (world // sp)
    micro = get(ACTOR_MICRO, None if dynamic else config.micro_batch_size_update)
    problems += _micro_rules("", normalized, micro, gbs, n, world // sp)
    length = config.sequence_length
    for budget, key in ((config.max_token_len_update, "actor.ppo_max_token_len_per_gpu"),
                        (config.max_token_len_experience,
                         "rollout.log_prob_max_token_len_per_gpu")):
        if dynamic and budget is not None and budget * sp < length:
            problems.append(f"{key}={budget} x ulysses_sequence_parallel_size={sp} must be "
                            f"at least max_prompt_length+max_response_length={length} "
                            "(seqlen_balancing: max_token_len must hold the sequence length)")
    engine_world = config.rollout_gpus if config.separate else world  # the rollout's pool
    if engine_world % infer:
        problems.append(f"rollout world_size {engine_world} is not divisible by "
                        f"infer_world_size {infer} (tensor x data x pipeline parallel)")
    if config.separate:
        problems += _verl_separate_rules(config, topo, get)
    if config.lora_rank > VLLM_MAX_LORA_RANK and get(ENGINE_NAME, "vllm") == "vllm":
        problems.append(f"lora_rank must be less than or equal to {VLLM_MAX_LORA_RANK}, but got "
                        f"{config.lora_rank} (utils/config.py: vLLM's largest LoRA rank)")
    problems += old_pass_problem(config, "verl")
    problems += torch_adamw_problem(config, "verl")
    if config.has_critic:
        problems += _verl_critic_rules(config, world, get)
    return problems


def _micro_rules(role: str, normalized: int, micro: int | None, gbs: int, n: int, dp: int
                 ) -> list[str]:
    """fsdp_workers.py (ActorRolloutRefWorker.__init__, CriticWorker.__init__): the mini-batch
    times rollout.n over the data-parallel size (the GPUs over sp) must be above 0, and, when
    the per-GPU micro-batch is set (null under token budgets: unused, not written), split into
    whole micro-batches; asserted with dynamic batching on or off."""
    if normalized <= 0:
        return [f"{role}ppo_mini_batch_size={gbs} x rollout.n={n} over a data-parallel size "
                f"of {dp} should be larger than 0 after normalization"]
    if micro is not None and (normalized % micro or normalized // micro == 0):
        return [f"normalized {role}ppo_mini_batch_size {normalized} should be divisible by "
                f"{role}ppo_micro_batch_size_per_gpu {micro}"]
    return []


def _verl_critic_rules(config: ProbeConfig, world: int, get: Getter) -> list[str]:
    """fsdp_workers.py CriticWorker: its mini-batch (the actor's, ppo_trainer.yaml) normalised
    over its own data-parallel size (its own ulysses size) and split into whole micro-batches;
    workers/config/critic.py: sequence parallelism needs the critic model's
    use_remove_padding (false in critic.yaml); seqlen_balancing's budget rule."""
    problems = []
    sp = get(CRITIC_SP, 1)
    if world % sp:
        return [f"{CRITIC_SP}={sp} must divide the {world} GPUs (the critic's (dp, sp) mesh)"]
    if sp > 1 and not get("critic.model.use_remove_padding", False):
        problems.append(f"{CRITIC_SP}={sp}: when using sequence parallelism for critic, you "
                        "must enable `use_remove_padding` (critic.model.use_remove_padding: "
                        "true)")
    gbs, n = config.global_batch_size, config.rollout_n
    micro = get(CRITIC_MICRO, None if config.dynamic_batching
                else config.critic_micro_batch_size_update)
    problems += _micro_rules("critic ", gbs * n // (world // sp), micro, gbs, n, world // sp)
    length = config.sequence_length
    budget = config.critic_max_token_len_update
    if config.dynamic_batching and budget is not None and budget * sp < length:
        problems.append(f"critic.ppo_max_token_len_per_gpu={budget} x ulysses_sequence_"
                        f"parallel_size={sp} must be at least max_prompt_length+"
                        f"max_response_length={length}")
    return problems


KL_LOSS, KL_REWARD = "actor_rollout_ref.actor.use_kl_loss", "algorithm.use_kl_in_reward"
TARGET_MODULES = "actor_rollout_ref.model.target_modules"
ENGINE_NAME = "actor_rollout_ref.rollout.name"
VLLM_MAX_LORA_RANK = 512  # vllm/config/lora.py MaxLoRARanks' largest (verl's fallback table)

# The keys of verl's config besides its knob table (VERL.keys, below) that change what runs:
# each holds the value the probe ran, or is refused (--force writes the value, and the header
# says so). The critic's model is compared with the study's (measured.py).
VERL_SETTINGS = (
    # the FSDP engine's own Ulysses size (workers/config/engine.py): the actor's key above is
    # the one autotune writes; another value here would split sequences otherwise
    Setting("actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size", 1,
            "sequence parallelism set in the FSDP engine's config, which autotune does not "
            "write (it writes actor.ulysses_sequence_parallel_size)",
            ok=lambda value: value == 1, default_ok=True, refuse=True),
    # ppo_trainer.yaml leaves the engine mandatory (???): a file composed on it names one;
    # another engine (sglang, trtllm) reserves its own memory, which no probe measured
    Setting(ENGINE_NAME, "vllm", "the rollout engine: autotune's vllm-like and vllm probes "
            "stand for vLLM (verl's ppo_trainer.yaml leaves it to set, ???); another engine "
            "reserves and frees memory otherwise", ok=lambda value: value == "vllm",
            default_ok=False, refuse_if=lambda value: value != "???"),
    # the hybrid engine off runs the one_step_off_policy recipe's engine pool (placement=
    # separate), which a colocated study did not measure (and verl's main_ppo asserts it on)
    Setting("actor_rollout_ref.hybrid_engine", True, "the engine on the training GPUs "
            "(colocated), as the study probed it; hybrid_engine false is verl's separate "
            "placement (its one_step_off_policy recipe)", ok=lambda value: value is True,
            default_ok=True, refuse=True, applies=lambda config: not config.separate),
    # LoRA adapters loaded from a path: the probe trained fresh ones from lora_rank
    Setting("actor_rollout_ref.model.lora_adapter_path", None, "LoRA adapters loaded from a "
            "path, which the probe did not load", ok=lambda value: value is None,
            default_ok=True, refuse=True),
)
ESTIMATOR, CRITIC_ENABLE = "algorithm.adv_estimator", "critic.enable"


def _verl_algorithm(get: Getter, topo: Topology) -> Knobs:
    """verl/trainer/ppo/utils.py need_critic: critic.enable when set, else whether the
    estimator is gae (ppo_trainer.yaml's default)."""
    enable = get(CRITIC_ENABLE, None)
    critic = enable if enable is not None else get(ESTIMATOR, "gae") == "gae"
    return {"algorithm": "ppo" if critic else "grpo"}


def _verl_reference(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    """A reference model as the probe held it: the KL loss turns it on (GRPO's way); off,
    both switches off."""
    return {KL_LOSS: True} if config.use_kl else {KL_LOSS: False, KL_REWARD: False}


def _verl_unheld(config: ProbeConfig, topo: Topology, recorded: Collection[str]
                 ) -> list[str]:
    """verl/third_party/vllm: its vLLM (>= 0.8.5) sleeps at level 2, with no key to change;
    verl trains with the CUDA allocator's expandable segments on, and takes the entropy in
    its old-log-prob pass (fsdp_workers.py compute_log_prob: calculate_entropy unless LoRA),
    with no key either."""
    lines = []
    if not config.entropy_metric:
        lines.append("entropy: verl takes every response position's entropy in its old-log-prob "
                     "pass (its actor/entropy metric); the study's experience phase did not, so "
                     "verl's may hold more than measured (probe with --set entropy_metric=true)")
    if "expandable_segments" in recorded and not config.expandable_segments:
        lines.append("allocator: verl trains with the CUDA allocator's expandable segments on "
                     "(off only for the rollout); the study probed without them, so verl's "
                     "training phases may hold less than measured")
    level = config.sleep_level
    if not config.engine_reserves or "sleep_level" not in recorded or level == 2:
        return lines
    return [*lines, f"rollout: the study's engine slept at level {level}; verl's vLLM "
            "(>= 0.8.5) sleeps at level 2 (weights dropped, not kept in host memory)"]


HYBRID = "actor_rollout_ref.hybrid_engine"
ENGINE_NODES, ENGINE_GPUS = "rollout.nnodes", "rollout.n_gpus_per_node"
ONE_STEP_OFF = "verl.experimental.one_step_off_policy.main_ppo"
# verl/experimental/one_step_off_policy/config/one_step_off_ppo_trainer.yaml (b178a3c, 0.7.1):
# the recipe's own keys over ppo_trainer, which the export writes itself (a file composed on
# ppo_trainer, as the colocated export is): the engine never sleeps (its weights are synced in
# place), it returns the log-probs, and the old log-probs are the engine's (bypass_mode)
# both recipes: no hybrid engine, an async server that returns log-probs (each asserts it:
# OneStepOffRayTrainer, fully_async_rollouter.py:400, 443), awake all run as the split
# probe's engine ran (its weights are synced in place)
# The weight sync over NCCL between the pools, as verl 0.9.1's recipe YAMLs set it
# (one_step_off_ppo_trainer.yaml, fully_async_ppo_trainer.yaml: checkpoint_engine.backend
# nccl); ppo_trainer's `naive` syncs to an engine in the trainer's own process
# (engine_workers.py update_weights), which a separate trainer has not: 0.9.1's recipes sync
# before their first step and fail there. b178a3c's recipes sync their own way and do not
# read the key; roles.py sizes the NCCL engine's buckets.
SYNC_BACKEND = "actor_rollout_ref.rollout.checkpoint_engine.backend"
SEPARATE_KEYS: TrainerKeys = {
    HYBRID: False,
    "actor_rollout_ref.rollout.mode": "async",
    "actor_rollout_ref.rollout.free_cache_engine": False,
    "actor_rollout_ref.rollout.calculate_log_probs": True,
    SYNC_BACKEND: "nccl"}
ONE_STEP_OFF_KEYS: TrainerKeys = {
    **SEPARATE_KEYS,
    "algorithm.rollout_correction.bypass_mode": True,
    "async_training": None}  # a fully asynchronous base's block cleared: one step off


FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
STALENESS_THRESHOLD = "async_training.staleness_threshold"
SYNC_STEPS = "async_training.trigger_parameter_sync_step"
REQUIRE_BATCHES = "async_training.require_batches"
MINI_BATCH = "actor_rollout_ref.actor.ppo_mini_batch_size"
CHECKPOINT_ENGINE = {"enable": True, "device_buffer_size_M": 4096,  # the recipe's YAML
                     "overlap_broadcast_and_consume": False}
# verl/experimental/fully_async_policy (b178a3c): its YAML's keys over ppo_trainer, which the
# export writes itself (docs/research/placement.md section 2), and what its rollouter asserts
# (fully_async_rollouter.py:76-80, 400, 443): the step is sized by the async_training keys,
# not data.train_batch_size (asserted 0); the run's length by every prompt of the user's
# epochs (total_rollout_steps null: the YAML's 100 would cap it at 100 prompts)
FULLY_ASYNC_KEYS: TrainerKeys = {
    **SEPARATE_KEYS,
    "data.train_batch_size": 0,
    "data.gen_batch_size": 1,
    REQUIRE_BATCHES: 1,
    # off: no generation is cut and resumed at a sync, as the split probe ran, and the bound
    # holds for every token (on, a sample's first tokens may be older: max_partial_span)
    "async_training.partial_rollout": False,
    "async_training.use_rollout_log_probs": True,
    "async_training.compute_prox_log_prob": False,
    "async_training.use_trainer_do_validate": False,
    **{f"async_training.checkpoint_engine.{k}": v for k, v in CHECKPOINT_ENGINE.items()},
    **{f"actor_rollout_ref.checkpoint_engine.{k}": v for k, v in CHECKPOINT_ENGINE.items()},
    "actor_rollout_ref.actor.use_rollout_log_probs": True,
    "rollout.total_epochs": "${trainer.total_epochs}",
    "rollout.test_freq": "${trainer.test_freq}"}


def _verl_placement(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    """placement=separate at staleness 1: one_step_off_policy's keys; at k >= 2,
    fully_async_policy's, one parameter version a step (ppo_mini_batch_size x require_batches
    1 x trigger_parameter_sync_step = the step's prompts) and staleness_threshold k: its
    rollouter pauses once it holds (k + 1) steps of samples and tags each with the version it
    finished under, so the lag is at most k steps (fully_async_rollouter.py:197-240, 582).
    The engine's GPUs are the launch's (_verl_separate_launch); colocated: verl's default
    hybrid engine, nothing."""
    if not config.separate:
        return {}
    if config.staleness <= 1:  # the step's prompts generated at once (ray_trainer.py's
        # dataloader takes data.gen_batch_size where it is set: a fully asynchronous base's 1
        # would make one-prompt steps)
        return {**ONE_STEP_OFF_KEYS, "data.gen_batch_size": config.rollout_batch_size}
    return {**FULLY_ASYNC_KEYS, STALENESS_THRESHOLD: config.staleness,
            SYNC_STEPS: config.rollout_batch_size // config.global_batch_size}


def _verl_placement_read(get: Getter, topo: Topology) -> Knobs:
    """A config with the hybrid engine off runs the engine on a pool of its own (the recipe's
    top-level rollout.nnodes x rollout.n_gpus_per_node): one step off policy, or with
    async_training's keys fully asynchronous, its lag at most ceil(staleness_threshold) steps
    and its step's prompts the mini-batch x require_batches x trigger_parameter_sync_step;
    with the hybrid engine on (the default), nothing is said (colocated)."""
    if get(HYBRID, True):
        return {}
    knobs: Knobs = {"placement": "separate", "staleness": 1,
                    "rollout_gpus": get(ENGINE_NODES, 1) * get(ENGINE_GPUS, 8)}
    threshold = get(STALENESS_THRESHOLD, None)
    if not isinstance(threshold, int | float):  # unset, or an interpolation: one step off
        return knobs
    knobs["staleness"] = math.ceil(threshold)
    mini = get(MINI_BATCH, None)
    if mini:
        knobs["rollout_batch_size"] = mini * get(REQUIRE_BATCHES, 1) * get(SYNC_STEPS, 4)
    return knobs


def _verl_separate_rules(config: ProbeConfig, topo: Topology, get: Getter) -> list[str]:
    """verl runs the engine on GPUs of its own only off policy: its PPO trainer asserts the
    hybrid engine (ray_trainer.py: "Currently, only support hybrid engine"); one step off is
    the one_step_off_policy recipe, more is fully_async_policy, whose version is whole
    mini-batches (_verl_placement; config/rules.py makes a step whole mini-batches). Both
    recipes' agent loops build each engine
    replica with gpus_per_node = trainer.n_gpus_per_node (agent_loop.py
    _initialize_llm_servers), and RolloutReplica asserts the engine's tensor-parallel size
    is a multiple of min(that, its size)."""
    if config.staleness == 0:
        return ["placement=separate with staleness=0: verl's PPO trainer runs only the hybrid "
                "engine (ray_trainer.py asserts it); its separate placement is one step off "
                "policy (the one_step_off_policy recipe): probe with staleness=1 for verl"]
    tp, per_node = config.rollout_tensor_parallel, topo.gpus_per_node
    if tp % min(per_node, tp):
        return [f"rollout_tensor_parallel={tp} with {per_node} training GPUs per node: verl's "
                f"off-policy agent loop sizes engine replicas by trainer.n_gpus_per_node, and "
                f"RolloutReplica asserts world_size {tp} is divisible by gpus_per_node "
                f"{min(per_node, tp)}: choose rollout_gpus so the trainer keeps a multiple of "
                f"{tp} GPUs per node, or a tensor-parallel size that divides it"]
    return []


def _verl_separate_launch(config: ProbeConfig, run: Topology, trainers: Topology,
                          model: str | None) -> SeparateLaunch:
    """The one_step_off_policy recipe at staleness 1, fully_async_policy at more
    (verl/experimental/*, b178a3c; their shell/*.sh): trainer.* the training GPUs, the
    top-level rollout.* the engine's pool, the recipe's main launched on this file from a
    verl checkout (the recipes' code is not in verl's PyPI wheel: 0.7.1 ships only their YAML,
    and 0.7.1's one-step-off recipe refuses the legacy FSDP workers the probes model: the
    header says so)."""
    engine = run.engine_of(config.rollout_gpus)
    assert engine is not None  # separate_placement refused the split otherwise
    pools = (f"the engine on {engine.nnodes} x {engine.gpus_per_node} GPUs (rollout.*), the "
             f"trainer on {trainers.nnodes} x {trainers.gpus_per_node} (trainer.*)")
    engine_copy = ("engine GPUs: b178a3c's rollout worker also builds an fp32 FSDP copy of the "
                   f"model sharded over the engine's {config.rollout_gpus} GPUs (4 bytes a "
                   f"parameter / {config.rollout_gpus} each, never offloaded: fsdp_workers.py "
                   "init_model's FSDPEngineConfig(), model_dtype fp32), beside vLLM's "
                   "gpu_memory_utilization share; autotune's memory per role follows 0.7.1's "
                   "standalone engine, which has none: leave that much below the utilisation")
    skipped = ("the trainer skips the actor's log-prob pass the study's experience phase "
               "timed: its side may run faster than measured")
    engine_keys = ("actor_rollout_ref.rollout.calculate_log_probs: true (the recipe's): vLLM "
                   "returns each generated token's log-prob, which the study's engine did not "
                   "(a little more work and memory in the rollout); free_cache_engine: false, "
                   "as the split probe's engine ran (awake all run); "
                   "checkpoint_engine.backend: nccl, the weight sync between the pools as "
                   "verl 0.9.1's recipes set it (its default, naive, syncs within one process "
                   "and fails at their first sync; b178a3c's recipes do not read it)"
                   )  # SEPARATE_KEYS
    values = {ENGINE_NODES: engine.nnodes, ENGINE_GPUS: engine.gpus_per_node}
    if config.staleness > 1:
        k, steps = config.staleness, config.rollout_batch_size // config.global_batch_size
        return SeparateLaunch(
            lines=(f"placement: separate, asynchronous with a lag of at most {k} steps (verl's "
                   f"fully_async_policy recipe): {pools}; run the launch line from a verl "
                   "checkout (b178a3c: checked; the recipe's code is not in verl's PyPI "
                   "wheel); give Ray 23 CPUs for the recipe's actors before its workers (task "
                   "runner 1, rollouter 10, trainer 10, message queue 2)",
                   f"one parameter version is one step: ppo_mini_batch_size "
                   f"{config.global_batch_size} x require_batches 1 x "
                   f"trigger_parameter_sync_step {steps} = the step's "
                   f"{config.rollout_batch_size} prompts; staleness_threshold {k}: the "
                   f"rollouter pauses once it holds {k + 1} steps of samples and tags each "
                   "with the version it finished under (fully_async_rollouter.py), as the "
                   f"study's split probe bounded its lag at {k}; data.train_batch_size 0 and "
                   "gen_batch_size 1, as the recipe asserts",
                   "the rollouter keeps at most 16 prompts (each with its rollout.n "
                   "responses) in flight per engine replica (fully_async_rollouter.py "
                   "set_max_required_samples), where the study's engine took whole waves of "
                   "up to max_num_seqs sequences: generation may run at a lower concurrency "
                   "than measured",
                   "async_training.partial_rollout: false, as the split probe ran (no "
                   "generation cut and resumed at a sync, so every token is within the "
                   "bound); the recipe's default (true) may run long tails faster, unmeasured",
                   f"async_training.use_rollout_log_probs: true (the recipe's): {skipped}",
                   engine_keys, engine_copy,
                   "the run's length: rollout.total_rollout_steps null and "
                   "rollout.total_epochs ${trainer.total_epochs}, every prompt of your epochs "
                   "(the recipe ignores trainer.total_training_steps; its YAML's 100 would "
                   "stop at 100 prompts); rollout.test_freq ${trainer.test_freq}, counted in "
                   "parameter versions (steps)",
                   f"host memory: the recipe's message queue (a Ray actor) holds up to {k + 1} "
                   "steps of samples and each trainer rank pins its share of the weights at a "
                   "sync, which autotune's host model does not count"),
            values={**values, "rollout.total_rollout_steps": None},  # null: written, not left out
            launch=f"python3 -m {FULLY_ASYNC} --config-path {{folder}} --config-name {{name}}")
    return SeparateLaunch(
        lines=(f"placement: separate, one step off policy (verl's one_step_off_policy recipe):"
               f" {pools}; "
               "run the launch line from a verl checkout whose recipe runs the FSDP workers "
               "the probes model (b178a3c: checked); the recipe's code is not in verl's PyPI "
               "wheel, and 0.7.1's recipe runs only the engine workers "
               "(use_legacy_worker_impl=disable, separation/utils.py), which no probe modeled",
               engine_copy,
               f"algorithm.rollout_correction.bypass_mode: true (the recipe's): the old "
               f"log-probs are the engine's, so {skipped}",
               engine_keys),
        values=values,
        launch=f"python3 -m {ONE_STEP_OFF} --config-path {{folder}} --config-name {{name}}")


def _verl_short_run(steps: int, validate: bool, trial_dir: str) -> TrainerKeys:
    """verl/trainer/config/ppo_trainer.yaml's trainer section: stop after `steps` steps,
    validate only before training when asked, log to the console, never resume or save."""
    return {"trainer.total_training_steps": steps, "trainer.test_freq": -1,
            "trainer.val_before_train": validate, "trainer.save_freq": -1,
            "trainer.logger": ["console"], "trainer.resume_mode": "disable",
            "trainer.default_local_dir": f"{trial_dir}/checkpoints"}


VERL = Adapter(
    key_classes=KEY_CLASSES,
    name="verl",
    keys={"rollout_batch_size": ("data.train_batch_size",),
          "rollout_n": ("actor_rollout_ref.rollout.n",),
          "global_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size",),
          "micro_batch_size_update": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",),
          # the old-log-prob forward (rollout) and the reference's, both per GPU
          "micro_batch_size_experience":
              ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
          # dynamic batching: per-GPU token budgets (ulysses sequence parallel multiplies them
          # by its size for a micro-batch split over that many GPUs: per GPU, the same tokens)
          "dynamic_batching": ("actor_rollout_ref.actor.use_dynamic_bsz",
                               "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
                               "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"),
          "max_token_len_update": ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu",),
          "max_token_len_experience":
              ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
               "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"),
          "gradient_checkpointing": ("actor_rollout_ref.model.enable_gradient_checkpointing",),
          "offload_params": ("actor_rollout_ref.actor.fsdp_config.param_offload",),
          "offload_ref_params": ("actor_rollout_ref.ref.fsdp_config.param_offload",),
          "offload_optimizer": ("actor_rollout_ref.actor.fsdp_config.optimizer_offload",),
          "max_prompt_length": ("data.max_prompt_length",),
          "max_response_length": ("data.max_response_length",),
          "rollout_tensor_parallel": ("actor_rollout_ref.rollout.tensor_model_parallel_size",),
          "gpu_memory_utilization": ("actor_rollout_ref.rollout.gpu_memory_utilization",),
          "max_num_batched_tokens": ("actor_rollout_ref.rollout.max_num_batched_tokens",),
          "max_num_seqs": ("actor_rollout_ref.rollout.max_num_seqs",),
          "enable_sleep": ("actor_rollout_ref.rollout.free_cache_engine",),
          # the actor's fused linear + log-prob (the reference inherits it: fsdp_workers.py),
          # and its kernel: torch (FusedLinearForPPO) or triton (linear_cross_entropy)
          "fused_logprob": ("actor_rollout_ref.model.use_fused_kernels",),
          "fused_logprob_kernel":
              ("actor_rollout_ref.model.fused_kernel_options.impl_backend",),
          # the entropy bonus and how the actor takes the entropy (dp_actor.py)
          "entropy_coeff": ("actor_rollout_ref.actor.entropy_coeff",),
          "entropy_chunking": ("actor_rollout_ref.actor.entropy_from_logits_with_chunking",),
          "entropy_checkpointing": ("actor_rollout_ref.actor.entropy_checkpointing",),
          # the FSDP wrapper: fsdp (FSDP1) or fsdp2; the reference follows the actor's
          # (ref.yaml: strategy: ${actor_rollout_ref.actor.strategy})
          "fsdp_strategy": ("actor_rollout_ref.actor.strategy",),
          # LoRA on the actor (the reference is the actor with its adapters off: no copy)
          "lora_rank": ("actor_rollout_ref.model.lora_rank",),
          "lora_alpha": ("actor_rollout_ref.model.lora_alpha",),
          # Ulysses sequence parallelism: the actor's, and the reference's (ref.yaml follows
          # the actor's by ${oc.select:...}; a base that spells it otherwise is written over)
          "ulysses_sequence_parallel_size": (ACTOR_SP,
                                             "actor_rollout_ref.ref.ulysses_sequence_parallel_"
                                             "size")},
    topology_keys=("trainer.nnodes", "trainer.n_gpus_per_node"),
    # the per-GPU micro-batches must not be set together with the deprecated global ones
    companions={"actor_rollout_ref.actor.ppo_micro_batch_size": None,
                "actor_rollout_ref.rollout.log_prob_micro_batch_size": None,
                "actor_rollout_ref.ref.log_prob_micro_batch_size": None},
    rules=_verl_rules,
    launch="python3 -m verl.trainer.main_ppo --config-path {folder} --config-name {name}",
    derived=(
        # verl/trainer/ppo/utils.py need_reference_policy: a reference model is built when
        # the actor's KL loss or the reward's KL penalty is on (both off by default)
        Derived(("use_kl",), _verl_reference, lambda get, topo: {"use_kl": bool(
            get(KL_LOSS, False) or get(KL_REWARD, False))}, (KL_LOSS, KL_REWARD)),
        # PPO is GAE with the critic on; GRPO, no critic
        Derived(("algorithm",), lambda config, topo: {
            ESTIMATOR: "gae" if config.has_critic else "grpo",
            CRITIC_ENABLE: config.has_critic}, _verl_algorithm,
            (ESTIMATOR, CRITIC_ENABLE)),
        # target_modules: all-linear as a string, module names as a list (HFModelConfig)
        Derived(("lora_target_modules",), lambda config, topo: {
            TARGET_MODULES: module_list(config.lora_target_modules)},
            lambda get, topo: module_names(get(TARGET_MODULES, None)),
            (TARGET_MODULES,)),
        # the hybrid engine (colocated), or the one-step-off recipe's engine pool
        Derived(("placement", "staleness"), _verl_placement, _verl_placement_read,
                (HYBRID, ENGINE_NODES, ENGINE_GPUS, STALENESS_THRESHOLD, SYNC_STEPS,
                 REQUIRE_BATCHES)),),
    # ppo_trainer.yaml; its per-GPU micro-batches are null (must be set): the space's safest
    defaults={"gradient_checkpointing": True, "offload_params": False,
              "offload_optimizer": False, "dynamic_batching": False, "use_kl": False,
              "fsdp_strategy": "fsdp",  # dp_actor.yaml: strategy: fsdp
              "critic_gradient_checkpointing": True},  # critic.yaml's too
    # fsdp_workers.py: ppo_mini_batch_size *= rollout.n, then //= (world // sp_size); the
    # train batch (train_batch_size x n responses) is dispatched equally over the world
    share=even_share,
    short_run=_verl_short_run,
    settings=VERL_SETTINGS,
    # without the user's config, the file composes on verl's own defaults (Hydra)
    skeleton={"hydra": {"searchpath": ["pkg://verl.trainer.config"]},
              "defaults": ["ppo_trainer", "_self_"]},
    skeleton_note="composed on verl's own ppo_trainer.yaml through the defaults list below: "
                  "launch with --config-path <this file's folder> --config-name <its name "
                  "without .yaml> (a whole config, not a list of overrides)",
    model_key="actor_rollout_ref.model.path",
    unheld=_verl_unheld,
    # critic.yaml / dp_critic.yaml: its forward micro-batch and budget follow its update's
    # by default, written the same; its mini-batch and dynamic batching follow the actor's
    critic_keys={
        "critic_micro_batch_size_update": ("critic.ppo_micro_batch_size_per_gpu",
                                           "critic.forward_micro_batch_size_per_gpu"),
        "critic_max_token_len_update": ("critic.ppo_max_token_len_per_gpu",
                                        "critic.forward_max_token_len_per_gpu"),
        "critic_gradient_checkpointing": ("critic.model.enable_gradient_checkpointing",),
        "critic_offload_params": ("critic.model.fsdp_config.param_offload",),
        "critic_offload_optimizer": ("critic.model.fsdp_config.optimizer_offload",),
        "global_batch_size": ("critic.ppo_mini_batch_size",),
        "dynamic_batching": ("critic.use_dynamic_bsz",),
        "fsdp_strategy": ("critic.strategy",),
        # the critic splits sequences as the probe's critic did (the run's one SP size)
        "ulysses_sequence_parallel_size": (CRITIC_SP,)},
    critic_model_key="critic.model.path",
    # fsdp_workers.py asserts the per-GPU micro-batches divide the normalised mini-batch
    # whenever they are set; under token budgets verl never runs them: written as null
    unused=lambda config: (ACTOR_MICRO, CRITIC_MICRO, "critic.forward_micro_batch_size_per_gpu")
    if config.dynamic_batching else (),
    separate_launch=_verl_separate_launch,
)
