"""Trainer adapters: the canonical knobs as each trainer's config keys, and its own rules.

One mapping table per trainer (shared/reference/trainers.md, DESIGN.md section 3), with the
companions the trainer needs, and the divisibility and range rules it enforces at start-up,
checked for a given number of nodes and GPUs per node so that a config the trainer would
reject is never written. Pure data and arithmetic: no YAML library here.

Batch counting: EasyR1 counts `rollout_batch_size` and `global_batch_size` in prompts and
multiplies the latter by rollout.n in the worker; verl counts `train_batch_size` and
`ppo_mini_batch_size` the same way; micro-batches are responses per GPU in both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autotune.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    nnodes: int = 1
    gpus_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node


@dataclass(frozen=True)
class Adapter:
    """A trainer: where each knob goes (first key is where it is read back from), the
    companions written with the tuned keys, and the rules checked before writing."""

    name: str
    keys: dict[str, tuple[str, ...]]
    topology_keys: tuple[str, str] | None  # (nnodes, gpus per node) where the config has them
    companions: dict[str, Any]
    rules: Callable[[dict[str, Any], Topology, Callable[[str, Any], Any]], list[str]]
    launch: str  # the launch line: {path} the exported file, {overrides}, {world}
    # keys computed from several knobs and the topology, and their inverse for reading back
    derive: Callable[[dict[str, Any], Topology], dict[str, Any]] | None = None
    underive: Callable[[Callable[[str, Any], Any], Topology], dict[str, Any]] | None = None
    # the knobs the trainer's own default or example config sets: the sweep's starting point
    defaults: dict[str, Any] | None = None

    def tuned_values(self, knobs: dict[str, Any], topology: Topology) -> dict[str, Any]:
        """Every dotted key this export writes, with its value."""
        values = {}
        for knob, keys in self.keys.items():
            if knobs.get(knob) is None:
                continue
            for key in keys:
                values[key] = knobs[knob]
        derived = self.derive(knobs, topology) if self.derive else {}
        return {**values, **derived, **self.companions}

    def read_knobs(self, get: Callable[[str, Any], Any], topology: Topology) -> dict[str, Any]:
        """The canonical knobs a trainer config holds (for the round trip)."""
        knobs = {knob: get(keys[0], None) for knob, keys in self.keys.items()
                 if get(keys[0], None) is not None}
        return {**knobs, **(self.underive(get, topology) if self.underive else {})}

    def check(self, knobs: dict[str, Any], topology: Topology,
              get: Callable[[str, Any], Any] = lambda key, default: default) -> list[str]:
        """Every rule of this trainer the knobs break, one line each naming rule and values.
        A setting the rules read from the user's config must be a plain value of the trainer
        default's type (an interpolation such as ${oc.select:...} cannot be checked)."""
        def plain(key: str, default: Any) -> Any:
            value = get(key, default)
            if isinstance(default, bool | int) and type(value) is not type(default):
                raise ConfigError(f"{key}={value!r} in the base config: autotune checks "
                                  f"{self.name}'s rules with it and needs a plain "
                                  f"{type(default).__name__}; write the value out")
            return value

        return [f"{self.name}: {line}" for line in self.rules(knobs, topology, plain)]


def _easyr1_rules(k: dict[str, Any], topo: Topology, get: Callable[[str, Any], Any]) -> list[str]:
    """verl/trainer/ray_trainer.py and verl/workers/fsdp_workers.py of hiyouga/EasyR1."""
    world, n = topo.world_size, k["rollout_n"]
    rbs, gbs = k["rollout_batch_size"], k["global_batch_size"]
    mbu, mbe = k["micro_batch_size_update"], k["micro_batch_size_experience"]
    ulysses = get("worker.actor.ulysses_size", 1)
    tp = get("worker.rollout.tensor_parallel_size", 2)
    problems = []
    if rbs % gbs:
        problems.append(f"data.rollout_batch_size={rbs} must be divisible by "
                        f"worker.actor.global_batch_size={gbs}")
    if rbs % world or (rbs * n) % world:
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
    if get("worker.actor.fsdp.enable_cpu_offload", False) and per_device != mbu:
        problems.append(f"worker.actor.fsdp.enable_cpu_offload needs no gradient accumulation: "
                        f"micro_batch_size_per_device_for_update={mbu} must equal the global "
                        f"batch size per device {per_device}")
    if world % tp:
        problems.append(f"the {world} GPUs must be divisible by "
                        f"worker.rollout.tensor_parallel_size={tp}")
    tokens = get("worker.rollout.max_num_batched_tokens", 8192)
    length = k["max_prompt_length"] + k["max_response_length"]
    if tokens < length:
        problems.append(f"worker.rollout.max_num_batched_tokens={tokens} must be at least "
                        f"max_prompt_length+max_response_length={length}")
    if get("algorithm.adv_estimator", "grpo") in ("grpo", "rloo") and n <= 1:
        problems.append(f"GRPO and RLOO need worker.rollout.n > 1 (got {n})")
    return problems


def _verl_rules(k: dict[str, Any], topo: Topology, get: Callable[[str, Any], Any]) -> list[str]:
    """verl/utils/config.py, workers/config/actor.py and workers/fsdp_workers.py of verl."""
    world, n = topo.world_size, k["rollout_n"]
    rbs, gbs, mbu = k["rollout_batch_size"], k["global_batch_size"], k["micro_batch_size_update"]
    sp = get("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1)
    infer = (get("actor_rollout_ref.rollout.tensor_model_parallel_size", 2)
             * get("actor_rollout_ref.rollout.data_parallel_size", 1)
             * get("actor_rollout_ref.rollout.pipeline_model_parallel_size", 1))
    problems = []
    if (rbs * n) % world:
        problems.append(f"real_train_batch_size data.train_batch_size*rollout.n={rbs * n} must "
                        f"be divisible by minimal possible batch size {world} (the GPUs)")
    if rbs < gbs:
        problems.append(f"data.train_batch_size={rbs} must be >= "
                        f"actor.ppo_mini_batch_size={gbs}")
    normalized = gbs * n // max(1, world // sp)
    if normalized <= 0:
        problems.append(f"actor.ppo_mini_batch_size={gbs} x rollout.n={n} over {world} GPUs "
                        "should be larger than 0 after normalization")
    elif normalized % mbu:
        problems.append(f"normalized ppo_mini_batch_size {normalized} should be divisible by "
                        f"ppo_micro_batch_size_per_gpu {mbu}")
    if world % infer:
        problems.append(f"rollout world_size {world} is not divisible by infer_world_size "
                        f"{infer} (tensor x data x pipeline parallel)")
    return problems


EASYR1 = Adapter(
    name="easyr1",
    keys={"rollout_batch_size": ("data.rollout_batch_size",),
          "rollout_n": ("worker.rollout.n",),
          "global_batch_size": ("worker.actor.global_batch_size",),
          "micro_batch_size_update": ("worker.actor.micro_batch_size_per_device_for_update",),
          "micro_batch_size_experience":
              ("worker.actor.micro_batch_size_per_device_for_experience",),
          "gradient_checkpointing": ("worker.actor.model.enable_gradient_checkpointing",),
          "offload_params": ("worker.actor.offload.offload_params",),
          "offload_optimizer": ("worker.actor.offload.offload_optimizer",),
          "max_prompt_length": ("data.max_prompt_length",),
          "max_response_length": ("data.max_response_length",),
          "val_batch_size": ("data.val_batch_size",)},
    topology_keys=("trainer.nnodes", "trainer.n_gpus_per_node"),
    companions={},
    rules=_easyr1_rules,
    launch="python3 -m verl.trainer.main config={path}",  # EasyR1's OmegaConf entry point
    defaults={"micro_batch_size_update": 1, "micro_batch_size_experience": 2,  # examples/
              "gradient_checkpointing": True, "offload_params": True,  # config.yaml
              "offload_optimizer": True},
)

VERL = Adapter(
    name="verl",
    keys={"rollout_batch_size": ("data.train_batch_size",),
          "rollout_n": ("actor_rollout_ref.rollout.n",),
          "global_batch_size": ("actor_rollout_ref.actor.ppo_mini_batch_size",),
          "micro_batch_size_update": ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",),
          # the old-log-prob forward (rollout) and the reference's, both per GPU
          "micro_batch_size_experience":
              ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
               "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
          "gradient_checkpointing": ("actor_rollout_ref.model.enable_gradient_checkpointing",),
          "offload_params": ("actor_rollout_ref.actor.fsdp_config.param_offload",),
          "offload_optimizer": ("actor_rollout_ref.actor.fsdp_config.optimizer_offload",),
          "max_prompt_length": ("data.max_prompt_length",),
          "max_response_length": ("data.max_response_length",)},
    topology_keys=("trainer.nnodes", "trainer.n_gpus_per_node"),
    # per-GPU micro-batches are read only without dynamic batch size, and must not be set
    # together with the deprecated global micro-batch keys
    companions={"actor_rollout_ref.actor.use_dynamic_bsz": False,
                "actor_rollout_ref.actor.ppo_micro_batch_size": None,
                "actor_rollout_ref.rollout.log_prob_micro_batch_size": None,
                "actor_rollout_ref.ref.log_prob_micro_batch_size": None},
    rules=_verl_rules,
    launch="python3 -m verl.trainer.main_ppo {overrides}",
    # ppo_trainer.yaml; its per-GPU micro-batches are null (must be set): the space's safest
    defaults={"gradient_checkpointing": True, "offload_params": False,
              "offload_optimizer": False},
)

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
    for knob in ("offload_params", "offload_optimizer"):
        if k.get(knob):
            problems.append(f"{knob}=true has no GRPOConfig key: set it in your accelerate "
                            "DeepSpeed/FSDP config, or sweep with offload off for TRL")
    return problems


def _trl_derive(k: dict[str, Any], topo: Topology) -> dict[str, Any]:
    per_step = k["micro_batch_size_update"] * topo.world_size
    return {"gradient_accumulation_steps": k["global_batch_size"] * k["rollout_n"] // per_step,
            "generation_batch_size": k["rollout_batch_size"] * k["rollout_n"]}


def _trl_underive(get: Callable[[str, Any], Any], topo: Topology) -> dict[str, Any]:
    n, mbu = get("num_generations", 8), get("per_device_train_batch_size", 8)
    accumulation = get("gradient_accumulation_steps", 1)
    generation = get("generation_batch_size", None) or mbu * topo.world_size * accumulation
    return {"global_batch_size": mbu * topo.world_size * accumulation // n,
            "rollout_batch_size": generation // n}


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
)

ADAPTERS = {adapter.name: adapter for adapter in (EASYR1, VERL, TRL)}


def get_adapter(name: str) -> Adapter:
    if name not in ADAPTERS:
        raise ConfigError(f"--trainer {name!r}: known trainers: {', '.join(ADAPTERS)}")
    return ADAPTERS[name]
