"""TRL's GRPOTrainer: GRPOConfig's fields and the rules of its __post_init__.

TRL counts per process: per_device_train_batch_size and gradient_accumulation_steps make the
optimizer step, generation_batch_size the rollout; autotune derives them from the global
batches and the number of processes. GRPOConfig has no setting that turns the micro-batch into
a token budget (no dynamic batching), so no setting is forced here.
"""

from __future__ import annotations

from collections.abc import Collection

from autotune.config import VLLM_ENGINES, Knobs, ProbeConfig, Topology
from autotune.trainers.adapter import (
    Adapter,
    Derived,
    Getter,
    SeparateLaunch,
    Setting,
    TrainerKeys,
    module_names,
)
from autotune.trainers.classes_trl import KEY_CLASSES


def _trl_rules(config: ProbeConfig, topo: Topology, get: Getter) -> list[str]:
    """trl/trainer/grpo_config.py GRPOConfig.__post_init__, with generation_batch_size set."""
    world, n, mbu = topo.world_size, config.rollout_n, config.micro_batch_size_update
    per_step, per_generation = mbu * world, config.rollout_batch_size * n
    gbs = config.global_batch_size
    problems = []
    if config.entropy_coeff:
        problems.append(f"entropy_coeff={config.entropy_coeff}: autotune does not write TRL's "
                        "entropy_coef (its bonus, normalised per loss type) yet: probe with "
                        "entropy_coeff=0")
    if config.fused_logprob and config.fused_logprob_kernel != "trl":
        problems.append(f"fused_logprob_kernel={config.fused_logprob_kernel}: verl's kernel, "
                        "which TRL does not have (TRL 1.x scores through its own fused LM "
                        "head): probe with fused_logprob_kernel=trl")
    if n < 2:
        problems.append(f"GRPO requires at least 2 generations per prompt (num_generations={n})")
    if (gbs * n) % per_step:
        problems.append(f"global_batch_size*rollout_n={gbs * n} completions "
                        f"per optimizer step must be divisible by per_device_train_batch_size="
                        f"{mbu} x {world} processes (gradient_accumulation_steps is their ratio)")
    if per_generation % per_step:
        problems.append(f"generation_batch_size ({per_generation}) must be divisible by the "
                        f"global batch size ({per_step})")
    if per_generation % n:
        problems.append(f"generation_batch_size ({per_generation}) must be divisible by "
                        f"num_generations ({n})")
    if get("eval_strategy", "no") != "no":  # TrainingArguments: then do_eval is true
        eval_batch = get("per_device_eval_batch_size", 8)
        generations = get("num_generations_eval", 0) or n
        if (eval_batch * world) % generations:
            problems.append(f"the global eval batch size ({eval_batch} * {world}) must be "
                            f"divisible by the number of generations used for evaluation "
                            f"({generations}): set per_device_eval_batch_size or "
                            "num_generations_eval in your base config")
    if config.dynamic_batching:
        problems.append("dynamic_batching=true: TRL's GRPOConfig has no token budgets (its "
                        "micro-batch is per_device_train_batch_size completions); sweep with "
                        "dynamic_batching=false for TRL")
    for knob, on in (("offload_params", config.offload_params),
                     ("offload_optimizer", config.offload_optimizer),
                     ("offload_ref_params", config.offload_ref_params)):
        if on and not (knob == "offload_ref_params" and config.offload_params):
            problems.append(f"{knob}=true has no GRPOConfig key (offload is your accelerate "
                            f"DeepSpeed/FSDP config's): re-run the sweep with --set {knob}="
                            "false to hold it off for TRL")
    if config.ulysses_sequence_parallel_size > 1:
        problems.append(f"ulysses_sequence_parallel_size={config.ulysses_sequence_parallel_size}: "
                        "GRPOTrainer does not support sequence-dim parallelism (TRL's "
                        "grpo_config.py refuses parallelism_config sp_size or cp_size > 1): "
                        "sweep with ulysses_sequence_parallel_size=1 for TRL")
    if config.rollout_tensor_parallel > 1 and not config.engine_reserves:
        problems.append(f"rollout_tensor_parallel={config.rollout_tensor_parallel}: TRL generates "
                        "with the trained model on each process here (no engine to split); "
                        "sweep with rollout_tensor_parallel=1 for TRL")
    if config.separate:
        problems += _trl_server_rules(config, topo)
    return problems


def _trl_server_rules(config: ProbeConfig, topo: Topology) -> list[str]:
    """vllm_mode=server (trl/generation/vllm_generation.py, trl/scripts/vllm_serve.py, TRL
    1.16): one `trl vllm-serve` the trainer's main process talks to, whose data-parallel size
    stays 1 for dense models (its help: vLLM PR #30739), so one engine spans the engine's
    GPUs; GRPOTrainer syncs the weights before each generation (no step off policy:
    AsyncGRPOTrainer, trl.experimental, is another trainer, which autotune does not write)."""
    problems = []
    tp, gpus = config.rollout_tensor_parallel, config.rollout_gpus
    if tp != gpus:
        problems.append(f"rollout_tensor_parallel={tp} with rollout_gpus={gpus}: TRL's server "
                        f"mode runs one `trl vllm-serve` (data_parallel_size 1 for dense "
                        f"models), one engine over the engine's GPUs: probe with "
                        f"rollout_tensor_parallel={gpus}")
    if config.staleness:
        problems.append(f"staleness={config.staleness}: GRPOTrainer's server mode syncs the "
                        "weights before each generation (staleness 0); its asynchronous "
                        "trainer (trl.experimental AsyncGRPOTrainer) is not written by "
                        "autotune: probe with staleness=0 for TRL")
    return problems


def _trl_separate_launch(config: ProbeConfig, run: Topology, trainers: Topology,
                         model: str | None) -> SeparateLaunch:
    """How to start each side on one node (TRL's vLLM integration docs: the server and the
    trainer on different CUDA devices): `trl vllm-serve` on the first rollout_gpus GPUs with
    the study's engine settings (its flags: trl/scripts/vllm_serve.py ScriptArguments), then
    `accelerate launch` on the rest; several nodes are refused."""
    if run.nnodes > 1:
        return SeparateLaunch(problems=(
            "placement=separate on several nodes: autotune writes TRL's server mode for one "
            "node (the server and `accelerate launch` on its GPUs)",))
    engine = ",".join(str(gpu) for gpu in range(config.rollout_gpus))
    trainer = ",".join(str(gpu) for gpu in range(config.rollout_gpus, run.gpus_per_node))
    return SeparateLaunch(lines=(
            f"placement: separate, the engine on GPUs {engine}, the trainer on {trainer} "
            f"({trainers.world_size} processes); start the server first:",
            f"  CUDA_VISIBLE_DEVICES={engine} trl vllm-serve --model {model or '<your model>'} "
            f"--tensor_parallel_size {config.rollout_tensor_parallel} "
            f"--gpu_memory_utilization {config.gpu_memory_utilization} "
            f"--max_model_len {config.sequence_length}",
            f"  then: CUDA_VISIBLE_DEVICES={trainer} accelerate launch --num_processes "
            f"{trainers.world_size} your_grpo_script.py --config <this file>",
            "the vllm_* engine keys in this file are TRL's colocate mode's, which its server "
            "mode does not read: written as the study's engine ran, the serve line above "
            "gives the server its own"))


def _trl_batches(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    """The whole-run batches as GRPOConfig's per-process keys; the generation batch set
    directly, so steps_per_generation (exclusive with it) is cleared."""
    return {"gradient_accumulation_steps": _trl_accumulation(config, topo),
            "generation_batch_size": config.rollout_batch_size * config.rollout_n,
            "steps_per_generation": None}


def _trl_accumulation(config: ProbeConfig, topo: Topology) -> int:
    """gradient_accumulation_steps: one optimizer step's completions over the processes'
    per_device_train_batch_size."""
    per_step = config.micro_batch_size_update * topo.world_size
    return config.global_batch_size * config.rollout_n // per_step


def _trl_share(config: ProbeConfig, topo: Topology) -> dict[str, int]:
    """GRPOTrainer: each process generates generation_batch_size / processes completions and
    steps the optimizer every per_device_train_batch_size x gradient_accumulation_steps."""
    return {"responses_per_step": config.rollout_batch_size * config.rollout_n
            // topo.world_size,
            "responses_per_minibatch": config.micro_batch_size_update
            * _trl_accumulation(config, topo)}


def _trl_read_batches(get: Getter, topo: Topology) -> Knobs:
    """GRPOConfig.__post_init__: the generation batch is generation_batch_size, else
    per_device_train_batch_size x processes x steps_per_generation (which defaults to
    gradient_accumulation_steps)."""
    n, mbu = get("num_generations", 8), get("per_device_train_batch_size", 8)
    accumulation = get("gradient_accumulation_steps", 1)
    steps = get("steps_per_generation", None) or accumulation
    generation = get("generation_batch_size", None) or mbu * topo.world_size * steps
    return {"global_batch_size": mbu * topo.world_size * accumulation // n,
            "rollout_batch_size": generation // n}


def _trl_engine(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    """vllm (and vllm-like) stand for TRL's colocated vLLM (vllm_mode colocate: the engine on the
    training GPUs, split over vllm_tensor_parallel_size); hf for generation by the trained
    model (TRL's default: policy; hf stands for it with a copy of the weights)."""
    if not config.engine_reserves:  # policy (hf: an engine copy TRL lacks)
        return {"use_vllm": False}
    return {"use_vllm": True, "vllm_mode": "server" if config.separate else "colocate",
            "vllm_tensor_parallel_size": config.rollout_tensor_parallel}


def _trl_old_pass(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    """num_iterations 2 where the pass is asked for and one optimizer step takes the whole
    generation (TRL would skip it at 1), else TRL's default 1 (config/rules.py refuses the pass
    off where the generation feeds several steps)."""
    one_step = config.rollout_batch_size == config.global_batch_size
    return {"num_iterations": 2 if config.old_logprob_pass and one_step else 1}


def _trl_read_old_pass(get: Getter, topo: Topology) -> Knobs:
    return {"old_logprob_pass": True if get("num_iterations", 1) > 1 else None}


def _trl_optim(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    return {"optim": "adamw_torch_fused" if config.fused_optimizer else "adamw_torch"}


PROBED_OPTIMS = ("adamw_torch", "adamw_torch_fused")  # the AdamW steps a probe runs

# The keys of GRPOConfig and ModelConfig besides TRL's knob table (TRL.keys, below) that
# change what runs: each holds the value the probe ran, or is refused (--force writes the
# value, and the header says so). The model it names is compared with the study's.
TRL_SETTINGS = (
    Setting("optim", "adamw_torch", "the probe steps torch's AdamW with fp32 states "
            "(fused_optimizer picks its kernel); another optimizer holds other states, which "
            "no probe measured", ok=lambda value: value in PROBED_OPTIMS, default_ok=True,
            refuse=True),
    # trl/trainer/grpo_trainer.py: Liger's fused GRPO loss (its own chunked logits), which
    # no probe ran
    Setting("use_liger_kernel", False, "Liger's fused GRPO loss computes the logits in chunks "
            "of its own, a logits path no probe ran", ok=lambda value: value is False,
            default_ok=True, refuse=True),
    # trl/trainer/model_config.py: lora_dropout defaults to 0.05, and peft's LoRA layer then
    # keeps a dropped copy of each adapted module's input for the backward; the probe's LoRA
    # runs dropout 0 (identity). Read only where the run has LoRA.
    Setting("lora_dropout", 0.0, "the probe's LoRA runs dropout 0; with TRL's default, 0.05, "
            "each adapted module keeps a dropped copy of its input, which no probe held",
            ok=lambda value: not isinstance(value, bool) and value == 0, default_ok=False,
            refuse=True, applies=lambda config: config.uses_lora),
)


def _trl_read_optim(get: Getter, topo: Topology) -> Knobs:
    """Another optimizer (8-bit, paged, Adafactor) is refused by the `optim` setting below."""
    return {"fused_optimizer": get("optim", "adamw_torch_fused") == "adamw_torch_fused"}


def _trl_lora(config: ProbeConfig, topo: Topology) -> TrainerKeys:
    """ModelConfig's peft switch and rank (trl/trainer/model_config.py): use_peft builds a
    LoraConfig of lora_r, lora_alpha and lora_target_modules (get_peft_config)."""
    if not config.uses_lora:  # TRL's default, written (as null: off) only over a base's
        return {"use_peft": None}  # true, since a script may parse GRPOConfig alone
    return {"use_peft": True, "lora_r": config.lora_rank}


def _trl_read_lora(get: Getter, topo: Topology) -> Knobs:
    return {"lora_rank": get("lora_r", 16) if get("use_peft", False) else 0}


def _trl_read_engine(get: Getter, topo: Topology) -> Knobs:
    if not get("use_vllm", False):
        return {"rollout_engine": "policy", "rollout_tensor_parallel": 1,
                "placement": "colocated"}
    mode = get("vllm_mode", "colocate")  # server: vLLM on GPUs of its own
    return {"rollout_engine": "vllm-like" if mode in ("colocate", "server")
            else f"vllm_mode={mode}",
            "rollout_tensor_parallel": get("vllm_tensor_parallel_size", 1),
            "placement": "separate" if mode == "server" else "colocated"}


def _trl_unheld(config: ProbeConfig, topo: Topology, recorded: Collection[str]
                ) -> list[str]:
    """What GRPOConfig has no key for: the prompt length, how it scores log-probs and
    generates, the allocator, the FSDP version, and its colocated vLLM's own settings (each
    only where the study recorded the knobs it reads)."""
    lines = [f"prompts: GRPOConfig (TRL 1.x) has no prompt length; the study probed prompts "
             f"of {config.max_prompt_length} tokens: keep your data set's prompts within that"]
    if not config.fused_logprob:
        lines.append("log-probs: the probe took them from the whole logits; TRL 1.x scores "
                     "through its fused LM head (vocabulary chunks of 32,768, every position's "
                     "entropy beside): probe with fused_logprob=true, fused_logprob_kernel=trl "
                     "(the --trainer trl default) to measure what it holds")
    mbu, mbe = config.micro_batch_size_update, config.micro_batch_size_experience
    kl = "use_kl" in recorded and config.use_kl
    if (kl or config.runs_old_logprob_pass) and "micro_batch_size_experience" in recorded \
            and mbe != mbu:
        lines.append(f"log-prob micro-batch: the study took its old and reference log-probs "
                     f"{mbe} sequences at a time; GRPOTrainer takes them "
                     f"per_device_train_batch_size ({mbu}) at a time, so its experience phase "
                     f"holds {'more' if mbu > mbe else 'less'} than measured (a --trainer trl "
                     "sweep probes them equal)")
    if "rollout_engine" in recorded and not config.engine_reserves \
            and not config.actor_generates:  # hf: an engine copy
        lines.append("generation: the probe generated with an engine copy of the weights "
                     "(rollout_engine=hf); TRL generates with the trained model itself, so its "
                     "rollout holds that copy less than measured")
    if config.expandable_segments:
        lines.append("allocator: the study trained with the CUDA allocator's expandable "
                     "segments; GRPOConfig has no key: launch with PYTORCH_CUDA_ALLOC_CONF="
                     "expandable_segments:True, or the training phases may hold more than "
                     "measured")
    if topo.world_size > 1 and "fsdp_strategy" in recorded:
        version = {"fsdp": 1, "fsdp2": 2}[config.fsdp_strategy]
        lines.append(f"sharding: the study's ranks ran FSDP{version} "
                     f"(fsdp_strategy={config.fsdp_strategy}); this file does not set "
                     f"TrainingArguments' fsdp: shard with FSDP version {version} (accelerate's "
                     f"fsdp_version: {version}, or fsdp_config: {{version: {version}}}) to run "
                     "as probed")
    if kl:
        lines.insert(0, "reference model: held by the probe; GRPOTrainer builds one when beta "
                        "!= 0 (0.04, its default before TRL 0.19, is written where your config "
                        "has none)")
    return lines + _trl_engine_lines(config, topo, recorded)


def _trl_engine_lines(config: ProbeConfig, topo: Topology, recorded: Collection[str]
                      ) -> list[str]:
    """Where the study's engine ran otherwise than TRL's colocated vLLM
    (trl/generation/vllm_generation.py), which always prefills 4,096 tokens, sleeps at level
    2, and runs per_device_train_batch_size x vllm_tensor_parallel_size x
    steps_per_generation sequences at once."""
    if not config.engine_reserves:
        return []
    if config.separate:  # trl vllm-serve has no flag for them: the server's vLLM defaults
        ran = [f"{knob}={getattr(config, knob)}" for knob in ("max_num_seqs",
                                                               "max_num_batched_tokens")
               if knob in recorded]
        return [f"rollout: `trl vllm-serve` has no flag for {' or '.join(ran)}, which the "
                "study's engine ran: the server runs its vLLM's own"] if ran else []
    mbu = config.micro_batch_size_update
    steps = config.rollout_batch_size * config.rollout_n // (mbu * topo.world_size)
    trl = [("max_num_batched_tokens", 4096, config.max_num_batched_tokens),
           ("max_num_seqs", mbu * config.rollout_tensor_parallel * steps, config.max_num_seqs),
           *([("sleep_level", 2, config.sleep_level)]
             if "enable_sleep" in recorded and config.enable_sleep else [])]
    return [f"rollout: TRL's colocated vLLM runs {knob}={value} (no GRPOConfig key); the "
            f"study's engine ran {ran}" for knob, value, ran in trl
            if knob in recorded and ran != value]


def _trl_short_run(steps: int, validate: bool, trial_dir: str) -> TrainerKeys:
    """transformers' TrainingArguments: stop after `steps` optimizer steps, save nothing,
    log every step as a dict on the console (PrinterCallback, with the progress bar off)."""
    evaluation = {"eval_strategy": "steps", "eval_steps": steps} if validate else \
        {"eval_strategy": "no"}
    return {"max_steps": steps, "save_strategy": "no", "report_to": "none",
            "logging_steps": 1, "disable_tqdm": True, "push_to_hub": False,
            "output_dir": f"{trial_dir}/output", **evaluation}


TRL = Adapter(
    key_classes=KEY_CLASSES,
    name="trl",
    keys={"micro_batch_size_update": ("per_device_train_batch_size",),
          "rollout_n": ("num_generations",),
          "gradient_checkpointing": ("gradient_checkpointing",),
          "max_response_length": ("max_completion_length",),
          # the colocated vLLM (vllm-like studies only: measured_knobs drops them for hf)
          "gpu_memory_utilization": ("vllm_gpu_memory_utilization",),
          "enable_sleep": ("vllm_enable_sleep_mode",),
          "lora_alpha": ("lora_alpha",)},  # ModelConfig's (with use_peft)
    topology_keys=None,  # the process count comes from `accelerate launch`
    companions={},
    rules=_trl_rules,
    launch="accelerate launch --num_processes {world} your_grpo_script.py --config {path}",
    derived=(
        Derived(("global_batch_size", "rollout_batch_size"), _trl_batches, _trl_read_batches,
                ("generation_batch_size", "steps_per_generation",
                 "gradient_accumulation_steps")),
        # GRPOTrainer builds a reference model when beta != 0 (0.0 by default since TRL
        # 0.19); 0.04 was its default before
        Derived(("use_kl",), lambda config, topo: {"beta": 0.04 if config.use_kl else 0.0},
                lambda get, topo: {"use_kl": get("beta", 0.0) != 0}, ("beta",)),
        Derived(("rollout_engine", "rollout_tensor_parallel", "placement"), _trl_engine,
                _trl_read_engine, ("use_vllm", "vllm_mode", "vllm_tensor_parallel_size")),
        # GRPOTrainer takes the old log-probs in a forward of their own only when a
        # generation is used more than once: num_iterations > 1, or a generation batch that
        # feeds several optimizer steps (old_logprob_pass none: the batches decide)
        Derived(("old_logprob_pass",), _trl_old_pass, _trl_read_old_pass, ("num_iterations",)),
        # transformers' TrainingArguments.optim: adamw_torch_fused by default (torch >= 2.8)
        Derived(("fused_optimizer",), _trl_optim, _trl_read_optim, ("optim",)),
        Derived(("lora_rank",), _trl_lora, _trl_read_lora, ("use_peft", "lora_r")),
        # ModelConfig.lora_target_modules: a list (one item, all-linear, read as the string)
        Derived(("lora_target_modules",), lambda config, topo: {
            "lora_target_modules": config.lora_target_modules.split(",")},
            lambda get, topo: module_names(get("lora_target_modules", None)),
            ("lora_target_modules",)),
    ),
    defaults={"micro_batch_size_update": 8, "gradient_checkpointing": True,  # GRPOConfig
              "use_kl": False, "rollout_engine": "policy", "rollout_tensor_parallel": 1,
              "old_logprob_pass": None, "fused_logprob": True, "fused_logprob_kernel": "trl",
              "fused_optimizer": True},
    share=_trl_share,
    short_run=_trl_short_run,
    # one generation feeds rollout_batch_size / global_batch_size optimizer steps, each logged
    steps_per_rollout=lambda config: max(1, config.rollout_batch_size
                                         // config.global_batch_size),
    engines=("policy", "hf", *VLLM_ENGINES),
    settings=TRL_SETTINGS,
    # ModelConfig's (TrlParser reads GRPOConfig and ModelConfig from one file): a base that
    # names a model is compared with the study's; a file without one says to load it
    model_key="model_name_or_path",
    writes_model=False,
    unheld=_trl_unheld,
    # GRPOTrainer scores old and reference log-probs per_device_train_batch_size at a time
    ties=lambda config: {"micro_batch_size_experience": config.micro_batch_size_update},
    separate_launch=_trl_separate_launch,
)
