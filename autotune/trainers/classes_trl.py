"""trl config keys outside autotune's knob tables, classified (source: GRPOConfig + ModelConfig fields of trl 1.16.0 over transformers 5.24.0 TrainingArguments)."""

from __future__ import annotations

from typing import Any

from autotune.trainers.key_classes import Compared, KeyClasses

# keys the adapter's own code already reads and compares (grep the key string in
# autotune/trainers/trl.py, export_plan.py, measured.py, adapter.py): (pattern, where)
CHECKED = (
    ("eval_strategy", "trl.py _trl_rules reads it (eval batch rule); _trl_short_run writes it"),
    ("per_device_eval_batch_size", "trl.py _trl_rules: global eval batch divisible by the eval generations"),
    ("num_generations_eval", "trl.py _trl_rules: global eval batch divisible by the eval generations"),
    ("eval_steps", "trl.py _trl_short_run writes it (validate) over the base's"),
    ("max_steps", "trl.py _trl_short_run writes the probe's step count"),
    ("save_strategy", "trl.py _trl_short_run writes no"),
    ("report_to", "trl.py _trl_short_run writes none"),
    ("logging_steps", "trl.py _trl_short_run writes 1"),
    ("disable_tqdm", "trl.py _trl_short_run writes true"),
    ("push_to_hub", "trl.py _trl_short_run writes false"),
    ("output_dir", "trl.py _trl_short_run writes the trial's output folder"),
)

# settings that change the probe's memory or time: (pattern, values the probe's run equals, why)
# A base value not in `values` is refused (or stated with --force). None = the key unset/null
# (the trainer's default): list None only when the trainer's default is what the probe runs.
COMPARED: tuple[tuple[Any, ...], ...] = (
    # precision and model loading
    ("bf16", (True, None), "bf16 autocast over fp32 weights, as probed (None resolves to not fp16: true)", (False,)),
    ("fp16", (False, None), "fp16 mixed precision with a grad scaler: another compute dtype than the probe's bf16"),
    ("tf32", (True, None), "TF32 matmuls for fp32 ops: on by default with bf16; off slows fp32 matmuls", (True, False, None)),
    ("dtype", ("float32", None), "ModelConfig's load dtype: fp32 master weights as probed; bf16/auto halves them"),
    ("model_init_kwargs", (None, {"dtype": "float32"}, {"torch_dtype": "float32"}), "from_pretrained kwargs (dtype, attention, quantization, kernels) no probe ran"),
    ("attn_implementation", (None, "sdpa"), "attention kernel: the probe's models run sdpa (transformers' default)"),
    ("trust_remote_code", (False, None), "custom modeling code from the Hub: another implementation than the probe's"),
    ("cast_lm_head_to_fp32", (False, None), "fp32 LM head for policy and reference: more weight and logits memory"),
    ("load_in_8bit", (False, None), "8-bit bitsandbytes weights: memory and step time no probe measured"),
    ("load_in_4bit", (False, None), "4-bit bitsandbytes weights: memory and step time no probe measured"),
    ("bnb_4bit_quant_type", ("nf4", None), "4-bit quantization type (with load_in_4bit): held at its default"),
    ("use_bnb_nested_quant", (False, None), "double quantization of 4-bit weights: other memory and time"),
    ("bnb_4bit_quant_storage", (None,), "storage dtype of 4-bit weights: other memory"),
    # LoRA beyond the knobs
    ("use_dora", (False, None), "DoRA adds a magnitude vector and a weight-norm pass per layer: more memory and time"),
    ("lora_modules_to_save", (None,), "fully trained module copies (embeddings, head): more weights, grads, states"),
    ("lora_target_parameters", (None,), "LoRA on parameters (MoE experts) beyond lora_target_modules: more adapters"),
    ("lora_task_type", ("CAUSAL_LM", None), "PEFT model wrapper type: the probe wraps a causal LM"),
    # kernels, compilation, checkpointing
    ("torch_compile", (False, None), "torch.compile: compilation time and other kernels"),
    ("torch_compile_backend", (None,), "any value turns torch_compile on"),
    ("torch_compile_mode", (None,), "any value turns torch_compile on"),
    ("liger_kernel_config", (None,), "Liger kernel selection: fused kernels no probe ran"),
    ("activation_checkpointing", (None,), "new name of gradient_checkpointing: set, it overrides the knob's key"),
    ("activation_checkpointing_kwargs", (None,), "checkpointing options (every_n_layers, reentrant): other activation memory"),
    ("gradient_checkpointing_kwargs", (None,), "checkpointing options (reentrant, every_n_layers): other activation memory and recompute"),
    ("use_cache", (False, None), "KV cache in training forwards: holds keys and values the probe did not"),
    ("neftune_noise_alpha", (None,), "NEFTune embedding noise hook: an extra op per forward"),
    ("torch_empty_cache_steps", (None,), "periodic empty_cache: slower steps, other allocator peaks"),
    ("full_determinism", (False, None), "deterministic algorithms: slower kernels than probed"),
    ("debug", ("", None), "debug hooks (underflow_overflow) add work per forward"),
    ("skip_memory_metrics", (True, None), "false runs the memory tracker, which resets peak-memory stats each stage"),
    # optimizer beyond the optim knob
    ("optim_args", (None,), "extra optimizer arguments: other states or kernels than the probed AdamW"),
    ("optim_target_modules", (None,), "GaLore/APOLLO-style optimizer targets: other optimizer states"),
    # batches and sharding
    ("auto_find_batch_size", (False, None), "shrinks the batch on OOM: another micro-batch than the knob's"),
    ("accelerator_config", (None,), "accelerate options (split_batches, dispatch_batches): other per-process batches"),
    ("parallelism_config", (None,), "TP/CP/SP/DP sizes: another sharding than the probe's full FSDP sharding"),
    ("fsdp", (None, ""), "FSDP set here (version, offload, auto_wrap) instead of accelerate's config, not probed"),
    ("fsdp_config", (None,), "FSDP options (version, offload, wrap, activation checkpointing) not probed"),
    ("deepspeed", (None,), "DeepSpeed ZeRO instead of the probe's FSDP: other sharding and memory"),
    ("ds3_gather_for_generation", (True, None), "ZeRO-3 weight gather for generation (the default); off: slower generation"),
    ("use_cpu", (False, None), "training on CPU", (True, False, None)),
    ("pad_to_multiple_of", ("auto", None), "pads prompts and completions to a multiple (auto: only on Neuron): longer sequences"),
    ("router_aux_loss_coef", (None,), "MoE load-balancing loss: router logits returned per forward (None: the model's own)"),
    ("disable_dropout", (False, None), "removes model dropout: other masks and time than probed"),
    # generation
    ("generation_kwargs", (None,), "extra generation settings (beams, max_new_tokens): other rollout memory and time"),
    ("cache_implementation", (None,), "KV-cache kind for transformers generation (static, offloaded): other memory"),
    ("use_transformers_continuous_batching", (False, None), "transformers' paged continuous-batching generation: another engine"),
    ("transformers_continuous_batching_config", (None,), "continuous-batching engine sizes (blocks, batch): other memory"),
    ("use_transformers_paged", (False, None), "deprecated alias of use_transformers_continuous_batching"),
    ("vllm_model_impl", ("vllm", None), "vLLM's model implementation: transformers backend runs other kernels"),
    ("vllm_max_model_length", (None,), "vLLM context window: other engine profile and cache sizing"),
    ("vllm_structured_outputs_regex", (None,), "guided decoding in vLLM: slower generation"),
    ("vllm_importance_sampling_correction", (True, None), "with vLLM it forces an old log-prob forward each generation (default on)"),
    ("max_tool_calling_iterations", (None,), "multi-turn tool calls: more generation rounds than the probe's one"),
    # loss terms that add work
    ("sync_ref_model", (False, None), "TR-DPO reference sync: a weight mix-up every ref_model_sync_steps"),
    ("entropy_coef", (0.0, 0, None), "entropy bonus: gradient through the entropy, other backward memory and time"),
    ("use_adaptive_entropy", (False, None), "adaptive entropy bonus: entropy in the loss, as entropy_coef"),
)

# settings that do not change what a probe measures (paths, logging, learning rates, seeds,
# schedules, reward functions, validation, checkpoint saving): (pattern, why)
INERT = (
    # run length, learning rate, optimizer hyperparameters
    ("num_train_epochs", "run length: same memory and time per step"),
    ("learning_rate", "learning rate: same memory and time per step"),
    ("lr_scheduler_*", "learning-rate schedule: same memory and time per step"),
    ("warmup_steps", "learning-rate warmup: same memory and time per step"),
    ("weight_decay", "AdamW hyperparameter: same states and time"),
    ("adam_*", "AdamW betas and epsilon: same states and time"),
    ("max_grad_norm", "gradient clipping threshold: same memory and time"),
    ("label_smoothing_factor", "not used by GRPO's loss"),
    ("average_tokens_across_devices", "loss normalization by a token-count all-reduce: negligible"),
    # mixed-precision eval only
    ("bf16_full_eval", "evaluation precision only"),
    ("fp16_full_eval", "evaluation precision only"),
    # logging and tracking
    ("logging_strategy", "logging cadence"),
    ("logging_first_step", "logging cadence"),
    ("log_on_each_node", "logging"),
    ("logging_nan_inf_filter", "logging filter for nan/inf losses"),
    ("include_num_input_tokens_seen", "logging counter of tokens seen"),
    ("log_level", "logging verbosity"),
    ("log_level_replica", "logging verbosity"),
    ("run_name", "the run's name for logging"),
    ("project", "the tracker project's name"),
    ("trackio_*", "trackio tracker settings"),
    ("log_completions", "logs a sample of completions"),
    ("log_multimodal", "logging of images with completions"),
    ("num_completions_to_print", "logging of completions"),
    ("log_unique_prompts", "logging of prompts"),
    ("log_completions_hub_repo", "hub repository for logged completions"),
    # evaluation
    ("eval_delay", "evaluation schedule"),
    ("prediction_loss_only", "evaluation outputs"),
    ("eval_on_start", "evaluation schedule"),
    ("eval_do_concat_batches", "evaluation outputs"),
    ("eval_use_gather_object", "evaluation outputs"),
    ("eval_accumulation_steps", "evaluation outputs"),
    ("include_for_metrics", "evaluation metrics inputs"),
    ("batch_eval_metrics", "evaluation metrics"),
    ("load_best_model_at_end", "checkpoint selection by eval metric"),
    ("metric_for_best_model", "checkpoint selection by eval metric"),
    ("greater_is_better", "checkpoint selection by eval metric"),
    ("do_train", "script flag"),
    ("do_eval", "script flag (eval_strategy decides evaluation)"),
    ("do_predict", "script flag"),
    # saving, hub, resuming
    ("save_only_model", "checkpoint saving"),
    ("save_steps", "checkpoint saving"),
    ("save_on_each_node", "checkpoint saving"),
    ("save_total_limit", "checkpoint saving"),
    ("enable_jit_checkpoint", "checkpoint on SIGTERM only"),
    ("hub_*", "hub upload settings"),
    ("resume_from_checkpoint", "where to resume from"),
    ("ignore_data_skip", "data skipping when resuming"),
    ("restore_callback_states_from_checkpoint", "callback state when resuming"),
    # seeds, data, launcher
    ("seed", "random seed"),
    ("data_seed", "data sampler seed"),
    ("shuffle_dataset", "prompt order"),
    ("dataloader_*", "prompt loading on the host: negligible next to the step"),
    ("remove_unused_columns", "dataset columns kept"),
    ("label_names", "dataset label columns"),
    ("train_sampling_strategy", "sampler choice; GRPO uses its own repeat sampler"),
    ("length_column_name", "dataset column name"),
    ("local_rank", "set by the launcher"),
    ("ddp_find_unused_parameters", "DDP only: ignored under the FSDP sharding compared elsewhere"),
    ("ddp_bucket_cap_mb", "DDP only: ignored under the FSDP sharding compared elsewhere"),
    ("ddp_broadcast_buffers", "DDP only: ignored under the FSDP sharding compared elsewhere"),
    ("ddp_static_graph", "DDP only: ignored under the FSDP sharding compared elsewhere"),
    ("ddp_backend", "collective backend (nccl on GPUs)"),
    ("ddp_timeout", "collective timeout"),
    ("model_revision", "the checkpoint's revision: same architecture"),
    ("use_rslora", "LoRA scaling rule: same adapters, memory and time"),
    # sampling and prompts
    ("temperature", "sampling temperature: lengths are bounded by max_completion_length"),
    ("top_p", "sampling filter"),
    ("top_k", "sampling filter"),
    ("min_p", "sampling filter"),
    ("repetition_penalty", "sampling penalty"),
    ("chat_template_kwargs", "prompt templating; the prompt length is the header's prompt line"),
    # vLLM server mode's connection (vllm_mode is the placement knob's key) and IS details
    ("vllm_server_*", "server-mode connection settings"),
    ("vllm_group_port", "server-mode weight-sync port"),
    ("vllm_importance_sampling_mode", "how IS ratios are applied: elementwise"),
    ("vllm_importance_sampling_clip_*", "IS ratio bounds: elementwise"),
    ("vllm_importance_sampling_cap", "deprecated alias of the IS upper bound"),
    # loss and reward arithmetic
    ("epsilon", "clipping bound"),
    ("epsilon_high", "clipping bound"),
    ("delta", "two-sided clipping bound"),
    ("sapo_*", "SAPO loss temperatures"),
    ("vespo_*", "VESPO loss parameters"),
    ("importance_sampling_level", "token or sequence ratios: elementwise"),
    ("loss_type", "loss aggregation: elementwise over the same log-probs"),
    ("reward_weights", "reward weighting"),
    ("multi_objective_aggregation", "reward aggregation"),
    ("scale_rewards", "advantage scaling"),
    ("mask_truncated_completions", "loss mask for truncated completions"),
    ("ref_model_mixup_alpha", "TR-DPO mix (sync_ref_model compared)"),
    ("ref_model_sync_steps", "TR-DPO cadence (sync_ref_model compared)"),
    ("top_entropy_quantile", "entropy mask; entropy is computed every step anyway"),
    ("entropy_coef_min", "adaptive entropy bounds (use_adaptive_entropy compared)"),
    ("entropy_coef_max", "adaptive entropy bounds (use_adaptive_entropy compared)"),
    ("entropy_coef_delta", "adaptive entropy step (use_adaptive_entropy compared)"),
    ("entropy_target", "adaptive entropy target (use_adaptive_entropy compared)"),
    ("off_policy_mask_threshold", "off-policy sequence mask over log-probs already computed"),
    ("use_bias_correction_kl", "KL term times the IS ratio: elementwise"),
)


KEY_CLASSES = KeyClasses(source='TRL 1.16: GRPOConfig and ModelConfig fields', checked=CHECKED,
                         compared=tuple(Compared(*rule) for rule in COMPARED), inert=INERT)
