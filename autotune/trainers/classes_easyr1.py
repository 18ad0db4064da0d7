"""easyr1 config keys outside autotune's knob tables, classified (source: hiyouga/EasyR1 b44b311b669bf1fd1aa2fc36f2251482ba33cb16, the dataclasses of verl/trainer/config.py and verl/workers/{config,actor/config,critic/config,reward/config,rollout/config}.py)."""

from __future__ import annotations

from typing import Any

from autotune.trainers.key_classes import Compared, KeyClasses

# keys the adapter's own code already reads and compares (grep the key string in
# autotune/trainers/easyr1.py, export_plan.py, measured.py, adapter.py): (pattern, where)
CHECKED = (
    ("trainer.max_steps", "easyr1.py _easyr1_short_run: the probe's trial run stops after its steps"),
    ("trainer.logger", "easyr1.py _easyr1_short_run: the trial logs to the console"),
    ("trainer.val_freq", "easyr1.py _easyr1_short_run: no validation during the trial"),
    ("trainer.val_before_train", "easyr1.py _easyr1_short_run: validation before training only when asked"),
    ("trainer.save_freq", "easyr1.py _easyr1_short_run: no checkpoints during the trial"),
    ("trainer.save_model_only", "easyr1.py _easyr1_short_run: set for the trial"),
    ("trainer.save_checkpoint_path", "easyr1.py _easyr1_short_run: the trial's own checkpoint folder"),
    ("trainer.find_last_checkpoint", "easyr1.py _easyr1_short_run: the trial never resumes"),
)

# settings that change the probe's memory or time: (pattern, values the probe's run equals, why)
COMPARED: tuple[tuple[Any, ...], ...] = (
    # data
    ("data.mini_rollout_batch_size", (None,),
     "generation in rounds of this many prompts (the rules only check divisibility); the probe generates once a step"),
    ("data.video_fps", (None, 2.0), "frames taken per second of a video: more vision tokens and activations"),
    ("data.min_pixels", (None, 262144), "smallest image size after resizing: vision tokens and activations"),
    ("data.max_pixels", (None, 4194304), "largest image size after resizing: vision tokens and activations"),
    # the worker group
    ("worker.hybrid_engine", (None, True), "actor, rollout and reference colocated on the same GPUs (the only mode EasyR1 runs)"),
    # actor
    ("worker.actor.ppo_epochs", (None, 1), "passes over each rollout batch: more optimizer steps per step"),
    ("worker.actor.padding_free", (None, True), "padding removed in the forwards (varlen flash attention); off pads every sequence"),
    ("worker.actor.use_torch_compile", (None, True, False),
     "torch.compile of the log-prob helper; with flash-attn's cross-entropy (always installed) it is compiler-disabled, so either value runs the probe's kernels"),
    ("worker.actor.model.override_config*", (None, {}), "overrides of the model's config.json: can change its shapes"),
    ("worker.actor.model.freeze_vision_tower", (None, False), "frozen vision tower: no grads or AdamW state for it, use_orig_params forced on"),
    ("worker.actor.model.lora.exclude_modules", (None, ".*visual.*"),
     "modules kept without adapters; the probe excludes only a VL model's vision tower"),
    ("worker.actor.optim.strategy", (None, "adamw"), "optimizer: adamw keeps fp32 states; adamw_bf16 (AnyPrecisionAdamW) keeps bf16 states"),
    ("worker.actor.fsdp.enable_full_shard", (None, True), "FULL_SHARD; false is SHARD_GRAD_OP (each rank keeps whole params after forward)"),
    ("worker.actor.fsdp.enable_rank0_init", (None, True), "rank 0 loads the weights on CPU and broadcasts; false loads a whole model on every GPU"),
    ("worker.actor.fsdp.use_orig_params", (None, False), "FSDP1 use_orig_params: how flat params and their views are held"),
    ("worker.actor.fsdp.torch_dtype", (None, "fp32", "float32"), "dtype of the actor's params (default fp32); bf16 halves params, grads and states"),
    ("worker.actor.fsdp.fsdp_size", (None, -1, 0), "shard group size; below the GPU count it is HSDP (shards over fewer ranks)"),
    ("worker.actor.fsdp.mp_param_dtype", (None, "bf16", "bfloat16"), "FSDP mixed-precision compute dtype (the probe computes in bf16)"),
    ("worker.actor.fsdp.mp_reduce_dtype", (None, "fp32", "float32"), "dtype of the gradient reduce-scatter buffers"),
    ("worker.actor.fsdp.mp_buffer_dtype", (None, "fp32", "float32"), "dtype of the model's buffers"),
    # critic (PPO)
    ("worker.critic.ppo_epochs", (None, 1), "passes over each rollout batch: more critic optimizer steps per step"),
    ("worker.critic.model.override_config*", (None, {}), "overrides of the critic's config.json: can change its shapes"),
    ("worker.critic.model.freeze_vision_tower", (None, False), "frozen vision tower in the critic: no grads or AdamW state for it"),
    ("worker.critic.optim.strategy", (None, "adamw"), "critic optimizer: adamw_bf16 keeps bf16 states"),
    ("worker.critic.fsdp.enable_full_shard", (None, True), "FULL_SHARD for the critic; false is SHARD_GRAD_OP"),
    ("worker.critic.fsdp.enable_rank0_init", (None, True), "rank 0 loads the critic on CPU; false loads it whole on every GPU"),
    ("worker.critic.fsdp.use_orig_params", (None, False), "FSDP1 use_orig_params for the critic"),
    ("worker.critic.fsdp.torch_dtype", (None, "fp32", "float32"), "dtype of the critic's params (default fp32); bf16 changes memory"),
    ("worker.critic.fsdp.fsdp_size", (None, -1, 0), "critic shard group size; below the GPU count it is HSDP"),
    ("worker.critic.fsdp.mp_param_dtype", (None, "bf16", "bfloat16"), "critic compute dtype"),
    ("worker.critic.fsdp.mp_reduce_dtype", (None, "fp32", "float32"), "critic gradient reduce dtype"),
    ("worker.critic.fsdp.mp_buffer_dtype", (None, "fp32", "float32"), "critic buffer dtype"),
    # reference
    ("worker.ref.fsdp.enable_full_shard", (None, True), "FULL_SHARD for the reference; false keeps whole params after forward"),
    ("worker.ref.fsdp.enable_rank0_init", (None, True), "rank 0 loads the reference on CPU; false loads it whole on every GPU"),
    ("worker.ref.fsdp.use_orig_params", (None, False), "FSDP1 use_orig_params for the reference"),
    ("worker.ref.fsdp.torch_dtype", (None, "bf16", "bfloat16"), "dtype of the reference's params (default bf16, as the probe's compute-dtype copy)"),
    ("worker.ref.fsdp.mp_param_dtype", (None, "bf16", "bfloat16"), "reference compute dtype"),
    ("worker.ref.fsdp.mp_reduce_dtype", (None, "fp32", "float32"), "reference reduce dtype (no grads, kept as default)"),
    ("worker.ref.fsdp.mp_buffer_dtype", (None, "fp32", "float32"), "reference buffer dtype"),
    # rollout
    ("worker.rollout.name", (None, "vllm"), "rollout engine (vLLM, as the probe's)"),
    ("worker.rollout.dtype", (None, "bf16", "bfloat16"), "vLLM's weight and compute dtype"),
    ("worker.rollout.limit_images", (None, 0), "vLLM's images per prompt: its multimodal profiling and encoder cache"),
    ("worker.rollout.enforce_eager", (None, False), "no CUDA graphs in vLLM: less graph memory, slower decoding"),
    ("worker.rollout.enable_chunked_prefill", (None, False), "vLLM's chunked prefill: prefill memory and time"),
    ("worker.rollout.max_model_len", (None,), "vLLM's max sequence length; default prompt+response length"),
    # algorithm
    ("algorithm.online_filtering", (None, False), "DAPO group filtering: generates more rounds until the batch fills"),
)

# settings that do not change what a probe measures: (pattern, why)
INERT = (
    # data
    ("data.train_files", "training data path"),
    ("data.val_files", "validation data path"),
    ("data.*_key", "dataset column names"),
    ("data.image_dir", "image folder path"),
    ("data.format_prompt", "prompt template file; prompts stay capped by max_prompt_length"),
    ("data.override_chat_template", "chat template file; prompts stay capped by max_prompt_length"),
    ("data.shuffle", "data order"),
    ("data.seed", "data shuffling seed"),
    ("data.filter_overlong_prompts", "drops prompts over max_prompt_length at load; lengths stay capped"),
    ("data.filter_overlong_prompts_workers", "processes for that filtering at load"),
    # actor
    ("worker.actor.strategy", "never read: the workers are always FSDP"),
    ("worker.actor.max_grad_norm", "gradient clipping threshold: same work either way"),
    ("worker.actor.clip_ratio_*", "PPO clip ratios: loss values only"),
    ("worker.actor.loss_avg_mode", "how the loss is averaged: loss values only"),
    ("worker.actor.loss_type", "policy loss formula (gspo, cispo, sapo): per-token arithmetic, same memory and time"),
    ("worker.actor.tau_*", "SAPO temperatures: loss values only"),
    ("worker.actor.model.tokenizer_path", "tokenizer path (defaults to the model's)"),
    ("worker.actor.model.trust_remote_code", "permission to run the model repo's own code"),
    ("worker.actor.optim.lr", "learning rate: same memory and time per step"),
    ("worker.actor.optim.betas", "AdamW betas: values only"),
    ("worker.actor.optim.weight_decay", "AdamW weight decay: values only"),
    ("worker.actor.optim.lr_*", "learning-rate warmup and schedule"),
    ("worker.actor.optim.min_lr_ratio", "cosine schedule floor"),
    ("worker.actor.optim.training_steps", "auto: set by the trainer from the run length"),
    ("worker.actor.global_batch_size_per_device", "auto: computed by fsdp_workers.py from the global batch"),
    ("worker.actor.disable_kl", "auto: copied from algorithm.disable_kl"),
    ("worker.actor.use_kl_loss", "auto: copied from algorithm.use_kl_loss"),
    ("worker.actor.kl_penalty", "auto: copied from algorithm.kl_penalty"),
    ("worker.actor.kl_coef", "auto: copied from algorithm.kl_coef"),
    # critic
    ("worker.critic.strategy", "never read: the workers are always FSDP"),
    ("worker.critic.max_grad_norm", "critic gradient clipping threshold"),
    ("worker.critic.cliprange_value", "value clip range: loss values only"),
    ("worker.critic.loss_avg_mode", "how the critic loss is averaged"),
    ("worker.critic.model.tokenizer_path", "critic tokenizer path"),
    ("worker.critic.model.trust_remote_code", "permission to run the critic repo's own code"),
    ("worker.critic.model.lora.*", "never read: LoRA applies to the actor only (fsdp_workers.py)"),
    ("worker.critic.optim.lr", "critic learning rate"),
    ("worker.critic.optim.betas", "critic AdamW betas"),
    ("worker.critic.optim.weight_decay", "critic weight decay"),
    ("worker.critic.optim.lr_*", "critic learning-rate warmup and schedule"),
    ("worker.critic.optim.min_lr_ratio", "critic cosine schedule floor"),
    ("worker.critic.optim.training_steps", "auto: set by the trainer from the run length"),
    ("worker.critic.global_batch_size_per_device", "auto: computed by fsdp_workers.py"),
    # reference
    ("worker.ref.strategy", "never read: the workers are always FSDP"),
    ("worker.ref.fsdp.fsdp_size", "never read: the reference uses the actor's device mesh"),
    ("worker.ref.offload.offload_optimizer", "never read: the reference has no optimizer"),
    ("worker.ref.micro_batch_size_per_device_for_experience", "auto: copied from the actor's"),
    ("worker.ref.padding_free", "auto: copied from the actor's"),
    ("worker.ref.dynamic_batching", "auto: copied from the actor's"),
    ("worker.ref.ulysses_size", "auto: copied from the actor's"),
    ("worker.ref.use_torch_compile", "auto: copied from the actor's"),
    # reward
    ("worker.reward.reward_function", "reward function file"),
    ("worker.reward.reward_function_kwargs*", "reward function arguments"),
    ("worker.reward.skip_special_tokens", "decoding option for the reward"),
    ("worker.reward.num_cpus", "CPUs of the reward actor (host side)"),
    ("worker.reward.reward_function_name", "auto: parsed from reward_function"),
    # rollout
    ("worker.rollout.temperature", "sampling temperature (the probe generates to max_response_length)"),
    ("worker.rollout.top_p", "sampling nucleus"),
    ("worker.rollout.top_k", "sampling top-k"),
    ("worker.rollout.seed", "sampling seed"),
    ("worker.rollout.ignore_eos", "stop at EOS or not; the probe generates every response to max length, the worst case"),
    ("worker.rollout.disable_log_stats", "vLLM stats logging"),
    ("worker.rollout.disable_tqdm", "progress bar"),
    ("worker.rollout.val_override_config", "validation sampling overrides: validation runs outside the probed step"),
    ("worker.rollout.prompt_length", "auto: copied from data.max_prompt_length"),
    ("worker.rollout.response_length", "auto: copied from data.max_response_length"),
    ("worker.rollout.trust_remote_code", "auto: copied from the actor's model"),
    # algorithm
    ("algorithm.gamma", "GAE discount: advantage values only"),
    ("algorithm.lam", "GAE lambda: advantage values only"),
    ("algorithm.use_kl_loss", "KL in the loss or in the reward: the same reference log-probs either way"),
    ("algorithm.kl_penalty", "KL estimator on per-token log-probs: values only"),
    ("algorithm.kl_coef", "KL coefficient"),
    ("algorithm.kl_type", "fixed or adaptive KL controller"),
    ("algorithm.kl_horizon", "adaptive KL controller horizon"),
    ("algorithm.kl_target", "adaptive KL controller target"),
    ("algorithm.filter_key", "reward key for online filtering (compared)"),
    ("algorithm.filter_low", "lower reward bound for online filtering (compared)"),
    ("algorithm.filter_high", "upper reward bound for online filtering (compared)"),
    # trainer
    ("trainer.total_epochs", "run length"),
    ("trainer.project_name", "the experiment's project name for logging"),
    ("trainer.experiment_name", "the experiment's name for logging"),
    ("trainer.max_try_make_batch", "cap on generation rounds, only with online filtering (compared)"),
    ("trainer.critic_warmup", "steps that skip the actor update at the start; later steps are the probe's"),
    ("trainer.val_only", "validate and stop, no training"),
    ("trainer.val_generations_to_log", "generations logged from validation"),
    ("trainer.save_limit", "checkpoints kept"),
    ("trainer.load_checkpoint_path", "checkpoint to resume from"),
    ("trainer.ray_timeline", "file for Ray's timeline"),
)


KEY_CLASSES = KeyClasses(source="EasyR1 b44b311: its config dataclasses (verl/trainer/config.py and the workers')", checked=CHECKED,
                         compared=tuple(Compared(*rule) for rule in COMPARED), inert=INERT)
