"""The export is the run that was measured (issue 30): another topology, model, rollout engine,
reference-model setting or sequence-parallel size than the study's is a conflict, or with
--force a line under UNMEASURED in the file's header; the reference model and its offload are
written as probed; TRL's generation-batch arithmetic is followed. Bases are the trainers' real
default configs (tests/fixtures) or small files written here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from autotune.config import ProbeConfig, Topology
from autotune.errors import ConfigError
from autotune.registry import architecture_of
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.export_plan import plan_export
from autotune.trainers.measured import MeasuredRun
from autotune.trainers.render import load_trainer_yaml, render_plan
from autotune.trainers.trl import TRL
from autotune.trainers.verl import VERL

FIXTURES = Path(__file__).resolve().parent / "fixtures"
KNOBS = {"rollout_batch_size": 8, "rollout_n": 4, "global_batch_size": 4,
         "micro_batch_size_update": 2, "micro_batch_size_experience": 4,
         "gradient_checkpointing": True, "offload_params": False, "offload_optimizer": False,
         "max_prompt_length": 64, "max_response_length": 64, "rollout_tensor_parallel": 1,
         "rollout_engine": "vllm-like", "gpu_memory_utilization": 0.5, "enable_sleep": True,
         "max_num_batched_tokens": 8192, "max_num_seqs": 256, "sleep_level": 1,
         "use_kl": True, "offload_ref_params": None, "val_batch_size": None}
SEARCHED = ("micro_batch_size_update", "micro_batch_size_experience", "offload_params")
RUN = MeasuredRun(Topology(1, 8), "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct")


def written(text: str) -> dict:
    return yaml.safe_load(text) or {}


def base_file(tmp_path: Path, text: str, name: str = "base.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_trainer_yaml(str(path))


def test_another_topology_is_refused_and_forced_it_is_said_unmeasured():
    for adapter in (VERL, EASYR1, TRL):
        plan = plan_export(adapter, KNOBS, Topology(1, 1), None, SEARCHED, run=RUN)
        assert plan.problems[0].startswith(
            "topology: the study measured 1 node(s) x 8 GPU(s) but the export is for 1 x 1"), \
            adapter.name
        assert "--nnodes 1 --gpus-per-node 1" in plan.problems[0]
        forced = plan_export(adapter, KNOBS, Topology(1, 1), None, SEARCHED, force=True,
                             run=RUN)
        text = render_plan(forced, adapter, None, ["p", ""])
        assert "# UNMEASURED (exported with --force; not the run the study measured):\n" \
               "#   topology 1 x 1: the study measured 1 x 8" in text
        same = plan_export(adapter, KNOBS, Topology(1, 8), None, SEARCHED, run=RUN)
        assert not any(line.startswith("topology") for line in same.problems)


def test_the_reference_model_and_its_offload_are_exported_as_probed(tmp_path):
    knobs = {**KNOBS, "offload_params": True}  # the reference followed the actor to the host
    verl = written(render_plan(plan_export(VERL, knobs, Topology(1, 8), None, SEARCHED,
                                           run=RUN), VERL, None, ["p", ""]))
    actor_ref = verl["actor_rollout_ref"]
    assert actor_ref["actor"]["use_kl_loss"] is True  # verl builds no reference otherwise
    assert actor_ref["ref"]["fsdp_config"]["param_offload"] is True
    easy = written(render_plan(plan_export(EASYR1, knobs, Topology(1, 8), None, SEARCHED,
                                           run=RUN), EASYR1, None, ["p", ""]))
    assert easy["worker"]["ref"]["offload"]["offload_params"] is True
    assert easy["algorithm"]["disable_kl"] is False
    trl = written(render_plan(plan_export(TRL, {**KNOBS, "rollout_engine": "hf"},
                                          Topology(1, 8), None, SEARCHED, run=RUN),
                              TRL, None, ["p", ""]))
    assert trl["beta"] == 0.04  # TRL's default 0.0 builds no reference model
    no_ref = plan_export(VERL, {**KNOBS, "use_kl": False}, Topology(1, 8), None, SEARCHED)
    assert no_ref.values["actor_rollout_ref.actor.use_kl_loss"] is False
    assert no_ref.values["algorithm.use_kl_in_reward"] is False
    # a base without KL (verl's default) while the study held a reference: a conflict
    base = base_file(tmp_path, "actor_rollout_ref:\n  actor:\n    use_kl_loss: false\n")
    plan = plan_export(VERL, knobs, Topology(1, 8), base[0], SEARCHED)
    assert any(line.startswith("use_kl (from actor_rollout_ref.actor.use_kl_loss and "
                               "algorithm.use_kl_in_reward) is false in your base config but "
                               "the study measured true") for line in plan.problems)
    # EasyR1's example keeps the reference on the host through FSDP's CPU offload: a study
    # that did the same writes nothing there, one that did not turns both off, and says so
    easy_base = load_trainer_yaml(str(FIXTURES / "easyr1-config.yaml"))
    plan = plan_export(EASYR1, knobs, Topology(1, 8), easy_base[0], None)
    assert not any(key.startswith("worker.ref.") for key in plan.values)
    plan = plan_export(EASYR1, {**knobs, "offload_params": False}, Topology(1, 8),
                       easy_base[0], None)
    assert plan.values["worker.ref.fsdp.enable_cpu_offload"] is False
    assert "  worker.ref.fsdp.enable_cpu_offload: true -> false (searched)" in plan.changes


def test_the_engine_is_the_one_probed():
    hf = {**KNOBS, "rollout_engine": "hf"}
    for adapter in (VERL, EASYR1):
        plan = plan_export(adapter, hf, Topology(1, 8), None, SEARCHED, run=RUN)
        assert plan.problems == [
            f"rollout engine: the study probed the hf engine, but {adapter.name} generates "
            "with vLLM, which the vllm-like engine stands for: re-run the sweep for that run "
            "with --engine vllm-like (on a CPU with --gpu-memory-limit), or pass --force to "
            "export it anyway (the file's header then says it is unmeasured)"]
        forced = plan_export(adapter, hf, Topology(1, 8), None, SEARCHED, force=True, run=RUN)
        assert forced.unmeasured == [f"rollout engine: the study probed the hf engine; "
                                     f"{adapter.name}'s vLLM reserves its own "
                                     "gpu_memory_utilization, which no probe measured"]
        # a vllm-like study writes its reservation, whatever the base says
        plan = plan_export(adapter, KNOBS, Topology(1, 8), None, SEARCHED, run=RUN)
        assert 0.5 in [value for key, value in plan.values.items()
                       if key.endswith("gpu_memory_utilization")]
    # TRL: the hf engine is its default generation; vllm-like is its colocated vLLM
    assert plan_export(TRL, hf, Topology(1, 8), None, SEARCHED, run=RUN).values["use_vllm"] \
        is False
    trl = plan_export(TRL, {**KNOBS, "rollout_tensor_parallel": 2}, Topology(1, 8), None,
                      SEARCHED, run=RUN)
    assert trl.problems == []
    assert {key: trl.values[key] for key in ("use_vllm", "vllm_mode", "vllm_tensor_parallel_size",
                                             "vllm_gpu_memory_utilization",
                                             "vllm_enable_sleep_mode")} == {
        "use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 2,
        "vllm_gpu_memory_utilization": 0.5, "vllm_enable_sleep_mode": True}


def test_another_model_in_the_base_is_a_conflict(tmp_path):
    # the registry knows a model by its name and by its Hugging Face ids, base or instruct
    assert architecture_of("Qwen/Qwen2.5-7B") == architecture_of("qwen2.5-7b") \
        == architecture_of("Qwen/Qwen2.5-7B-Instruct")
    assert architecture_of("Qwen/Qwen2.5-3B-Instruct") != architecture_of("qwen2.5-7b")
    assert architecture_of("meta-llama/Llama-3.1-8B") is None  # not known here
    local = tmp_path / "ckpt"
    local.mkdir()
    local.joinpath("config.json").write_text(json.dumps(
        {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
         "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064}))
    assert architecture_of(str(local)) == architecture_of("qwen2.5-7b")
    base = load_trainer_yaml(str(FIXTURES / "easyr1-config.yaml"))
    for named, same, verdict in (("Qwen/Qwen2.5-7B-Instruct", True, None),
                                 ("Qwen/Qwen2.5-3B-Instruct", False, "is another model"),
                                 ("org/unknown-7b", None, "a model autotune cannot compare")):
        run = MeasuredRun(Topology(1, 8), "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", named,
                          same)
        plan = plan_export(EASYR1, {**KNOBS, "rollout_batch_size": 512, "rollout_n": 5,
                                    "global_batch_size": 128, "max_prompt_length": 2048,
                                    "max_response_length": 2048, "rollout_tensor_parallel": 2},
                           Topology(1, 8), base[0], None, run=run)
        model_lines = [line for line in plan.problems if line.startswith("worker.actor.model")]
        if verdict is None:
            assert model_lines == []
        else:
            assert len(model_lines) == 1 and verdict in model_lines[0]
            assert "but the study measured qwen2.5-7b: re-run the sweep" in model_lines[0]
    # without a base, the file names the study's model; a tiny one has no checkpoint to name
    plan = plan_export(VERL, KNOBS, Topology(1, 8), None, SEARCHED, run=RUN)
    assert plan.values["actor_rollout_ref.model.path"] == "Qwen/Qwen2.5-7B-Instruct"
    tiny = plan_export(VERL, KNOBS, Topology(1, 8), None, SEARCHED,
                       run=MeasuredRun(Topology(1, 8), "tiny-qwen2.5", None))
    assert "actor_rollout_ref.model.path" not in tiny.values
    assert tiny.run[0] == ("model: the study measured tiny-qwen2.5, built with random weights: "
                           "set actor_rollout_ref.model.path to a checkpoint of its shapes")


def test_sequence_parallelism_in_a_base_is_held_or_refused_and_forced_it_is_stated(tmp_path):
    """Ulysses SP is a knob: a base that sets it is a held-fixed conflict with a study that
    ran without it (--force writes the study's, and the header says what changed), and a
    sweep on that base probes it (the knob read from the base)."""
    easy = base_file(tmp_path, (FIXTURES / "easyr1-config.yaml").read_text()
                     .replace("ulysses_size: 1", "ulysses_size: 2"), "easy.yaml")
    knobs = {**KNOBS, "rollout_batch_size": 512, "rollout_n": 5, "global_batch_size": 128,
             "max_prompt_length": 2048, "max_response_length": 2048,
             "rollout_tensor_parallel": 2, "dynamic_batching": True}
    searched = [*knobs, "use_kl", "offload_ref_params"]  # all but SP: held at 1 (no knob yet)
    plan = plan_export(EASYR1, knobs, Topology(1, 8), easy[0], searched)
    assert plan.problems == [
        "worker.actor.ulysses_size is 2 in your base config but the study measured 1 (held "
        "fixed, not searched): re-run the sweep with this --base-config so it measures your "
        "shapes, or pass --force to export the study's"]
    forced = plan_export(EASYR1, knobs, Topology(1, 8), easy[0], searched, force=True)
    assert forced.values["worker.actor.ulysses_size"] == 1
    assert "  worker.actor.ulysses_size: 2 -> 1 (held fixed)" in forced.changes
    verl = base_file(tmp_path, "actor_rollout_ref:\n  actor:\n    "
                     "ulysses_sequence_parallel_size: 2\nalgorithm:\n  adv_estimator: grpo\n",
                     "verl.yaml")
    plan = plan_export(VERL, KNOBS, Topology(1, 8), verl[0], [*KNOBS])
    assert any(line.startswith("actor_rollout_ref.actor.ulysses_sequence_parallel_size is 2 "
                               "in your base config but the study measured 1")
               for line in plan.problems), plan.problems
    # a sweep on such a base holds the base's SP (the knob, probed that way)
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.space.trainer_target import trainer_target

    _, start, _, _ = trainer_target("easyr1", str(tmp_path / "easy.yaml"),
                                    load_search_space("easyr1"), None, None)
    assert start["ulysses_sequence_parallel_size"] == 2


def test_trl_follows_its_generation_batch_arithmetic(tmp_path):
    # steps_per_generation 4 x 8 per device x 1 process = 32 completions per generation: the
    # study's 8 prompts x 4; the optimizer step 8 x 2 accumulation / 4 = 4 prompts
    base = base_file(tmp_path, "num_generations: 4\nmax_completion_length: 64\n"
                     "per_device_train_batch_size: 8\ngradient_accumulation_steps: 2\n"
                     "steps_per_generation: 4\n")
    knobs = {**KNOBS, "rollout_engine": "hf", "micro_batch_size_update": 8, "use_kl": False}
    plan = plan_export(TRL, knobs, Topology(1, 1), base[0], SEARCHED)
    assert plan.problems == []
    assert "generation_batch_size" not in plan.values  # the base's spelling is kept
    # another micro-batch: the accumulation follows, and steps_per_generation gives way to
    # generation_batch_size (TRL refuses both set)
    plan = plan_export(TRL, {**knobs, "micro_batch_size_update": 4}, Topology(1, 1), base[0],
                       SEARCHED)
    assert plan.problems == []
    assert (plan.values["gradient_accumulation_steps"], plan.values["generation_batch_size"],
            plan.values["steps_per_generation"]) == (4, 32, None)
    # GRPOConfig has no prompt length: the header says what the data must hold
    assert plan.run[0] == ("prompts: GRPOConfig (TRL 1.x) has no prompt length; the study "
                           "probed prompts of 64 tokens: keep your data set's prompts within "
                           "that")
    # a study probed with the whole logits and an engine copy of the weights: TRL's fused
    # head and generation by the trained model are stated, not silent
    assert [line.split(":")[0] for line in plan.run] == ["prompts", "log-probs", "generation"]
    # probed as TRL runs (its head, the policy generating): nothing more to say
    as_trl = {**knobs, "rollout_engine": "policy", "fused_logprob": True,
              "fused_logprob_kernel": "trl", "micro_batch_size_experience": 8}
    plan = plan_export(TRL, as_trl, Topology(1, 1), base[0], SEARCHED)
    assert [line.split(":")[0] for line in plan.run] == ["prompts"]
    # log-probs scored at another micro-batch than TRL's (its per_device_train_batch_size)
    plan = plan_export(TRL, {**as_trl, "micro_batch_size_experience": 4}, Topology(1, 1),
                       base[0], SEARCHED)
    assert plan.run[1] == (
        "log-prob micro-batch: the study took its old and reference log-probs 4 sequences at "
        "a time; GRPOTrainer takes them per_device_train_batch_size (8) at a time, so its "
        "experience phase holds more than measured (a --trainer trl sweep probes them equal)")
    # offload has no GRPOConfig key: the line names the knob to hold in a re-run
    refused = plan_export(TRL, {**knobs, "offload_params": True}, Topology(1, 1), None,
                          SEARCHED)
    assert "re-run the sweep with --set offload_params=false to hold it off for TRL" \
        in refused.problems[0]


def test_the_demo_study_exports_for_every_trainer(tmp_path):
    """The CPU demo's study (cpu-demo, hf engine, no reference offload key in TRL): TRL takes
    the best trial it can run and says why the best cannot; verl and EasyR1 generate with
    vLLM, which the hf engine did not measure: refused in one line, forced with UNMEASURED."""
    import subprocess
    import sys

    from scripted_runner import model_study

    from autotune.sweep.pick.artifacts import ranked_feasible
    from autotune.sweep.study.storage import load_study

    model_study(tmp_path, "demo", trials=12)
    ranked = ranked_feasible(load_study(str(tmp_path), "demo"))

    def export(trainer, *args):
        out = tmp_path / f"{trainer}{len(args)}.yaml"
        done = subprocess.run([sys.executable, "-m", "autotune", "export", "--study", "demo",
                               "--results-dir", str(tmp_path), "--trainer", trainer,
                               "--out", str(out), *args], capture_output=True, text=True)
        return done, out

    done, out = export("trl")
    assert done.returncode == 0, done.stderr
    runnable = next(t for t in ranked if not t.params["offload_params"]
                    and not t.params["offload_optimizer"])
    text = out.read_text()
    assert f"# study demo, trial {runnable.number}:" in text
    assert written(text)["per_device_train_batch_size"] == \
        runnable.params["micro_batch_size_update"]
    if runnable is not ranked[0]:
        assert f"# the study's best, trial {ranked[0].number}, cannot run on trl (" in text
        assert f"this is the best trial it can run, trial {runnable.number}" in done.stdout
    for trainer in ("verl", "easyr1"):
        done, out = export(trainer)
        assert done.returncode == 2 and not out.exists()
        assert done.stderr.startswith("Error: rollout engine: the study probed the hf engine")
        done, out = export(trainer, "--force")
        assert done.returncode == 0, done.stderr
        assert "# UNMEASURED (exported with --force" in out.read_text()


def test_trl_colocated_vllm_states_what_grpo_config_cannot_set(tmp_path):
    """TRL's colocated vLLM prefills 4,096 tokens, sleeps at level 2 and runs
    per_device_train_batch_size x TP x steps_per_generation sequences: where the study's
    engine ran otherwise, the header says so (GRPOConfig has no key to set them)."""
    knobs = {**KNOBS, "rollout_engine": "vllm-like", "use_kl": False, "offload_params": False}
    plan = plan_export(TRL, knobs, Topology(1, 1), None, SEARCHED)
    # 8 prompts x 4 / (2 per device x 1 process) = 16 steps per generation: 32 sequences
    assert [line for line in plan.run if line.startswith("rollout:")] == [
        "rollout: TRL's colocated vLLM runs max_num_batched_tokens=4096 (no GRPOConfig key); "
        "the study's engine ran 8192",
        "rollout: TRL's colocated vLLM runs max_num_seqs=32 (no GRPOConfig key); the study's "
        "engine ran 256",
        "rollout: TRL's colocated vLLM runs sleep_level=2 (no GRPOConfig key); the study's "
        "engine ran 1"]
    same = plan_export(TRL, {**knobs, "max_num_batched_tokens": 4096, "max_num_seqs": 32,
                             "sleep_level": 2}, Topology(1, 1), None, SEARCHED)
    assert not any(line.startswith("rollout:") for line in same.run)
    # a base whose vLLM runs on GPUs of its own (server mode: placement=separate, which
    # exports write) cannot be probed yet: one line
    from autotune.trainers.render import trainer_start

    server = tmp_path / "grpo.yaml"
    server.write_text("use_vllm: true\nvllm_mode: server\n")
    with pytest.raises(ConfigError) as err:
        trainer_start(TRL, str(server), None, None)
    assert err.value.problems == [
        f"{server}: use_vllm and vllm_mode and vllm_tensor_parallel_size: the engine runs on "
        "GPUs of its own (placement=separate), which a sweep of a trainer's config does not "
        "probe yet (a split probe runs from a space fixing it, on a CPU): sweep a copy that "
        "colocates it, and size each side with `autotune estimate --set placement=separate "
        "--set rollout_gpus=N`"]


def test_the_allocator_the_study_trained_with_is_stated_where_the_trainer_differs():
    """verl trains with the CUDA allocator's expandable segments on (a verl study on a GPU
    probes so); EasyR1's runtime env and TRL's default run without. No key sets it, so where
    the study's differs the header says so, and where it matches nothing is said. On an H200
    the segments took a 7B rank's update from 36.0 to 30.8 GiB (benchmarks/results/gpu)."""
    def allocator_lines(adapter, segments):
        plan = plan_export(adapter, {**KNOBS, "expandable_segments": segments}, Topology(1, 1),
                           None, SEARCHED)
        return [line for line in plan.run if line.startswith("allocator:")]

    assert allocator_lines(VERL, True) == [] and allocator_lines(EASYR1, False) == [] \
        and allocator_lines(TRL, False) == []
    assert "verl trains with the CUDA allocator's expandable segments on" in \
        allocator_lines(VERL, False)[0]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in allocator_lines(EASYR1, True)[0]
    assert "launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in \
        allocator_lines(TRL, True)[0]
    # a study that never named the allocator (a CPU study, one from before the knob): silent
    plan = plan_export(VERL, KNOBS, Topology(1, 1), None, SEARCHED)
    assert not any(line.startswith("allocator:") for line in plan.run)


def test_a_verl_study_takes_the_entropy_and_on_a_gpu_expandable_segments_unless_named():
    from autotune.sweep.plan import trainer_knobs, verl_triton_installed

    kernel = {"fused_logprob_kernel": "triton"} if verl_triton_installed() else {}
    fsdp1 = {"fsdp_strategy": "fsdp"}  # verl's default strategy, EasyR1's only wrapper
    assert trainer_knobs("verl", on_gpu=True) == {"expandable_segments": True,
                                                  "entropy_metric": True, **kernel, **fsdp1}
    assert trainer_knobs("verl", True, frozenset({"expandable_segments", "entropy_metric",
                                                  "fused_logprob_kernel",
                                                  "fsdp_strategy"})) == {}
    # a CPU probe has no CUDA allocator; verl's old-log-prob pass takes the entropy anywhere
    assert trainer_knobs("verl", on_gpu=False) == {"entropy_metric": True, **fsdp1}
    assert trainer_knobs("easyr1", True) == fsdp1 and trainer_knobs(None, True) == {}
    # TRL 1.x: its fused LM head and HF Trainer's fused AdamW, on any device, unless named
    trl = {"fused_logprob": True, "fused_logprob_kernel": "trl", "fused_optimizer": True}
    assert trainer_knobs("trl", True) == trl == trainer_knobs("trl", False)
    assert trainer_knobs("trl", True, frozenset(trl)) == {}


@pytest.mark.parametrize("adapter", [EASYR1, VERL, TRL], ids=lambda a: a.name)
def test_a_kv_budget_in_bytes_no_trainer_can_set_is_stated(adapter):
    knobs = {**KNOBS, "rollout_engine": "vllm", "use_kl": False,
             "kv_cache_memory_bytes": 64 << 20}
    plan = plan_export(adapter, knobs, Topology(1, 1), None, SEARCHED)
    stated = [line for line in plan.run if "kv_cache_memory_bytes" in line]
    assert stated == [
        "rollout: the study's engine had a KV pool of 64 MiB (kv_cache_memory_bytes); "
        f"{adapter.name} has no key for it: its vLLM sizes the pool from "
        f"gpu_memory_utilization={knobs['gpu_memory_utilization']} of the GPU, so the "
        "rollout's memory and speed differ from what was measured"]
    without = plan_export(adapter, {**knobs, "kv_cache_memory_bytes": None}, Topology(1, 1),
                          None, SEARCHED)
    assert not any("kv_cache_memory_bytes" in line for line in without.run)


def test_trl_takes_the_old_log_probs_as_the_study_probed():
    """GRPOTrainer runs an old-log-prob forward only where a generation is used more than
    once: num_iterations > 1, or a generation batch over several optimizer steps. A study
    that probed the pass at one optimizer step a generation is exported with num_iterations
    2; one that probed without it with TRL's 1; none (TRL's own rule) writes nothing."""
    one_step = {**KNOBS, "rollout_engine": "hf", "use_kl": False, "global_batch_size": 8}

    def export(knobs: dict) -> dict:
        return written(render_plan(plan_export(TRL, knobs, Topology(1, 8), None, SEARCHED,
                                               run=RUN), TRL, None, ["p", ""]))

    assert export({**one_step, "old_logprob_pass": True})["num_iterations"] == 2
    assert export({**one_step, "old_logprob_pass": False})["num_iterations"] == 1
    assert "num_iterations" not in export({**one_step, "old_logprob_pass": None})
    assert export({**KNOBS, "rollout_engine": "hf",  # two optimizer steps a generation
                   "old_logprob_pass": True})["num_iterations"] == 1

    def read(values: dict) -> bool | None:
        return TRL.read_knobs(lambda key, default: values.get(key, default),
                              Topology(1, 8))["old_logprob_pass"]

    assert read({"num_iterations": 3}) is True and read({}) is None


def test_verl_and_easyr1_refuse_a_study_that_skipped_the_old_log_prob_pass():
    """verl and EasyR1 always take the old log-probs in a forward of their own: a study that
    probed without it measured less than they hold, and is refused, not exported."""
    for adapter in (VERL, EASYR1):
        knobs = {**KNOBS, "global_batch_size": 8, "old_logprob_pass": False}
        assert any("old_logprob_pass" in line
                   for line in adapter.check(ProbeConfig(**knobs), Topology(1, 8)))
        assert not any("old_logprob_pass" in line for line in adapter.check(
            ProbeConfig(**{**knobs, "old_logprob_pass": True}), Topology(1, 8)))


def test_trl_old_log_prob_pass_round_trips_to_what_was_probed():
    """Whatever a study probed (the pass on, off, or TRL's rule), the exported GRPOConfig
    read back runs the old-log-prob forward exactly where the probe did."""
    from autotune.config import old_pass_runs

    for rbs in (8, 16):  # one optimizer step a generation, and two
        for flag in ((True, False, None) if rbs == 8 else (True, None)):
            knobs = {**KNOBS, "rollout_engine": "hf", "use_kl": False,
                     "rollout_batch_size": rbs, "global_batch_size": 8,
                     "old_logprob_pass": flag}
            values = written(render_plan(plan_export(TRL, knobs, Topology(1, 8), None,
                                                     SEARCHED, run=RUN), TRL, None, ["p", ""]))
            read = TRL.read_knobs(lambda key, default, values=values: values.get(key, default),
                                  Topology(1, 8))
            assert old_pass_runs(read["old_logprob_pass"], read["rollout_batch_size"],
                                 read["global_batch_size"]) == \
                old_pass_runs(flag, rbs, 8), (rbs, flag, values)


def test_a_trl_sweep_scores_log_probs_at_its_train_micro_batch():
    """GRPOTrainer takes old and reference log-probs per_device_train_batch_size at a time:
    every trial of a --trainer trl sweep is probed so (the adapter's tie, applied by the
    space), whatever the space leaves micro_batch_size_experience at; verl's are not tied."""
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.space.trainer_target import trainer_target

    _, _, space, _ = trainer_target("trl", None, load_search_space("trl"), 1, 1)
    for mbu in (1, 4, 16):
        config = space.config_for({"micro_batch_size_update": mbu})
        assert config.micro_batch_size_experience == mbu
    _, _, verl, _ = trainer_target("verl", None, load_search_space("verl"), 1, 8)
    assert verl.config_for({"micro_batch_size_update": 1}).micro_batch_size_experience \
        == ProbeConfig().micro_batch_size_experience


def test_a_trl_study_records_the_log_prob_micro_batch_its_probes_ran(tmp_path):
    """A --trainer trl sweep over a space that searches micro_batch_size_experience: each
    probe runs it tied to the update micro-batch, and the trial's record, trials.csv,
    best.yaml and the progress line show that value, not the one sampled (a real SQLite
    study, the memory model's runner)."""
    import csv

    from scripted_runner import ModelRunner

    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.pick.artifacts import best_trial, trial_knobs, write_artifacts
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.space.trainer_target import trainer_target
    from autotune.sweep.study.settings import SweepSettings
    from autotune.sweep.study.storage import load_study
    from autotune.sweep.tuner import Sweep

    _, _, space, _ = trainer_target("trl", None, load_search_space("cpu-demo"), 1, 1)
    assert "micro_batch_size_experience" in space.params  # sampled, then tied
    runner = ModelRunner(limit_bytes=2**40)
    settings = SweepSettings(study_name="trl", study_dir=tmp_path / "trl", space=space,
                             request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                             max_trials=10, sampler="random")
    Sweep(settings, runner).run()
    assert runner.calls and all(c["micro_batch_size_experience"] == c["micro_batch_size_update"]
                                for c in runner.calls)
    study = load_study(str(tmp_path), "trl")
    write_artifacts(study, tmp_path / "trl")
    rows = list(csv.DictReader((tmp_path / "trl" / "trials.csv").open()))
    probed = [row for row in rows if row["status"]]
    assert probed and all(row["micro_batch_size_experience"] == row["micro_batch_size_update"]
                          for row in probed), rows
    sampled_otherwise = [t for t in study.trials if t.params["micro_batch_size_experience"]
                         != t.params["micro_batch_size_update"]]
    assert sampled_otherwise  # the sampler did draw other values: the record ties them
    assert all(t.user_attrs["tied"] == {"micro_batch_size_experience":
                                        t.params["micro_batch_size_update"]}
               for t in sampled_otherwise)
    best = yaml.safe_load((tmp_path / "trl" / "best.yaml").read_text())
    assert best["config"]["micro_batch_size_experience"] == \
        best["config"]["micro_batch_size_update"]
    knobs, _ = trial_knobs(study, best_trial(study))
    assert knobs["micro_batch_size_experience"] == knobs["micro_batch_size_update"]
    # `autotune show` and the report's trial view read the same record
    from autotune.report.view import trial_view
    from autotune.sweep.study.sharing import ran_params

    for trial in sampled_otherwise:
        shown = trial_view(trial).params
        assert shown == ran_params(trial) and shown["micro_batch_size_experience"] == \
            trial.params["micro_batch_size_update"]


def test_trls_optimizer_round_trips_and_another_is_refused(tmp_path):
    """fused_optimizer is TRL's `optim`: written as the probe stepped and read back; an
    optimizer no probe runs (8-bit, paged) is refused at export and before a sweep on that
    base; a study recorded before the knob stepped torch's default AdamW, written as such."""
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.space.trainer_target import trainer_target
    from autotune.trainers.render import dotted_get

    knobs = {**KNOBS, "rollout_engine": "policy", "use_kl": False,
             "micro_batch_size_experience": 2}
    for fused, optim in ((True, "adamw_torch_fused"), (False, "adamw_torch")):
        plan = plan_export(TRL, {**knobs, "fused_optimizer": fused}, Topology(1, 1), None,
                           (*SEARCHED, "fused_optimizer"))
        assert plan.problems == [] and plan.values["optim"] == optim
        read = TRL.read_knobs(lambda key, default, plan=plan: dotted_get(plan.values, key,
                                                                         default),
                              Topology(1, 1))
        assert read["fused_optimizer"] is fused
    # TRL's default (no optim key) is the fused kernel: a fused study writes nothing, an old
    # study (no knob) writes torch's default step it measured
    base = base_file(tmp_path, "num_generations: 4\nper_device_train_batch_size: 2\n")
    assert "optim" not in plan_export(TRL, {**knobs, "fused_optimizer": True}, Topology(1, 1),
                                      base[0], SEARCHED).values
    assert plan_export(TRL, knobs, Topology(1, 1), base[0], SEARCHED).values["optim"] \
        == "adamw_torch"
    eight_bit = base_file(tmp_path, "num_generations: 4\nper_device_train_batch_size: 8\n"
                          "optim: adamw_8bit\n", "eight.yaml")
    refused = plan_export(TRL, {**knobs, "fused_optimizer": True}, Topology(1, 1),
                          eight_bit[0], SEARCHED)
    assert any(line.startswith("optim is adamw_8bit in your base config: the probe steps "
                               "torch's AdamW") for line in refused.problems), refused.problems
    with pytest.raises(ConfigError, match="optim is adamw_8bit in your base config"):
        trainer_target("trl", str(tmp_path / "eight.yaml"), load_search_space("trl"), 1, 1)


STUDY_KINDS = {  # what a study may have held: each kind's knobs over KNOBS, and the trainers
    # that take it (the others refuse it at the first export, as other tests check)
    "grpo, the pass over several steps": ({"old_logprob_pass": True}, "verl easyr1 trl"),
    "grpo, the batches decide the pass": ({"old_logprob_pass": None}, "verl easyr1 trl"),
    "grpo, one step a generation": ({"global_batch_size": 8, "old_logprob_pass": True},
                                    "verl easyr1 trl"),
    "lora": ({"lora_rank": 16, "lora_alpha": 32, "lora_target_modules": "q_proj,v_proj",
              "old_logprob_pass": True}, "verl easyr1 trl"),
    "lora, all linear": ({"lora_rank": 8, "lora_alpha": 16,
                          "lora_target_modules": "all-linear"}, "verl easyr1 trl"),
    "no kl": ({"use_kl": False}, "verl easyr1 trl"),
    "the policy's own generate": ({"rollout_engine": "hf"}, "trl"),
    "offloaded": ({"offload_params": True, "offload_optimizer": True}, "verl easyr1"),
}


@pytest.mark.parametrize("kind", STUDY_KINDS)
@pytest.mark.parametrize("adapter", [VERL, EASYR1, TRL], ids=lambda a: a.name)
def test_an_export_used_as_the_base_of_the_next_is_the_same_run(tmp_path, adapter, kind):
    """A study's own export given back as --base-config, unforced: no refusal (a LoRA study's
    TRL file, which writes num_iterations 1 where the generation feeds two optimizer steps,
    was read back as "old_logprob_pass is null" and refused) and nothing changed."""
    changes, takes = STUDY_KINDS[kind]
    knobs = {**KNOBS, **changes}
    first = plan_export(adapter, knobs, Topology(1, 8), None, SEARCHED, run=RUN)
    if adapter.name not in takes.split():
        assert first.problems, kind  # refused from the first export on, never half-taken
        return
    assert first.problems == [], first.problems
    path = tmp_path / "exported.yaml"
    path.write_text(render_plan(first, adapter, None, ["p", ""]))
    again = plan_export(adapter, knobs, Topology(1, 8), load_trainer_yaml(str(path))[0],
                        SEARCHED, run=RUN)
    assert again.problems == [], again.problems
    assert again.changes == [], again.changes
