"""TRL's GRPOTrainer: GRPOConfig's fields and the rules of its __post_init__.

TRL counts per process: per_device_train_batch_size and gradient_accumulation_steps make the
optimizer step, generation_batch_size the rollout; autotune derives them from the global
batches and the number of processes. GRPOConfig has no setting that turns the micro-batch into
a token budget (no dynamic batching), so no setting is forced here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autotune.config import Topology
from autotune.trainers.adapter import Adapter


def _trl_rules(k: dict[str, Any], topo: Topology, get: Callable[[str, Any], Any]) -> list[str]:
    """trl/trainer/grpo_config.py GRPOConfig.__post_init__, with generation_batch_size set."""
    world, n, mbu = topo.world_size, k["rollout_n"], k["micro_batch_size_update"]
    per_step, per_generation = mbu * world, k["rollout_batch_size"] * n
    problems = []
    if n < 2:
        problems.append(f"GRPO requires at least 2 generations per prompt (num_generations={n})")
    if (k["global_batch_size"] * n) % per_step:
        problems.append(f"global_batch_size*rollout_n={k['global_batch_size'] * n} completions "
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
    if k.get("dynamic_batching"):
        problems.append("dynamic_batching=true: TRL's GRPOConfig has no token budgets (its "
                        "micro-batch is per_device_train_batch_size completions); sweep with "
                        "dynamic_batching=false for TRL")
    for knob in ("offload_params", "offload_optimizer"):
        if k.get(knob):
            problems.append(f"{knob}=true has no GRPOConfig key: set it in your accelerate "
                            "DeepSpeed/FSDP config, or sweep with offload off for TRL")
    if (k.get("rollout_tensor_parallel") or 1) > 1:
        problems.append(f"rollout_tensor_parallel={k['rollout_tensor_parallel']}: TRL generates "
                        "with the trained model on each process here (no engine to split); "
                        "sweep with rollout_tensor_parallel=1 for TRL")
    return problems


def _trl_derive(k: dict[str, Any], topo: Topology) -> dict[str, Any]:
    per_step = k["micro_batch_size_update"] * topo.world_size
    return {"gradient_accumulation_steps": k["global_batch_size"] * k["rollout_n"] // per_step,
            "generation_batch_size": k["rollout_batch_size"] * k["rollout_n"]}


def _trl_share(k: dict[str, Any], topo: Topology) -> dict[str, int]:
    """GRPOTrainer: each process generates generation_batch_size / processes completions and
    steps the optimizer every per_device_train_batch_size x gradient_accumulation_steps."""
    derived = _trl_derive(k, topo)
    return {"responses_per_step": derived["generation_batch_size"] // topo.world_size,
            "responses_per_minibatch": k["micro_batch_size_update"]
            * derived["gradient_accumulation_steps"]}


def _trl_underive(get: Callable[[str, Any], Any], topo: Topology) -> dict[str, Any]:
    n, mbu = get("num_generations", 8), get("per_device_train_batch_size", 8)
    accumulation = get("gradient_accumulation_steps", 1)
    generation = get("generation_batch_size", None) or mbu * topo.world_size * accumulation
    return {"global_batch_size": mbu * topo.world_size * accumulation // n,
            "rollout_batch_size": generation // n}


def _trl_short_run(steps: int, validate: bool, trial_dir: str) -> dict[str, Any]:
    """transformers' TrainingArguments: stop after `steps` optimizer steps, save nothing,
    log every step as a dict on the console (PrinterCallback, with the progress bar off)."""
    evaluation = {"eval_strategy": "steps", "eval_steps": steps} if validate else \
        {"eval_strategy": "no"}
    return {"max_steps": steps, "save_strategy": "no", "report_to": "none",
            "logging_steps": 1, "disable_tqdm": True, "push_to_hub": False,
            "output_dir": f"{trial_dir}/output", **evaluation}


TRL = Adapter(
    name="trl",
    keys={"micro_batch_size_update": ("per_device_train_batch_size",),
          "rollout_n": ("num_generations",),
          "gradient_checkpointing": ("gradient_checkpointing",),
          "max_response_length": ("max_completion_length",)},
    topology_keys=None,  # the process count comes from `accelerate launch`
    companions={"steps_per_generation": None},  # set through generation_batch_size instead
    rules=_trl_rules,
    launch="accelerate launch --num_processes {world} your_grpo_script.py --config {path}",
    derive=_trl_derive,
    underive=_trl_underive,
    defaults={"micro_batch_size_update": 8, "gradient_checkpointing": True},  # GRPOConfig
    share=_trl_share,
    short_run=_trl_short_run,
    # one generation feeds rollout_batch_size / global_batch_size optimizer steps, each logged
    steps_per_rollout=lambda k: max(1, k["rollout_batch_size"] // k["global_batch_size"]),
    derived_knobs=("global_batch_size", "rollout_batch_size"),
)
