"""Run EasyR1's own start-up checks on an exported config, for its real world size, on a CPU.

    git clone https://github.com/hiyouga/EasyR1
    pip install torch transformers ray "omegaconf==2.3.0" codetiming tensordict
    python scripts/check_easyr1_load.py EASYR1_ROOT EXPORT.yaml [key=value ...]

Prints one line and exits 0 (`easyr1 accepted: ...`, with the world size and the per-device
batch sizes; with AUTOTUNE_CHECK_JSON=PATH set, every per-device quantity EasyR1 will run is
written there as JSON, read from its own normalised config), 1 (`easyr1 rejected: STAGE:
Type: message`, EasyR1's own exception) or 2 (usage error or missing dependency). EasyR1's
stdout goes to stderr. Runs from any directory: it works in EASYR1_ROOT, as a launch from the
checkout would; missing data, prompt, reward or model files are not needed, and nothing
touches the network (HF_HUB_OFFLINE=1; no tokenizer or model is loaded). Needs omegaconf 2.3
(else exit 2): 2.4 rejects EasyR1's own default `trainer.logger` (`Tuple[str]` holding two
names).

Stages, in EasyR1's order, each calling EasyR1's real code (W = nnodes x n_gpus_per_node):
  config   verl.trainer.main.main() itself, with sys.argv = [config=EXPORT.yaml, overrides...]:
           structured PPOConfig, merge file, merge CLI, to_object, deep_post_init.
  trainer  RayPPOTrainer(...) built as Runner.run builds it: rollout vs actor global batch,
           experience micro-batch, the critic's checks when adv_estimator is gae, GRPO/RLOO n > 1.
  worker   FSDPWorker(config.worker, "actor_rollout_ref"), and "critic" when the trainer uses a
           critic, as rank 0 of W: Worker env, _init_dist_mesh (global_batch_size *= n,
           // (W // ulysses_size), divisibility by the update micro-batch, FSDP CPU offload
           without gradient accumulation).
  rollout  the actor worker's _build_rollout(): W % tensor_parallel_size, the (dp, tp) mesh and
           vLLMRollout.__init__ (tp vs world size, max_num_batched_tokens vs prompt+response,
           dtype).
  chunk    DataProto.chunk(W) as the DP_COMPUTE_PROTO dispatch does: the generation batch
           (mini_rollout_batch_size or rollout_batch_size prompts) and rollout_batch_size x n
           responses; then on one device's share (gathered over the Ulysses group) the
           DataProto.split calls of update_policy/update_critic (global_batch_size_per_device)
           and of compute_log_prob/compute_values (experience micro-batch, without
           dynamic_batching).

Stubbed, and why:
  GPU   torch.distributed runs torch's fake process group (rank 0 of W, no peers);
        init_device_mesh("cuda", ...) in fsdp_workers is given "cpu"; torch.cuda.get_device_name
        (read by Worker.__init__) answers "cpu" when no GPU is present; fsdp_workers'
        print_gpu_memory_usage (torch.cuda.mem_get_info) is a no-op.
  Ray   main()'s `ray` and `Runner` names: is_initialized() is True (no cluster) and
        Runner.remote().run.remote(config) hands the config back instead of launching the run.
        The trainer gets FSDPWorker itself, not ray.remote(FSDPWorker) (its __init__ only looks
        for a reward-model role); init_workers (placement groups, GPU count) does not run.
  vLLM  the `vllm` package is a stub module tree (LLM, SamplingParams: no-op stand-ins, always,
        even where vLLM is installed); VLLMHijack.hijack (patches vLLM's LoRA loader) and
        FSDPVLLMShardingManager (reads vLLM's tensor-parallel state and the CUDA RNG) are no-ops.
  model weights  init_model does not run: no tokenizer, config or weights are loaded, so its
        optim.strategy / lr_scheduler_type checks are not reached. The trainer and the rollout
        get a tokenizer stand-in (pad_token_id 0), processor None (a text model), a one-batch
        train dataloader (only its len() is read), no reward functions; the worker gets
        fsdp_module None.
  imports  modules EasyR1 imports only for steps that do not run here are stub modules when
        they are not installed: torchdata, peft, accelerate, datasets, PIL, qwen_vl_utils,
        einops, msgspec, jinja2. Under transformers >= 5 (EasyR1 pins < 5)
        transformers.modeling_utils.no_init_weights is taken from transformers.initialization.
Not run: Runner.run's tokenizer and dataloader, init_workers (Ray pools), init_model (weights,
FSDP wrap, optimizer), training. A (ddp, fsdp) mesh that does not cover W (fsdp_size not
dividing W) passes on torch 2.13's CPU mesh; the deployed torch may refuse it.
"""

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from copy import deepcopy

USAGE = "usage: check_easyr1_load.py EASYR1_ROOT EXPORT.yaml [key=value ...]"
REQUIRED = {"torch": "torch", "transformers": "transformers", "ray": "ray", "numpy": "numpy",
            "omegaconf": "omegaconf==2.3.0", "codetiming": "codetiming",
            "tensordict": "tensordict", "yaml": "pyyaml", "packaging": "packaging"}
STUB_IF_MISSING = ["torchdata", "peft", "accelerate", "datasets", "PIL", "qwen_vl_utils", "einops",
                   "msgspec", "jinja2"]
TOKENIZER = types.SimpleNamespace(pad_token_id=0)  # all the rollout reads of the tokenizer
STDOUT = sys.stdout  # EasyR1 prints to stderr; this line goes here


def finish(code: int, line: str):
    print(line, file=STDOUT, flush=True)
    sys.exit(code)


class _Anything:
    """A name imported from a stub module: callable, subclassable, every method a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _stub_attr(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Anything,), {})


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves an empty package for `root` and every `root.sub.module` imported below it."""

    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = _stub_attr
        return module

    def exec_module(self, module):
        pass


def import_easyr1(root: str):
    missing = [name for name in STUB_IF_MISSING if importlib.util.find_spec(name) is None]
    sys.meta_path.insert(0, StubFinder(["vllm", *missing]))
    sys.path.insert(0, root)
    import transformers.modeling_utils as modeling_utils

    if not hasattr(modeling_utils, "no_init_weights"):  # transformers >= 5 moved it
        from transformers.initialization import no_init_weights

        modeling_utils.no_init_weights = no_init_weights
    import verl.trainer.main  # noqa: F401  (imports the trainer, the workers and the rollout)


def run_config(export: str, overrides: list[str]):
    import verl.trainer.main as easyr1_main

    handed = []
    runner = types.SimpleNamespace(run=types.SimpleNamespace(remote=handed.append))
    easyr1_main.Runner = types.SimpleNamespace(remote=lambda: runner)
    easyr1_main.ray = types.SimpleNamespace(is_initialized=lambda: True, get=lambda ref: ref,
                                            timeline=lambda filename: None)
    sys.argv = [easyr1_main.__file__, f"config={export}", *overrides]
    easyr1_main.main()
    return handed[0]


def run_trainer(config):
    from verl.single_controller.ray import RayWorkerGroup
    from verl.trainer.ray_trainer import RayPPOTrainer, ResourcePoolManager, Role
    from verl.workers.fsdp_workers import FSDPWorker

    spec = {"global_pool": [config.trainer.n_gpus_per_node] * config.trainer.nnodes}
    pools = ResourcePoolManager(
        resource_pool_spec=spec, mapping={Role.ActorRolloutRef: "global_pool",
                                          Role.Critic: "global_pool"})
    trainer = RayPPOTrainer(
        config=config, tokenizer=TOKENIZER, processor=None, train_dataloader=[None],
        val_dataloader=[None],
        role_worker_mapping={Role.ActorRolloutRef: FSDPWorker, Role.Critic: FSDPWorker},
        resource_pool_manager=pools, ray_worker_group_cls=RayWorkerGroup, reward_fn=None,
        val_reward_fn=None)
    return trainer, pools.get_num_gpus()


def run_workers(config, world_size: int, use_critic: bool):
    import torch
    import torch.distributed as dist
    import verl.workers.fsdp_workers as fsdp_workers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    os.environ.update(WORLD_SIZE=str(world_size), RANK="0", LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE=str(config.trainer.n_gpus_per_node))
    fsdp_workers.init_device_mesh = lambda device_type, *args, **kwargs: init_device_mesh(
        "cpu" if device_type == "cuda" else device_type, *args, **kwargs)
    if not torch.cuda.is_available():
        torch.cuda.get_device_name = lambda device=None: "cpu"
    roles = ["actor_rollout_ref"] + (["critic"] if use_critic else [])
    # each Ray worker unpickles its own copy of config.worker
    return {role: fsdp_workers.FSDPWorker(deepcopy(config.worker), role) for role in roles}


def run_rollout(actor):
    import verl.workers.fsdp_workers as fsdp_workers
    import verl.workers.rollout.vllm_rollout_spmd as vllm_rollout

    vllm_rollout.VLLMHijack = types.SimpleNamespace(hijack=lambda: None)
    fsdp_workers.FSDPVLLMShardingManager = lambda **kwargs: None
    fsdp_workers.print_gpu_memory_usage = lambda prefix="": None
    actor.tokenizer, actor.processor, actor.fsdp_module = TOKENIZER, None, None
    actor._build_rollout()


def run_chunk(config, workers, world_size: int):
    import torch
    from verl.protocol import DataProto

    def rows(count: int):
        return DataProto.from_dict({"input_ids": torch.zeros(count, 1, dtype=torch.long)})

    data = config.data
    prompts = data.rollout_batch_size if data.mini_rollout_batch_size is None else (
        data.mini_rollout_batch_size)
    rows(prompts).chunk(world_size)  # generate_sequences
    shard = rows(data.rollout_batch_size * config.worker.rollout.n).chunk(world_size)[0]
    for role, worker in workers.items():
        cfg = worker.config.critic if role == "critic" else worker.config.actor
        gathered = DataProto.concat([shard] * cfg.ulysses_size)  # FSDPUlyssesShardingManager
        gathered.split(cfg.global_batch_size_per_device)  # update_policy / update_critic
        if not cfg.dynamic_batching:  # compute_log_prob / compute_values
            gathered.split(cfg.micro_batch_size_per_device_for_experience)
    return prompts // world_size, len(shard)


def summary(config, workers, world_size: int, per_device) -> str:
    t, rollout = config.trainer, config.worker.rollout
    parts = [f"world_size={world_size} ({t.nnodes}x{t.n_gpus_per_node})"]
    for role, worker in workers.items():
        cfg = worker.config.critic if role == "critic" else worker.config.actor
        parts.append(f"{role.split('_')[0]}: global_batch_size={cfg.global_batch_size} "
                     f"per_device={cfg.global_batch_size_per_device} "
                     f"micro_update={cfg.micro_batch_size_per_device_for_update} "
                     f"micro_experience={cfg.micro_batch_size_per_device_for_experience}")
    tp = rollout.tensor_parallel_size
    parts.append(f"rollout: tp={tp} dp={world_size // tp}")
    parts.append(f"per device: {per_device[0]} prompts, {per_device[1]} responses")
    return "; ".join(parts)


def quantities(config, trainer, workers, world_size: int, per_device) -> dict:
    """Every per-device quantity EasyR1 will run, read from its own normalised config (for
    autotune's round-trip test: written to $AUTOTUNE_CHECK_JSON when set)."""
    worker = workers["actor_rollout_ref"].config
    actor, ref, rollout, data = worker.actor, worker.ref, worker.rollout, config.data
    length = data.max_prompt_length + data.max_response_length  # padded (dp_actor.py)
    return {
        "world_size": world_size, "responses_per_step": per_device[1],
        "responses_per_minibatch": actor.global_batch_size_per_device,
        "micro_batch_size_update": actor.micro_batch_size_per_device_for_update,
        "micro_batch_size_experience": actor.micro_batch_size_per_device_for_experience,
        "dynamic_batching": actor.dynamic_batching,
        "max_token_len_update": actor.micro_batch_size_per_device_for_update * length,
        "max_token_len_experience": actor.micro_batch_size_per_device_for_experience * length,
        "rollout_n": rollout.n, "max_prompt_length": data.max_prompt_length,
        "max_response_length": data.max_response_length,
        "offload_params": actor.offload.offload_params,
        "offload_optimizer": actor.offload.offload_optimizer,
        "use_kl": trainer.use_reference_policy,
        "offload_ref_params": ref.offload.offload_params or ref.fsdp.enable_cpu_offload,
        "gradient_checkpointing": actor.model.enable_gradient_checkpointing,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "rollout_tensor_parallel": rollout.tensor_parallel_size,
        "max_num_batched_tokens": rollout.max_num_batched_tokens,
        "sequence_parallel": actor.ulysses_size, "model": actor.model.model_path,
        "lora_rank": actor.model.lora.rank, "lora_alpha": actor.model.lora.alpha,
        "lora_target_modules": actor.model.lora.target_modules}


def main(argv: list[str]):
    if len(argv) < 3 or any("=" not in arg for arg in argv[3:]):
        finish(2, USAGE)
    root, export = os.path.abspath(argv[1]), os.path.abspath(argv[2])
    if not os.path.isfile(os.path.join(root, "verl", "trainer", "main.py")):
        finish(2, f"easyr1 check: {argv[1]} is not an EasyR1 checkout (no verl/trainer/main.py)")
    if not os.path.isfile(export):
        finish(2, f"easyr1 check: no such file: {argv[2]}")
    for module, package in REQUIRED.items():
        if importlib.util.find_spec(module) is None:
            finish(2, f"easyr1 check: missing dependency {module}: pip install '{package}'")
    import omegaconf

    if not omegaconf.__version__.startswith("2.3."):
        finish(2, f"easyr1 check: omegaconf {omegaconf.__version__} rejects EasyR1's own "
                  "example config: pip install 'omegaconf==2.3.0'")
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    for name in ("WG_PREFIX", "DISABLE_WORKER_INIT", "USE_MODELSCOPE_HUB"):
        os.environ.pop(name, None)
    os.chdir(root)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            import_easyr1(root)
        except ImportError as error:
            name = (error.name or "?").partition(".")[0]
            finish(2, f"easyr1 check: cannot import EasyR1 ({type(error).__name__}: {error}); "
                      f"pip install {dict(yaml='pyyaml').get(name, name)}")
        stage = "config"
        try:
            config = run_config(export, argv[3:])
            stage = "trainer"
            trainer, world_size = run_trainer(config)
            stage = "worker"
            workers = run_workers(config, world_size, trainer.use_critic)
            stage = "rollout"
            run_rollout(workers["actor_rollout_ref"])
            stage = "chunk"
            per_device = run_chunk(config, workers, world_size)
        except Exception as error:  # EasyR1's own rejection, whatever its type
            message = " ".join(str(error).split())
            finish(1, f"easyr1 rejected: {stage}: {type(error).__name__}: {message}")
    if os.environ.get("AUTOTUNE_CHECK_JSON"):
        import json

        with open(os.environ["AUTOTUNE_CHECK_JSON"], "w") as handle:
            json.dump(quantities(config, trainer, workers, world_size, per_device), handle)
    finish(0, "easyr1 accepted: " + summary(config, workers, world_size, per_device))


if __name__ == "__main__":
    main(sys.argv)
