"""Separate placement (issue 68): the engine on GPUs of its own, the trainer on the rest.

The knobs' rules (the trainers count their batches on the trainer's GPUs alone), each role's
memory per GPU from the model's own terms, `autotune estimate` printing both, and the probe
and the exports refusing it in one line until they run and write it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from autotune.config import ProbeConfig, Topology, validate_probe_config
from autotune.config.rules import device_problems
from autotune.memory.model import estimate_memory
from autotune.memory.roles import (
    ENGINE_SYNC_BUCKETS,
    SYNC_BUCKET_BYTES,
    TRAINER_SYNC_BUCKETS,
    estimate_placement,
)
from autotune.memory.shape import model_shape
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.export_plan import plan_export, resolved_get
from autotune.trainers.trl import TRL
from autotune.trainers.verl import VERL

GiB = 1 << 30
SEPARATE = ProbeConfig(placement="separate", rollout_gpus=4, rollout_engine="vllm-like",
                       gpu_memory_utilization=0.85, rollout_tensor_parallel=2,
                       rollout_batch_size=64, rollout_n=8, global_batch_size=32,
                       max_prompt_length=1024, max_response_length=2048,
                       micro_batch_size_update=2, micro_batch_size_experience=4,
                       gradient_checkpointing=True, use_kl=True)


@pytest.mark.parametrize("changes, expected", [
    ({"placement": "colocated", "rollout_gpus": 2}, "rollout_gpus=2: read only with "
     "placement=separate"),
    ({"placement": "colocated", "rollout_gpus": 0, "staleness": 1}, "staleness=1: read only "
     "with placement=separate"),
    ({"rollout_gpus": 8}, "the engine takes 1 to 7 of the run's 8 GPUs"),
    ({"rollout_gpus": 0}, "placement=separate needs rollout_gpus, the GPUs the engine has "
     "to itself (1 to 7 of the run's 8): add --set rollout_gpus=N"),
    ({"rollout_engine": "hf"}, "an engine on GPUs of its own is a served one"),
    ({"rollout_gpus": 3}, "rollout_tensor_parallel=2 does not divide the 3 GPUs the engine "
     "has to itself"),
    ({"rollout_gpus": 2, "rollout_tensor_parallel": 1},  # 6 trainer GPUs: 64 prompts do not
     "rollout_batch_size=64 prompts are not divisible by the 6 GPUs that train"),  # split
], ids=["colocated-gpus", "colocated-staleness", "all-gpus", "no-gpus", "hf", "tp", "batch"])
def test_separate_placement_rules(changes, expected):
    problems = validate_probe_config(SEPARATE.replace(**changes), 8)
    assert [p for p in problems if expected in p], problems


def test_the_batches_split_over_the_trainers_gpus_not_the_run():
    """12 prompts split over 4 trainer GPUs, not over the run's 8 (verl's validate_config
    counts trainer.n_gpus_per_node x nnodes under separate placement)."""
    batch = {"rollout_batch_size": 12, "global_batch_size": 12, "rollout_n": 2,
             "micro_batch_size_update": 1, "micro_batch_size_experience": 1}
    assert validate_probe_config(SEPARATE.replace(**batch), 8) == []
    colocated = SEPARATE.replace(placement="colocated", rollout_gpus=0, **batch)
    assert [p for p in validate_probe_config(colocated, 8) if "of the run" in p]


def test_each_roles_gpu_holds_its_own_part_of_the_run():
    """The engine's GPU: the engine's reservation at gpu_memory_utilization of the GPU, the
    sync's receive buffers, what lives outside torch; no trainer state. The trainer's GPU: the
    colocated model's trained phases on 4 ranks with no engine beside them, and the weight
    sync (its send buffers, a gathered tensor; the params back where they are offloaded)."""
    shape, capacity = model_shape("qwen2.5-7b"), 80 * GiB
    placed = estimate_placement(shape, SEPARATE, 8, 4, capacity)
    assert placed.rollout_gpus == 4 and placed.trainer_gpus == 4
    rollout = placed.engine.phases["rollout"]
    assert list(placed.engine.phases) == ["rollout"]
    assert rollout.parts == {"engine_reservation": int(0.85 * capacity),
                             "sync_buffers": ENGINE_SYNC_BUCKETS * SYNC_BUCKET_BYTES}
    assert 1 * GiB < rollout.context_bytes < 3 * GiB
    assert placed.engine.peak_bytes == rollout.total_bytes and placed.binding_role == "engine"

    trainer = placed.trainer.phases
    assert list(trainer) == ["weight_sync", "experience", "update"]
    assert not any("engine" in part for phase in trainer.values() for part in phase.parts)
    colocated = estimate_memory(shape, SEPARATE.replace(placement="colocated", rollout_gpus=0,
                                                        enable_sleep=True), num_gpus=4,
                                engine_capacity_bytes=capacity)
    for phase in ("experience", "update"):  # the same states, sharded over the same 4 ranks
        assert trainer[phase].parts["reference"] == colocated.phases[phase].parts["reference"]
    assert trainer["update"].parts["params_grads_adam"] == \
        colocated.phases["update"].parts["params_grads_adam"]
    sync = trainer["weight_sync"].parts
    assert sync["sync_buffers"] == TRAINER_SYNC_BUCKETS * SYNC_BUCKET_BYTES
    assert sync["gathered_tensor"] > 0 and sync["actor_params"] == 0
    offloaded = estimate_placement(shape, SEPARATE.replace(offload_params=True), 8, 4, capacity)
    assert offloaded.trainer.phases["weight_sync"].parts["actor_params"] == 4 * -(
        -shape.num_params // 4)
    assert placed.trainer.host_offload_bytes < colocated.host_offload_bytes  # no engine asleep

    fewer = estimate_placement(shape, SEPARATE, 8, 2, capacity)  # 6 trainer ranks share more
    assert fewer.trainer.phases["update"].states_bytes < trainer["update"].states_bytes


def test_estimate_prints_each_roles_gpu_against_the_budget():
    command = [sys.executable, "-m", "autotune", "estimate", "--model", "qwen2.5-7b",
               "--gpus-per-node", "8", "--set", "placement=separate", "--set", "rollout_gpus=4"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "separate placement: the engine on 4 GPUs" in out.stdout
    assert "engine GPU (one of 4)" in out.stdout and "trainer GPU (one of 4)" in out.stdout
    assert "engine's peak: rollout" in out.stdout and "trainer's peak: update" in out.stdout
    assert "binds: the " in out.stdout and "budget" in out.stdout
    document = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True,
                                         timeout=120).stdout)
    assert set(document["roles"]) == {"engine", "trainer"}
    assert document["roles"]["trainer"]["gpus"] == 4
    assert document["binding_role"] in ("engine", "trainer")
    traced = subprocess.run([*command, "--trace"], capture_output=True, text=True, timeout=120)
    assert traced.returncode == 2 and traced.stderr.count("\n") == 1, traced.stderr
    assert "--trace with placement=separate" in traced.stderr


def test_the_probe_and_the_exports_refuse_it_in_one_line():
    """The split probe runs on a CPU only (tests/test_split_probe.py), with the vllm-like
    engine and no LoRA; EasyR1 (no such placement) refuses it in one line; verl's (one step
    off) and TRL's server mode are written (below)."""
    assert [p for p in device_problems(SEPARATE, True, False, False)
            if p.startswith("placement=separate: the split probe runs on a CPU only")]
    assert not device_problems(SEPARATE, False, False, True)  # capped: the engine's share
    assert [p for p in device_problems(SEPARATE.replace(lora_rank=8), False, False, True)
            if p.startswith("placement=separate with lora_rank: the split probe")]
    knobs = {k: v for k, v in SEPARATE.as_dict().items()
             if k in ("placement", "rollout_gpus", "rollout_engine", "rollout_batch_size",
                      "rollout_n", "global_batch_size", "micro_batch_size_update",
                      "micro_batch_size_experience", "gpu_memory_utilization",
                      "rollout_tensor_parallel")}
    problems = plan_export(EASYR1, knobs, Topology(1, 8), None).problems
    refused = [p for p in problems if p.startswith("placement=separate: ")]
    assert len(refused) == 1, problems
    assert "worker.hybrid_engine=false raises NotImplementedError" in refused[0]


ONE_STEP_OFF = {"placement": "separate", "rollout_gpus": 4, "staleness": 1,
                "rollout_engine": "vllm-like", "rollout_tensor_parallel": 2,
                "gpu_memory_utilization": 0.9, "rollout_batch_size": 16, "rollout_n": 4,
                "global_batch_size": 8, "micro_batch_size_update": 2,
                "micro_batch_size_experience": 2, "max_prompt_length": 64,
                "max_response_length": 64}


def test_verl_one_step_off_is_written_on_the_trainers_gpus():
    """verl's separate placement is its one_step_off_policy recipe: trainer.* the training
    GPUs, the top-level rollout.* the engine's pool (whole nodes of a multi-node run), the
    recipe's keys, its launch line, and the header says the recipe skips the old-log-prob pass
    the study timed (tests/test_trainer_startup.py runs the recipe's own start-up); the
    file exports again onto itself without a conflict."""
    import yaml

    from autotune.trainers.render import render_plan

    plan = plan_export(VERL, ONE_STEP_OFF, Topology(1, 8), None, searched=["staleness"])
    assert plan.problems == [] and plan.trainers == Topology(1, 4)
    assert {key: plan.values[key] for key in ("trainer.nnodes", "trainer.n_gpus_per_node",
                                              "rollout.nnodes", "rollout.n_gpus_per_node")} \
        == {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 4, "rollout.nnodes": 1,
            "rollout.n_gpus_per_node": 4}
    assert plan.values["actor_rollout_ref.hybrid_engine"] is False
    assert plan.values["algorithm.rollout_correction.bypass_mode"] is True
    # the sync between the pools over NCCL, as verl 0.9.1's recipe YAMLs set it (ppo_trainer's
    # naive syncs within one process: 0.9.1's recipes fail at their first sync with it)
    assert plan.values["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "nccl"
    assert plan.launch.startswith("python3 -m verl.experimental.one_step_off_policy.main_ppo")
    text = render_plan(plan, VERL, None, ["test"])
    assert "the trainer skips the actor's log-prob pass the study's experience phase" in text
    assert "returns each generated token's log-prob, which the study's engine did not" in text
    again = plan_export(VERL, ONE_STEP_OFF, Topology(1, 8), yaml.safe_load(text),
                        searched=["staleness"])  # its own file as the base: the recipe's
    assert again.problems == []  # keys (calculate_log_probs, bypass_mode, the sync's
    # backend) are no conflict
    assert "checkpoint_engine.backend: nccl, the weight sync between the pools" in text
    nodes = plan_export(VERL, {**ONE_STEP_OFF, "rollout_gpus": 8, "rollout_tensor_parallel": 4},
                        Topology(3, 8), None)
    assert nodes.problems == [] and (nodes.values["trainer.nnodes"],
                                     nodes.values["rollout.nnodes"]) == (2, 1)
    colocated = plan_export(VERL, {**ONE_STEP_OFF, "placement": "colocated",
                                   "rollout_gpus": 0, "staleness": 0}, Topology(1, 8), None)
    assert not [key for key in colocated.values if key.startswith("rollout.")
                or key == "actor_rollout_ref.hybrid_engine"]


def test_verl_fully_async_is_one_step_a_version_and_its_lag_the_staleness():
    """Staleness 2 and more is verl's fully_async_policy recipe: one parameter version a step
    (the mini-batch x require_batches 1 x trigger_parameter_sync_step = the step's prompts),
    staleness_threshold k, the step sized by those keys (train_batch_size 0, as the recipe
    asserts), partial rollouts off as probed, the run as long as the user's epochs; its launch
    line; the file reads back as the study (tests/test_trainer_startup.py runs its start-up)."""
    import yaml

    from autotune.trainers.render import render_plan

    study = {**ONE_STEP_OFF, "staleness": 3}
    plan = plan_export(VERL, study, Topology(1, 8), None, searched=["staleness"])
    assert plan.problems == [] and plan.trainers == Topology(1, 4)
    values = plan.values
    assert (values["async_training.staleness_threshold"],
            values["async_training.trigger_parameter_sync_step"],
            values["async_training.require_batches"],
            values["actor_rollout_ref.actor.ppo_mini_batch_size"]) == (3, 2, 1, 8)
    assert (values["data.train_batch_size"], values["data.gen_batch_size"],
            values["async_training.partial_rollout"]) == (0, 1, False)
    assert values["actor_rollout_ref.hybrid_engine"] is False
    assert values["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "nccl"
    assert plan.launch.startswith(
        "python3 -m verl.experimental.fully_async_policy.fully_async_main")
    text = render_plan(plan, VERL, None, ["test"])
    assert "asynchronous with a lag of at most 3 steps" in text
    assert "the rollouter pauses once it holds 4 steps of samples" in text
    assert "partial_rollout: false, as the split probe ran" in text
    assert "calculate_log_probs: true (the recipe's): vLLM returns each generated" in text
    assert "keeps at most 16 prompts (each with its rollout.n responses) in flight" in text
    assert plan.values["actor_rollout_ref.rollout.free_cache_engine"] is False  # as probed
    tree = yaml.safe_load(text)
    assert tree["rollout"]["total_rollout_steps"] is None  # every prompt of the user's epochs
    assert tree["rollout"]["total_epochs"] == "${trainer.total_epochs}"
    read = VERL.read_knobs(lambda key, default: resolved_get(tree, key, default),
                           Topology(1, 4))
    assert {k: read[k] for k in ("placement", "staleness", "rollout_gpus",
                                 "rollout_batch_size", "global_batch_size")} == {
        "placement": "separate", "staleness": 3, "rollout_gpus": 4,
        "rollout_batch_size": 16, "global_batch_size": 8}
    # exported again onto its own file: nothing to refuse (the recipe's keys are the
    # placement's, its step read back through them); another step size on it is a conflict
    assert plan_export(VERL, study, Topology(1, 8), tree, searched=["staleness"]).problems == []
    longer = {**tree, "async_training": {**tree["async_training"],
                                         "trigger_parameter_sync_step": 4}}
    assert [p for p in plan_export(VERL, study, Topology(1, 8), longer,
                                   searched=["staleness"]).problems
            if p.startswith("rollout_batch_size (from ") and "is 32 in your base config but "
            "the study measured 16" in p]
    assert [p for p in plan_export(VERL, study, Topology(1, 8), {"data": {
        "train_batch_size": 512}}, searched=["staleness"]).problems
        if p.startswith("data.train_batch_size is 512")]
    # a study one step off on this base: its async_training block is cleared, not left to
    # turn the launch into fully_async's
    once = plan_export(VERL, ONE_STEP_OFF, Topology(1, 8), tree, searched=["staleness"],
                       force=True)
    assert once.values["async_training"] is None and once.launch.startswith(
        "python3 -m verl.experimental.one_step_off_policy.main_ppo")
    # nor its gen_batch_size 1 left to make one-prompt steps (ray_trainer.py's dataloader)
    assert once.values["data.gen_batch_size"] == 16


@pytest.mark.parametrize("changes, expected", [
    ({"staleness": 0}, "PPO trainer runs only the hybrid engine"),
    ({"rollout_gpus": 5, "rollout_tensor_parallel": 5, "rollout_batch_size": 12,
      "global_batch_size": 6}, "RolloutReplica asserts"),
    ({"rollout_gpus": 2}, "must be divisible by minimal possible batch size 6"),
])
def test_verl_separate_placement_refuses_what_its_recipe_does_not_run(changes, expected):
    """Staleness 0 (verl's PPO trainer asserts the hybrid engine) in one line; the engine's
    replicas as the recipe's agent loop sizes them; the batches over the trainer's 6 GPUs,
    not the run's 8."""
    problems = plan_export(VERL, {**ONE_STEP_OFF, **changes}, Topology(1, 8), None).problems
    assert [p for p in problems if expected in p], problems
    assert len(problems) == 1 or "staleness" not in changes, problems


def test_a_verl_base_without_the_hybrid_engine_is_a_separate_placement():
    """hybrid_engine false reads back as the recipe's split; a colocated study on such a base
    is a conflict (verl's main_ppo would assert it on), not a silent switch."""
    base = {"actor_rollout_ref": {"hybrid_engine": False},
            "rollout": {"nnodes": 1, "n_gpus_per_node": 2}}
    assert VERL.read_knobs(lambda key, default: resolved_get(base, key, default),
                           Topology(1, 6)) == {"placement": "separate", "staleness": 1,
                                               "rollout_gpus": 2, "use_kl": False,
                                               "algorithm": "ppo"}
    colocated = {**ONE_STEP_OFF, "placement": "colocated", "rollout_gpus": 0, "staleness": 0}
    problems = plan_export(VERL, colocated, Topology(1, 8), base,
                           searched=["micro_batch_size_update"]).problems
    assert [p for p in problems if p.startswith("actor_rollout_ref.hybrid_engine is false in "
                                                "your base config")], problems


def test_a_separate_step_composes_its_sides_by_staleness():
    """Staleness 0 takes turns (rollout, trained phases, sync); 1 or more overlaps the next
    rollout with this update (the slower side, then the sync); colocated is the plain sum."""
    from autotune.config.pipeline import pipeline_step, step_seconds

    phases = {"rollout": 30.0, "experience": 8.0, "update": 14.0}
    assert step_seconds(phases, separate=False) == 52.0
    assert step_seconds(phases, separate=True, staleness=0, sync_s=1.5) == 53.5
    for staleness in (1, 4):  # a deeper buffer runs at the same pace
        step = pipeline_step(phases, sync_s=1.5, staleness=staleness)
        assert (step.engine_s, step.trainer_s, step.step_s) == (30.0, 22.0, 31.5)
        assert (step.waiting_side, step.idle_s) == ("trainer", 8.0)
    slow_trainer = pipeline_step({**phases, "critic_update": 20.0, "weight_sync": 0.5}, 1)
    assert (slow_trainer.step_s, slow_trainer.waiting_side) == (42.5, "engine")
    assert pipeline_step(phases, 0, sync_s=1.5).waiting_side == "both"
    with pytest.raises(ValueError, match="must be at least 0"):
        pipeline_step(phases, 1, sync_s=-1.0)


def test_an_oom_on_one_split_proves_nothing_about_another():
    """The split moves every phase's peak (the trainer's states over 8 - rollout_gpus ranks):
    a trainer out of memory on 1 GPU says nothing of the same knobs on 4, so dominance keeps
    them apart (it once let one OOM at rollout_gpus=7 close a whole space)."""
    from autotune.sweep.feasibility.dominance import at_least_as_demanding

    one_trainer = {"placement": "separate", "rollout_gpus": 7, "micro_batch_size_update": 2}
    four_trainers = {**one_trainer, "rollout_gpus": 4}
    bigger_micro = {**one_trainer, "micro_batch_size_update": 4}
    for phase in ("rollout", "experience", "update", "weight_sync"):
        assert not at_least_as_demanding(four_trainers, one_trainer, phase=phase)
        assert at_least_as_demanding(bigger_micro, one_trainer, phase=phase)
        # on a GPU the trainer's later phases find the segments its first update left
        # (memory.carried_knobs); the engine's GPUs run the rollout apart from them
        carried = phase == "experience"
        assert at_least_as_demanding(bigger_micro, one_trainer, phase=phase, on_gpu=True,
                                     separate=True) is not carried
        # colocated, the rollout finds them too
        assert at_least_as_demanding(bigger_micro, one_trainer, phase=phase, on_gpu=True) \
            is (phase in ("update", "weight_sync"))
    # the validation runs on the trainer's GPUs (config.ENGINE_PHASES is the rollout alone)
    assert not at_least_as_demanding(bigger_micro, one_trainer, phase="validation",
                                     on_gpu=True, separate=True)


def test_a_separate_space_file_is_checked_on_a_run_it_can_describe(tmp_path):
    """A space's file is checked before a run names its GPUs: on one GPU, or, where the
    engine can have GPUs of its own, on one more than its largest rollout_gpus (placement=
    separate cannot run on one GPU, and every such file was once refused)."""
    from autotune.errors import ConfigError
    from autotune.sweep.space.search_space import load_search_space, smallest_world

    path = tmp_path / "split.yaml"
    path.write_text("params:\n  rollout_gpus: {type: categorical, choices: [2, 4, 6]}\n"
                    "  staleness: {type: categorical, choices: [0, 1]}\n"
                    "fixed:\n  placement: separate\n  rollout_engine: vllm-like\n"
                    "  rollout_batch_size: 8\n  global_batch_size: 4\n")
    space = load_search_space(str(path))
    assert smallest_world(space) == 7
    assert smallest_world(space.with_fixed({"placement": "colocated"})) == 1
    valid = [p for p in space.for_world(8).grid() if not space.for_world(8).problems_for(p)]
    assert {p["rollout_gpus"] for p in valid} == {4, 6}  # 8 prompts over 4 and 2 trainers
    path.write_text(path.read_text().replace("rollout_engine: vllm-like", "rollout_engine: hf"))
    with pytest.raises(ConfigError, match="an engine on GPUs of its own is a served one"):
        load_search_space(str(path))


SERVER = {"placement": "separate", "rollout_gpus": 4, "rollout_tensor_parallel": 4,
          "rollout_engine": "vllm-like", "gpu_memory_utilization": 0.9, "staleness": 0,
          "rollout_batch_size": 12, "rollout_n": 4, "global_batch_size": 12,
          "micro_batch_size_update": 4, "micro_batch_size_experience": 4,
          "max_prompt_length": 512, "max_response_length": 1024, "dynamic_batching": False,
          "fused_logprob": True, "fused_logprob_kernel": "trl", "max_num_seqs": 256}


def test_trl_server_mode_is_written_for_the_trainers_processes():
    """The engine's GPUs run `trl vllm-serve`, the rest `accelerate launch`: the per-process
    batches count the trainer's 4 processes (48 completions: 4 x 4 x 3), and the header says
    how to start each side."""
    from autotune.trainers.render import render_plan

    plan = plan_export(TRL, SERVER, Topology(1, 8), None, searched=["micro_batch_size_update"])
    assert plan.problems == [] and plan.trainers == Topology(1, 4)
    assert (plan.values["vllm_mode"], plan.values["gradient_accumulation_steps"]) == ("server", 3)
    text = render_plan(plan, TRL, None, ["test"])
    assert "#   CUDA_VISIBLE_DEVICES=0,1,2,3 trl vllm-serve --model <your model> " \
        "--tensor_parallel_size 4 --gpu_memory_utilization 0.9 --max_model_len 1536" in text
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7 accelerate launch --num_processes 4" in text
    colocated = plan_export(TRL, {**SERVER, "placement": "colocated", "rollout_gpus": 0},
                            Topology(1, 8), None)  # 48 completions over 8 x 4: no
    assert any("must be divisible by per_device_train_batch_size=4 x 8 processes" in p
               for p in colocated.problems)


@pytest.mark.parametrize("changes, topology, expected", [
    ({"rollout_tensor_parallel": 2}, Topology(1, 8), "runs one `trl vllm-serve`"),
    ({"staleness": 1}, Topology(1, 8), "staleness=1: GRPOTrainer's server mode syncs"),
    ({"rollout_gpus": 8, "rollout_tensor_parallel": 8, "rollout_batch_size": 16},
     Topology(2, 8), "writes TRL's server mode for one node"),
    ({"rollout_gpus": 4}, Topology(2, 8), "the engine takes whole nodes"),
])
def test_trl_server_mode_refuses_what_it_cannot_run(changes, topology, expected):
    problems = plan_export(TRL, {**SERVER, **changes}, topology, None).problems
    assert [p for p in problems if expected in p], problems


def test_a_server_mode_base_is_a_separate_placement():
    """A TRL base in server mode reads back as placement=separate: a colocated study on it
    is a conflict, not a silent switch to colocate."""
    base = {"use_vllm": True, "vllm_mode": "server", "num_generations": 4}
    colocated = {**SERVER, "placement": "colocated", "rollout_gpus": 0,
                 "rollout_tensor_parallel": 1, "rollout_batch_size": 16,
                 "global_batch_size": 16}
    problems = plan_export(TRL, colocated, Topology(1, 8), base,
                           searched=["micro_batch_size_update"]).problems
    assert [p for p in problems if p.startswith("placement (from use_vllm")
            and "is separate in your base config but the study measured colocated" in p]
    same = plan_export(TRL, SERVER, Topology(1, 8), {**base, "vllm_tensor_parallel_size": 4},
                       searched=["micro_batch_size_update"])
    assert same.problems == [] and same.values.get("vllm_mode", "server") == "server"


BASELINE = ProbeConfig(rollout_engine="vllm-like", rollout_batch_size=512, rollout_n=5,
                       global_batch_size=128, max_prompt_length=2048, max_response_length=2048,
                       gpu_memory_utilization=0.4, rollout_tensor_parallel=4,
                       micro_batch_size_update=2, micro_batch_size_experience=16)


def test_the_best_split_fits_both_roles_and_composes_its_step():
    """What `estimate` says the best split of a colocated config gives: each role's GPU
    within the budget as the roles model sizes it, its step composed by the pipeline from
    the time model's phases, and nothing faster among the knobs it may set on that split (all
    sized here, none pruned); an engine bound by its KV pool still finds the utilisation that
    fits; the whole nodes of a multi-node run; a budget under the leanest trainer, no split."""
    from autotune.estimates.split import (
        best_split,
        engine_variants,
        side_step,
        trainer_variants,
    )
    from autotune.estimates.throughput import Hardware, TimeModel
    from autotune.memory.roles import role_peak_bytes

    shape, times = model_shape("qwen2.5-7b"), TimeModel.calibrated()
    hardware, budget = Hardware.of(80 * GiB, 8), int(0.9 * 80 * GiB)
    answer = best_split(shape, BASELINE, hardware, "memory", budget, Topology(1, 8),
                        times=times)
    best = answer.best
    assert best is not None and best.config.separate and answer.fitting >= 1
    for role, peak in (("engine", best.engine_peak_bytes), ("trainer", best.trainer_peak_bytes)):
        assert peak == role_peak_bytes(shape, best.config, 8, best.config.rollout_gpus,
                                       80 * GiB, role) <= budget
    assert not validate_probe_config(best.config, 8)
    step = side_step(times, best.config, shape, hardware)
    assert best.step == step and best.step.step_s == pytest.approx(
        max(step.engine_s, step.trainer_s) + step.sync_s if best.config.staleness else
        step.engine_s + step.trainer_s + step.sync_s)
    assert answer.colocated_step_s == pytest.approx(times.step_s(BASELINE, shape, hardware))
    assert answer.ratio == pytest.approx(best.tokens_per_s_per_gpu
                                         / answer.colocated_tokens_per_s_per_gpu)
    # brute force on the chosen split: no engine and trainer knobs that fit run faster
    gpus = best.config.rollout_gpus
    on = BASELINE.replace(placement="separate", rollout_gpus=gpus, staleness=1)
    fastest = {}
    for role, variants in (("engine", engine_variants(BASELINE)),
                           ("trainer", trainer_variants(BASELINE))):
        fits = [c for c in (on.replace(**v) for v in variants)
                if not validate_probe_config(c, 8)
                and role_peak_bytes(shape, c, 8, gpus, 80 * GiB, role) <= budget]
        fastest[role] = min(getattr(side_step(times, c, shape, hardware), f"{role}_s")
                            for c in fits)
    assert best.step.engine_s == pytest.approx(fastest["engine"])
    assert best.step.trainer_s == pytest.approx(fastest["trainer"])
    # every split whose engine fits at some utilisation and whose leanest trainer fits is
    # sized (an engine over the budget at 0.9 of the GPU still fits at 0.75)
    sized = {o.config.rollout_gpus for o in answer.options}
    for gpus in range(1, 8):
        on = BASELINE.replace(placement="separate", rollout_gpus=gpus, staleness=1)
        engines = [c for c in (on.replace(**v) for v in engine_variants(BASELINE))
                   if not validate_probe_config(c, 8)]
        fits = [c for c in engines
                if role_peak_bytes(shape, c, 8, gpus, 80 * GiB, "engine") <= budget]
        leanest = on.replace(**trainer_variants(BASELINE)[0])
        trainer_fits = not validate_probe_config(leanest, 8) and role_peak_bytes(
            shape, leanest, 8, gpus, 80 * GiB, "trainer") <= budget
        assert (gpus in sized) == bool(fits and trainer_fits), gpus
        if fits and trainer_fits:
            assert any(role_peak_bytes(shape, c, 8, gpus, 80 * GiB, "engine") > budget
                       for c in engines) or gpus != 4  # what the old pruning lost
    # two nodes of 8: the engine takes a whole node or none
    two = best_split(shape, BASELINE.replace(rollout_batch_size=1024), Hardware.of(80 * GiB, 16),
                     "memory", budget, Topology(2, 8), times=times)
    assert two.best is not None and two.best.config.rollout_gpus == 8 and two.tried == 1
    # a budget under the leanest trainer: no split, said so
    starved = best_split(shape, BASELINE, hardware, "memory", 8 * GiB, Topology(1, 8),
                         times=times)
    assert starved.best is None and starved.fitting == 0
    assert "no split fits the 8.00 GiB budget, whatever its memory knobs" in "\n".join(
        starved.lines(8 * GiB))


def test_the_time_model_names_the_gpu_it_plans_for():
    """A GPU by its name (an H200's 141 GB, an A100's memory), else by its memory, else the
    baselines' H100; the baselines' own rows reproduce their published step times."""
    from autotune.estimates.throughput import FIT, TimeModel, gpu_spec

    assert gpu_spec("NVIDIA H200", 150754820096) == (gpu_spec(None, 141 * 10**9)[0], "named")
    assert gpu_spec("NVIDIA A100-SXM4-80GB", 80 * GiB)[0].name == "A100 80 GB"
    assert gpu_spec("NVIDIA A100-SXM4-40GB", 40 * GiB)[0].name == "A100 40 GB"
    assert gpu_spec("NVIDIA A100-PCIE-40GB", 40 * GiB)[0].name == "A100 40 GB"  # the A100s
    assert gpu_spec("NVIDIA H100 PCIe", 80 * GiB)[0].name == "H100 PCIe 80 GB"
    assert gpu_spec(None, 80 * GiB) == (gpu_spec("NVIDIA H100 80GB HBM3", 80 * GiB)[0],
                                        "memory")
    assert gpu_spec(None, 24 * GiB) == (gpu_spec(None, 80 * GiB)[0], "assumed")
    text = TimeModel.calibrated().describe()
    for row in FIT:
        assert f"{row.what:<20} fit            step {row.step_s:6.1f} s" in text


def test_estimate_says_what_the_best_split_would_give_a_colocated_config():
    command = [sys.executable, "-m", "autotune", "estimate", "--model", "qwen2.5-7b",
               "--gpus-per-node", "8", "--capacity", "80GiB"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "split placement, from the models" in out.stdout, out.stdout[-2000:]
    assert "best split: " in out.stdout and " engine + " in out.stdout
    document = json.loads(subprocess.run([*command, "--json"], capture_output=True, text=True,
                                         timeout=120).stdout)
    split = document["split"]
    assert split["gpu"] == "H100 SXM 80 GB" and split["gpu_how"] == "memory"
    assert 1 <= split["splits_fitting"] <= split["splits_tried"] <= 7
    assert split["best"]["rollout_gpus"] in range(1, 8)
    assert split["best"]["step_s"] > 0 and split["best"]["tokens_per_s_per_gpu"] > 0
    for args in (["--gpus-per-node", "1"],  # nothing to split; EasyR1 has no separate
                 ["--gpus-per-node", "8", "--trainer", "easyr1"],  # placement; the time
                 ["--gpus-per-node", "8", "--algorithm", "ppo"]):  # model has no critic
        one = subprocess.run([*command[:6], *args, "--capacity", "80GiB", "--json"],
                             capture_output=True, text=True, timeout=120)
        assert one.returncode == 0, one.stderr
        assert "split" not in json.loads(one.stdout), args
