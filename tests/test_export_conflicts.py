"""What an export must not do silently (issue 18): overwrite values the user's base config
holds for knobs the study never searched, switch the trainer's batching silently, or write a
config the trainer rejects for a rule the adapters missed (TRL's evaluation batch, EasyR1's
generation rounds, verl's critic). The bases are the trainers' real default configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.config import ProbeConfig, Topology
from autotune.errors import ConfigError
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.export_plan import plan_export, refused_settings
from autotune.trainers.measured import MeasuredRun
from autotune.trainers.render import dotted_get, load_trainer_yaml, render, render_plan
from autotune.trainers.trl import TRL
from autotune.trainers.verl import VERL

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EASYR1_BASE, VERL_BASE = FIXTURES / "easyr1-config.yaml", FIXTURES / "verl-ppo-trainer.yaml"
# a cpu-demo study's best: its shapes are fixed, only the memory knobs were searched
STUDY = {"rollout_batch_size": 4, "rollout_n": 4, "global_batch_size": 2,
         "micro_batch_size_update": 2, "micro_batch_size_experience": 4,
         "gradient_checkpointing": True, "offload_params": False, "offload_optimizer": False,
         "max_prompt_length": 64, "max_response_length": 64, "rollout_tensor_parallel": 1,
         "rollout_engine": "hf", "gpu_memory_utilization": 0.6, "val_batch_size": None}
SEARCHED = ("micro_batch_size_update", "micro_batch_size_experience", "gradient_checkpointing",
            "offload_params", "offload_optimizer")


def one_gpu(path: Path, tmp_path: Path, **replace: str) -> tuple:
    text = path.read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    copy = tmp_path / path.name
    copy.write_text(text)
    return load_trainer_yaml(str(copy))


def test_values_the_study_held_fixed_are_never_overwritten_silently(tmp_path):
    base = one_gpu(EASYR1_BASE, tmp_path, **{"tensor_parallel_size: 2": "tensor_parallel_size: 1",
                                             "n_gpus_per_node: 8": "n_gpus_per_node: 1"})
    with pytest.raises(ConfigError) as err:
        render(EASYR1, STUDY, Topology(1, 1), base, ["p", ""], searched=SEARCHED)
    fixed = [line for line in err.value.problems if "held fixed" in line]
    assert fixed[0] == (
        "data.rollout_batch_size is 512 in your base config but the study measured 4 (held "
        "fixed, not searched): re-run the sweep with this --base-config so it measures your "
        "shapes, or pass --force to export the study's")
    assert {line.split(" is ")[0] for line in fixed} == {
        "data.rollout_batch_size", "worker.rollout.n", "worker.actor.global_batch_size",
        "data.max_prompt_length", "data.max_response_length",
        "worker.actor.dynamic_batching"}  # the study ran fixed micro-batches, the base budgets
    # --force takes the study's values, and the header says so, key by key
    text = render(EASYR1, STUDY, Topology(1, 1), base, ["p", ""], searched=SEARCHED,
                  force=True)
    assert "#   data.rollout_batch_size: 512 -> 4 (held fixed)\n" in text
    assert "#   worker.actor.micro_batch_size_per_device_for_update: 1 -> 2 (searched)\n" in text
    assert yaml.safe_load(text)["data"]["rollout_batch_size"] == 4
    # the hf engine's probe never ran vLLM's reservation: the user's is kept, not "0.6"
    assert "gpu_memory_utilization" not in text.split("#\n", 1)[0]
    # a base holding the study's own shapes is no conflict (what `run --base-config` makes)
    same = one_gpu(EASYR1_BASE, tmp_path, **{"tensor_parallel_size: 2": "tensor_parallel_size: 1",
                                             "n_gpus_per_node: 8": "n_gpus_per_node: 1"})
    mine = {**STUDY, "rollout_batch_size": 512, "rollout_n": 5, "global_batch_size": 128,
            "micro_batch_size_update": 2, "micro_batch_size_experience": 2,
            "max_prompt_length": 2048, "max_response_length": 2048, "dynamic_batching": True}
    plan = plan_export(EASYR1, mine, Topology(1, 1), same[0], searched=SEARCHED)
    assert plan.problems == []


def test_trl_and_verl_fixed_values_are_conflicts_too(tmp_path):
    trl_base = tmp_path / "grpo.yaml"
    trl_base.write_text("num_generations: 8\nmax_completion_length: 1024\n"
                        "per_device_train_batch_size: 8\ngradient_accumulation_steps: 4\n")
    with pytest.raises(ConfigError) as err:
        render(TRL, STUDY, Topology(1, 1), load_trainer_yaml(str(trl_base)), ["p"],
               searched=SEARCHED)
    assert [line.split(" is ")[0] for line in err.value.problems] == [
        "num_generations", "max_completion_length",
        # 8 per device x 4 accumulation / 8 generations = 4 prompts per optimizer step (the
        # rollout, 32 completions = 4 prompts by default, is the study's own 4)
        "global_batch_size (from generation_batch_size and steps_per_generation and "
        "gradient_accumulation_steps)"]
    assert "gradient_accumulation_steps) is 4 in your base config but the study measured 2" \
        in err.value.problems[2]
    base = one_gpu(VERL_BASE, tmp_path, **{"n_gpus_per_node: 8": "n_gpus_per_node: 1"})
    with pytest.raises(ConfigError) as err:
        render(VERL, STUDY, Topology(1, 1), base, ["p"], searched=SEARCHED)
    assert err.value.problems[0].startswith("data.train_batch_size is 1024 in your base "
                                            "config but the study measured 4")


def test_easyr1_exports_batch_as_the_study_measured(tmp_path):
    knobs = {**STUDY, "rollout_engine": "vllm-like"}
    # without a base, a study of fixed micro-batches turns EasyR1's default off, and says why
    text = render(EASYR1, knobs, Topology(1, 1), None, ["p", ""])
    assert yaml.safe_load(text)["worker"]["actor"]["dynamic_batching"] is False
    assert "# batching: fixed micro-batches, as probed: the study measured fixed " \
        "micro-batches (dynamic_batching=false); easyr1's default is on" in text
    # a study of token budgets keeps it on: EasyR1's budget is micro-batch x padded length
    dynamic = render(EASYR1, {**knobs, "dynamic_batching": True}, Topology(1, 1), None,
                     ["p", ""])
    assert yaml.safe_load(dynamic)["worker"]["actor"]["dynamic_batching"] is True
    assert "token budgets (dynamic batching on, as probed): 256 tokens per GPU per update " \
        "micro-batch, 512 tokens per GPU per experience micro-batch" in dynamic
    # a budget EasyR1 cannot express is refused, not rounded
    with pytest.raises(ConfigError, match="EasyR1's token budget is worker.actor.micro_"
                                          "batch_size_per_device_for_update x the padded"):
        render(EASYR1, {**knobs, "dynamic_batching": True, "max_token_len_update": 300},
               Topology(1, 1), None, ["p"])
    # the example config turns it on: a study of fixed micro-batches (held fixed) is a
    # conflict, never switched off silently; --force switches it and says so
    base = one_gpu(EASYR1_BASE, tmp_path, **{"tensor_parallel_size: 2": "tensor_parallel_size: 1",
                                             "n_gpus_per_node: 8": "n_gpus_per_node: 1"})
    mine = {**knobs, "rollout_batch_size": 512, "rollout_n": 5, "global_batch_size": 128,
            "micro_batch_size_update": 2, "micro_batch_size_experience": 2,
            "max_prompt_length": 2048, "max_response_length": 2048}
    plan = plan_export(EASYR1, mine, Topology(1, 1), base[0], searched=SEARCHED)
    assert plan.problems == ["worker.actor.dynamic_batching is true in your base config but "
                             "the study measured false (held fixed, not searched): re-run the "
                             "sweep with this --base-config so it measures your shapes, or "
                             "pass --force to export the study's"]
    plan = plan_export(EASYR1, mine, Topology(1, 1), base[0], searched=SEARCHED, force=True)
    assert "worker.actor.dynamic_batching: true -> false (held fixed)" in plan.notes
    # what `run --base-config` measures (dynamic on) exports with nothing switched
    plan = plan_export(EASYR1, {**mine, "dynamic_batching": True}, Topology(1, 1), base[0],
                       searched=SEARCHED)
    assert plan.problems == [] and not any("dynamic" in note for note in plan.notes)
    assert "offload_params: true -> false (searched)" in " ".join(plan.notes)


def test_verl_token_budgets_are_written_from_the_study(tmp_path):
    base = one_gpu(VERL_BASE, tmp_path, **{
        "    use_dynamic_bsz: false": "    use_dynamic_bsz: true",
        "adv_estimator: gae": "adv_estimator: grpo",
        "n_gpus_per_node: 8": "n_gpus_per_node: 1"})
    mine = {**STUDY, "rollout_batch_size": 1024, "rollout_n": 1, "global_batch_size": 256,
            "max_prompt_length": 512, "max_response_length": 512, "dynamic_batching": True,
            "rollout_tensor_parallel": 2,
            "max_token_len_update": 4096, "max_token_len_experience": 8192}
    plan = plan_export(VERL, mine, Topology(1, 2), base[0],
                       searched=("max_token_len_update", "max_token_len_experience"))
    assert plan.problems == []
    assert {key: plan.values[key] for key in plan.values if "token_len" in key} == {
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 4096,
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 8192,
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": 8192}
    # the log-prob keys follow the actor's through ${oc.select:...}: left to follow it
    assert "actor_rollout_ref.ref.log_prob_use_dynamic_bsz" not in plan.values
    assert not any("use_dynamic_bsz" in note for note in plan.notes)
    # a study of fixed micro-batches against this base: refused, never switched off silently
    fixed = {**mine, "dynamic_batching": False, "max_token_len_update": None,
             "max_token_len_experience": None}
    plan = plan_export(VERL, fixed, Topology(1, 2), base[0], searched=SEARCHED)
    assert plan.problems[0].startswith("actor_rollout_ref.actor.use_dynamic_bsz is true in "
                                       "your base config but the study measured false")
    # without budgets given, dynamic batching runs micro-batch x length: that is written
    derived = {**mine, "max_token_len_update": None, "max_token_len_experience": None}
    plan = plan_export(VERL, derived, Topology(1, 2), None)
    assert plan.values["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] == 2 * 1024
    assert plan.values["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] == 4 * 1024
    # TRL has no token budgets: refused, and its files say their micro-batches are fixed
    with pytest.raises(ConfigError, match="TRL's GRPOConfig has no token budgets"):
        render(TRL, {**STUDY, "dynamic_batching": True}, Topology(1, 1), None, ["p"])
    assert "batching: fixed micro-batches, as probed: trl has no token budgets" in \
        render(TRL, STUDY, Topology(1, 1), None, ["p"])


def test_verl_with_a_critic_is_refused_or_forced_to_grpo(tmp_path):
    base = one_gpu(VERL_BASE, tmp_path, **{"n_gpus_per_node: 8": "n_gpus_per_node: 1"})
    with pytest.raises(ConfigError) as err:
        render(VERL, STUDY, Topology(1, 1), base, ["p"])
    assert err.value.problems == [
        "algorithm.adv_estimator in your base config train ppo but the study measured grpo "
        "(no critic): set them for grpo there, re-run the sweep with --algorithm ppo, or pass "
        "--force to export the study's"]
    forced = yaml.safe_load(render(VERL, STUDY, Topology(1, 1), base, ["p"], force=True))
    assert forced["algorithm"]["adv_estimator"] == "grpo"
    # no base: verl's defaults would train a critic, so the estimator is written
    plain = plan_export(VERL, STUDY, Topology(1, 1), None)
    assert plain.values["algorithm.adv_estimator"] == "grpo" and plain.problems == []
    critic = tmp_path / "critic.yaml"
    critic.write_text("algorithm: {adv_estimator: grpo}\ncritic: {enable: true}\n")
    with pytest.raises(ConfigError, match="critic.enable in your base config train ppo"):
        render(VERL, STUDY, Topology(1, 1), load_trainer_yaml(str(critic)), ["p"])


def test_verl_without_a_base_composes_on_verls_own_defaults():
    text = render(VERL, STUDY, Topology(1, 4), None, ["p", ""])
    header, body = text.split("#\n", 1)
    assert "# composed on verl's own ppo_trainer.yaml through the defaults list below: " \
        "launch with --config-path" in header
    tree = yaml.safe_load(body)
    assert list(tree)[:2] == ["hydra", "defaults"]
    assert tree["hydra"] == {"searchpath": ["pkg://verl.trainer.config"]}
    assert tree["defaults"] == ["ppo_trainer", "_self_"]
    assert dotted_get(tree, "trainer.n_gpus_per_node") == 4
    # ppo_trainer.yaml leaves the engine mandatory (???): the whole config must name one
    assert dotted_get(tree, "actor_rollout_ref.rollout.name") == "vllm"


def test_easyr1_generation_rounds_are_chunked_over_the_gpus(tmp_path):
    knobs = {**STUDY, "rollout_batch_size": 16, "global_batch_size": 8}
    rounds = tmp_path / "rounds.yaml"
    rounds.write_text("data:\n  mini_rollout_batch_size: 4\n")
    problems = EASYR1.check(ProbeConfig(**knobs), Topology(1, 8), lambda key, default: dotted_get(
        load_trainer_yaml(str(rounds))[0], key, default))
    assert problems == ["easyr1: data.mini_rollout_batch_size=4 must be divisible by the 8 "
                        "GPUs (each generation round is chunked equally)"]
    rounds.write_text("data:\n  mini_rollout_batch_size: 8\n")
    assert EASYR1.check(ProbeConfig(**knobs), Topology(1, 8), lambda key, default: dotted_get(
        load_trainer_yaml(str(rounds))[0], key, default)) == []


@pytest.mark.parametrize("eval_batch, generations_eval, world", [
    (3, None, 1), (4, None, 1), (3, 3, 1), (2, None, 2), (3, None, 2), (8, 6, 2)])
def test_trl_eval_batch_rule_agrees_with_grpo_config(tmp_path, eval_batch, generations_eval,
                                                     world):
    pytest.importorskip("trl")
    from trl import GRPOConfig

    settings = {"eval_strategy": "steps", "per_device_eval_batch_size": eval_batch,
                "num_generations_eval": generations_eval}
    knobs = {**STUDY, "micro_batch_size_update": 4 // world}
    problems = TRL.check(ProbeConfig(**knobs), Topology(1, world), lambda key, default: (
        settings.get(key) if settings.get(key) is not None else default))
    values = TRL.tuned_values(knobs, Topology(1, world))

    class Processes(GRPOConfig):  # GRPOConfig reads the process count from accelerate
        @property
        def world_size(self):
            return world

    try:
        Processes(output_dir=str(tmp_path), report_to="none", use_cpu=True, bf16=False,
                  **{k: v for k, v in {**values, **settings}.items() if v is not None})
        accepted = True
    except ValueError as err:
        accepted = False
        assert "eval batch size" in str(err)
    assert (not problems) == accepted, problems


def test_export_command_refuses_conflicts_one_line_each_and_force_takes_the_study(tmp_path):
    from scripted_runner import model_study

    model_study(tmp_path, "x", trials=4)
    base = tmp_path / "easyr1.yaml"
    base.write_text(EASYR1_BASE.read_text().replace("tensor_parallel_size: 2",
                                                    "tensor_parallel_size: 1")
                    .replace("n_gpus_per_node: 8", "n_gpus_per_node: 1"))
    out = tmp_path / "best.yaml"

    def export(*args):
        return subprocess.run([sys.executable, "-m", "autotune", "export", "--study", "x",
                               "--results-dir", str(tmp_path), "--trainer", "easyr1",
                               "--base-config", str(base), "--out", str(out), *args],
                              capture_output=True, text=True)

    refused = export()
    assert refused.returncode == 2 and not out.exists()
    lines = refused.stderr.strip().splitlines()  # one line, naming each key
    # the study probed the hf engine (EasyR1 runs vLLM): that first, then each key
    assert len(lines) == 1 and lines[0].startswith("Error: rollout engine: the study probed "
                                                   "the hf engine, but easyr1 generates with")
    assert "; data.rollout_batch_size is 512 in your base config but the study measured 4" \
        in lines[0]
    # and the model: the base trains Qwen2.5-7B, the study measured tiny-qwen2.5
    assert "; worker.actor.model.model_path=Qwen/Qwen2.5-7B-Instruct in your base config is " \
        "another model, but the study measured tiny-qwen2.5: re-run the sweep" in lines[0]
    assert [part.split(" is ")[0] for part in lines[0][7:].split("; ") if " is " in part
            and not part.startswith(("rollout engine", "worker.actor.model"))] == [
        "data.rollout_batch_size", "worker.rollout.n", "worker.actor.global_batch_size",
        "worker.actor.dynamic_batching", "data.max_prompt_length",
        "data.max_response_length"] and "--force" in lines[0]
    forced = export("--force")
    assert forced.returncode == 0, forced.stderr
    assert "set worker.actor.dynamic_batching: true -> false (held fixed)" in forced.stdout
    assert "#   data.rollout_batch_size: 512 -> 4 (held fixed)" in out.read_text()


# -- issue 53: every key of a base that changes what runs is held, refused or stated ----------

RUN_7B = MeasuredRun(Topology(1, 1), "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct")


def forced_and_refused(adapter, knobs, base, searched=SEARCHED, run=None):
    """The plan without --force (its problems) and with it (the header's lines)."""
    refused = plan_export(adapter, knobs, Topology(1, 1), base[0], searched, run=run)
    forced = plan_export(adapter, knobs, Topology(1, 1), base[0], searched, force=True, run=run)
    assert forced.problems == [], forced.problems
    return refused.problems, [*forced.changes, *forced.unmeasured]


@pytest.mark.parametrize("adapter, text, key, have, value", [
    # the engine a base names (verl): sglang reserves memory otherwise than the vLLM measured
    (VERL, "actor_rollout_ref:\n  rollout:\n    name: sglang\n",
     "actor_rollout_ref.rollout.name", "sglang", "vllm"),
    # EasyR1's FSDP CPU offload: parameters, gradients and the optimizer step on the host
    (EASYR1, "worker:\n  actor:\n    fsdp:\n      enable_cpu_offload: true\n",
     "worker.actor.fsdp.enable_cpu_offload", "true", "false"),
    # TRL's Liger GRPO loss: another logits path
    (TRL, "use_liger_kernel: true\n", "use_liger_kernel", "true", "false"),
    # an optimizer no probe stepped: written as torch's AdamW only with --force, and said
    (TRL, "optim: adamw_8bit\n", "optim", "adamw_8bit", "adamw_torch"),
], ids=["verl-engine", "easyr1-cpu-offload", "trl-liger", "trl-8bit"])
def test_a_setting_that_changes_the_run_is_refused_and_forced_it_is_stated(
        tmp_path, adapter, text, key, have, value):
    path = tmp_path / "base.yaml"
    path.write_text(text)
    base = load_trainer_yaml(str(path))
    knobs = {**STUDY, "fused_optimizer": False}
    problems, header = forced_and_refused(adapter, knobs, base)
    assert [p for p in problems if p.startswith(f"{key} is {have} in your base config")], \
        problems
    assert [line for line in header if line.startswith(f"  {key}: {have} -> {value} (")], \
        header
    if key == "optim":  # a study of the fused step: forced, the file runs the fused step
        _, header = forced_and_refused(adapter, {**knobs, "fused_optimizer": True}, base)
        assert [line for line in header if line.startswith(
            "  optim: adamw_8bit -> adamw_torch_fused (the probe steps torch's AdamW")], header
    # and a sweep on such a base is refused before it starts: it would measure another run
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.space.trainer_target import trainer_target

    with pytest.raises(ConfigError, match=f"{key} is {have} in your base config"):
        trainer_target(adapter.name, str(path), load_search_space("cpu-demo"), 1, 1)


@pytest.mark.parametrize("adapter, knobs, key, value, default", [
    # TRL's ModelConfig: lora_dropout 0.05 unless set; the probe's LoRA runs dropout 0
    (TRL, {"lora_rank": 8, "lora_alpha": 16}, "lora_dropout", "0.0", "0.05"),
    # EasyR1's critic pads its forwards unless told (its actor's padding_free is on)
    (EASYR1, {"algorithm": "ppo", "critic_micro_batch_size_update": 2,
              "critic_gradient_checkpointing": True, "critic_offload_params": False,
              "critic_offload_optimizer": False},
     "worker.critic.padding_free", "true", "false"),
], ids=["trl-lora-dropout", "easyr1-critic-padding"])
def test_a_default_unlike_the_probe_is_written_where_the_run_reads_it(
        tmp_path, adapter, knobs, key, value, default):
    """Where the trainer's own default is not what the probes ran, and only some runs read the
    key (LoRA's dropout, a critic's padding), a base that leaves it unset would run the
    default, unmeasured, with nothing said: the export writes the probes' value for those
    runs, with why in its header, and not for the others; another value in the base is
    refused (--force writes the probes')."""
    path = tmp_path / "base.yaml"
    path.write_text("learning_rate: 1.0e-06\n" if adapter is TRL else
                    "worker:\n  actor:\n    padding_free: true\n")
    base = load_trainer_yaml(str(path))
    study = {**STUDY, "fused_optimizer": False, **knobs}
    plan = plan_export(adapter, study, Topology(1, 1), base[0], SEARCHED)
    assert plan.problems == [], plan.problems
    text = render_plan(plan, adapter, load_trainer_yaml(str(path)), ["p", ""])
    assert dotted_get(yaml.safe_load(text), key, None) == yaml.safe_load(value), text
    assert f"#   {key}: (not set) -> {value} (the probe's" in text, text
    without = plan_export(adapter, STUDY, Topology(1, 1), base[0], SEARCHED)  # no LoRA, no critic
    assert dotted_get(yaml.safe_load(render_plan(without, adapter, load_trainer_yaml(str(path)),
                                                 ["p", ""])) or {}, key, None) is None
    path.write_text(nested(key, default))
    problems, header = forced_and_refused(adapter, study, load_trainer_yaml(str(path)))
    assert [p for p in problems if p.startswith(f"{key} is {default} in your base config")], \
        problems
    assert [line for line in header if line.startswith(f"  {key}: {default} -> {value} (")], \
        header


def test_a_cpu_studys_trl_export_writes_the_precision_its_probes_ran(tmp_path):
    """TRL's bf16 defaults on (None resolves to not fp16); a CPU study's probes computed
    fp32. A base that leaves bf16 unset, or no base, would run bf16 unmeasured: the export
    writes bf16: false with why in its header. A GPU study's (bf16, as TRL's default) writes
    nothing; a base with bf16 true is refused for the CPU study as before."""
    cpu_run = MeasuredRun(Topology(1, 1), "tiny-qwen2.5", None, on_cpu=True)
    gpu_run = MeasuredRun(Topology(1, 1), "tiny-qwen2.5", None)
    path = tmp_path / "base.yaml"
    path.write_text("learning_rate: 1.0e-06\n")
    for on_base in (True, False):
        def tree():  # rendering edits the loaded base in place: one each
            return load_trainer_yaml(str(path)) if on_base else None  # noqa: B023
        base = tree()[0] if on_base else None
        plan = plan_export(TRL, STUDY, Topology(1, 1), base, SEARCHED, run=cpu_run)
        assert plan.problems == [], plan.problems
        text = render_plan(plan, TRL, tree(), ["p", ""])
        assert yaml.safe_load(text)["bf16"] is False, text
        why = "false (the study's probes ran it so on a CPU (fp32 compute); the trainer's"
        assert f"bf16: {'(not set) -> ' if on_base else ''}{why}" in text, text
        on_gpu = plan_export(TRL, STUDY, Topology(1, 1), base, SEARCHED, run=gpu_run)
        assert "bf16" not in yaml.safe_load(render_plan(on_gpu, TRL, tree(), ["p", ""]))
        again = tmp_path / "again.yaml"  # the export given back as a base: the same run
        again.write_text(text)
        back = plan_export(TRL, STUDY, Topology(1, 1), load_trainer_yaml(str(again))[0],
                           SEARCHED, run=cpu_run)
        assert back.problems == [] and "bf16" not in back.values, back.problems
    path.write_text("bf16: true\n")
    refused = plan_export(TRL, STUDY, Topology(1, 1), load_trainer_yaml(str(path))[0],
                          SEARCHED, run=cpu_run)
    assert [p for p in refused.problems if p.startswith("bf16=true in your base config")], \
        refused.problems


@pytest.mark.parametrize("adapter, text, key", [
    (VERL, "actor_rollout_ref:\n  model:\n    lora_rank: 32\n",
     "actor_rollout_ref.model.lora_rank"),
    (EASYR1, "worker:\n  actor:\n    model:\n      lora:\n        rank: 32\n",
     "worker.actor.model.lora.rank"),
    (TRL, "use_peft: true\nlora_r: 32\n", "lora_rank (from use_peft and lora_r)"),
], ids=["verl", "easyr1", "trl"])
def test_lora_in_a_base_is_a_held_fixed_conflict_and_a_sweep_on_it_probes_it(
        tmp_path, adapter, text, key):
    """A study without LoRA (rank 0, as every study before the knob) on a base with LoRA:
    refused as a held-fixed conflict; --force writes rank 0 and the header says so; a sweep
    on the base holds the base's rank (the knob, probed)."""
    path = tmp_path / "base.yaml"
    path.write_text(text)
    base = load_trainer_yaml(str(path))
    problems, header = forced_and_refused(adapter, STUDY, base)
    assert [p for p in problems if p.startswith(f"{key} is 32 in your base config but the "
                                                "study measured 0 (held fixed")], problems
    off = "  use_peft: true -> null (held fixed)" if adapter is TRL else f"  {key}: 32 -> 0 ("
    assert [line for line in header if line.startswith(off)], header
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.space.trainer_target import trainer_target

    _, start, _, _ = trainer_target(adapter.name, str(path), load_search_space("cpu-demo"), 1, 1)
    assert start["lora_rank"] == 32


def test_lora_and_sp_are_written_in_each_trainers_keys_and_read_back(tmp_path):
    """A LoRA study with Ulysses SP 2 on 2 GPUs: verl's and EasyR1's keys (target modules a
    list where the trainer takes one, EasyR1's LoraConfig a string), read back as the same
    knobs; TRL writes its peft fields and refuses SP in one line."""
    knobs = {**STUDY, "lora_rank": 16, "lora_alpha": 32, "lora_target_modules": "q_proj,v_proj",
             "ulysses_sequence_parallel_size": 2, "rollout_batch_size": 8,
             "global_batch_size": 4}
    searched = [*SEARCHED, "lora_rank", "ulysses_sequence_parallel_size"]
    want = {"lora_rank": 16, "lora_alpha": 32, "lora_target_modules": "q_proj,v_proj",
            "ulysses_sequence_parallel_size": 2}
    for adapter, keys in ((VERL, {"actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
                                  "actor_rollout_ref.ref.ulysses_sequence_parallel_size": 2}),
                          (EASYR1, {"worker.actor.model.lora.target_modules":  # a string
                                    "q_proj,v_proj", "worker.actor.ulysses_size": 2})):
        plan = plan_export(adapter, knobs, Topology(1, 2), None, searched)
        assert plan.problems == [], plan.problems
        assert {k: plan.values[k] for k in keys} == keys
        read = adapter.read_knobs(lambda key, default, v=plan.values: v.get(key, default),
                                  Topology(1, 2))
        assert {k: read[k] for k in want} == want
    trl = plan_export(TRL, {**knobs, "ulysses_sequence_parallel_size": 1}, Topology(1, 2), None,
                      searched)
    assert trl.problems == []
    assert {k: trl.values[k] for k in ("use_peft", "lora_r", "lora_alpha",
                                       "lora_target_modules")} == {
        "use_peft": True, "lora_r": 16, "lora_alpha": 32,
        "lora_target_modules": ["q_proj", "v_proj"]}
    refused = plan_export(TRL, knobs, Topology(1, 2), None, searched)
    assert refused.problems == [
        "trl: ulysses_sequence_parallel_size=2: GRPOTrainer does not support sequence-dim "
        "parallelism (TRL's grpo_config.py refuses parallelism_config sp_size or cp_size > 1): "
        "sweep with ulysses_sequence_parallel_size=1 for TRL"]
    # verl: SP needs the actor model's use_remove_padding, and divides the GPUs
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  model:\n    use_remove_padding: false\n")
    plan = plan_export(VERL, knobs, Topology(1, 2), load_trainer_yaml(str(path))[0], searched)
    assert any("you must enable `use_remove_padding`" in p for p in plan.problems), plan.problems
    assert any("ulysses_sequence_parallel_size=2 must divide the 3 GPUs" in p for p in
               plan_export(VERL, knobs, Topology(1, 3), None, searched).problems)


def test_the_critics_model_and_sequence_parallelism_are_compared(tmp_path):
    """PPO: a base's critic model other than the study's (the critic is the actor's model
    with a value head) is refused, forced it is stated; a base's critic SP is a held knob;
    a PPO study forced onto a GRPO base with no critic model sets it to the actor's."""
    ppo = {**STUDY, "algorithm": "ppo", "critic_micro_batch_size_update": 2}
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  model:\n    path: Qwen/Qwen2.5-7B-Instruct\n"
                    "critic:\n  model:\n    path: ~/models/deepseek-llm-7b-chat\n"
                    "algorithm:\n  adv_estimator: gae\n")
    base = load_trainer_yaml(str(path))
    run = MeasuredRun(Topology(1, 1), "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct",
                      "Qwen/Qwen2.5-7B-Instruct", True, base_critic_model="~/models/deepseek-"
                      "llm-7b-chat", same_critic_model=None)
    problems, header = forced_and_refused(VERL, ppo, base, run=run)
    assert [p for p in problems if p.startswith(
        "critic.model.path=~/models/deepseek-llm-7b-chat in your base config is a model "
        "autotune cannot compare")], problems
    assert "  critic model ~/models/deepseek-llm-7b-chat: the study's critic was qwen2.5-7b" \
        in [f"  {line}" for line in header]
    # the critic's SP in a base: held as the run's one SP size
    path.write_text("critic:\n  ulysses_sequence_parallel_size: 2\nalgorithm:\n"
                    "  adv_estimator: gae\n")
    problems, header = forced_and_refused(VERL, ppo, load_trainer_yaml(str(path)))
    assert [p for p in problems if p.startswith("critic.ulysses_sequence_parallel_size is 2 "
                                                "in your base config but the study measured 1")]
    assert "  critic.ulysses_sequence_parallel_size: 2 -> 1 (held fixed)" in header
    # EasyR1's GRPO base (no critic model) forced to the PPO study: the critic is the actor's
    easy = load_trainer_yaml(str(EASYR1_BASE))
    run = MeasuredRun(Topology(1, 8), "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct",
                      "Qwen/Qwen2.5-7B-Instruct", True)
    forced = plan_export(EASYR1, ppo, Topology(1, 8), easy[0], SEARCHED, force=True, run=run)
    assert forced.values["worker.critic.model.model_path"] == "Qwen/Qwen2.5-7B-Instruct"


def test_trl_compares_the_model_its_base_names():
    """TRL's model_name_or_path (ModelConfig's, read by TrlParser from the same file): another
    model is refused like any trainer's; a file without a base still names none (the script
    loads it), and the header says which."""
    for named, same, refused in (("Qwen/Qwen2.5-3B-Instruct", False, True),
                                 ("Qwen/Qwen2.5-7B-Instruct", True, False)):
        run = MeasuredRun(Topology(1, 1), "qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct", named, same)
        plan = plan_export(TRL, STUDY, Topology(1, 1), {"model_name_or_path": named},
                           SEARCHED, run=run)
        lines = [p for p in plan.problems if p.startswith(f"model_name_or_path={named}")]
        assert bool(lines) == refused, plan.problems
    plan = plan_export(TRL, STUDY, Topology(1, 1), None, SEARCHED, run=RUN_7B)
    assert "model_name_or_path" not in plan.values
    assert "model: load qwen2.5-7b (Qwen/Qwen2.5-7B-Instruct) in your script, as measured" \
        in plan.run


def test_a_local_model_is_exported_by_its_absolute_path(tmp_path, monkeypatch):
    """A study swept with a relative --model-path: the file names the checkpoint absolutely."""
    from types import SimpleNamespace

    from autotune.sweep.pick.best_export import measured_run

    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    study = SimpleNamespace(user_attrs={"identity": {"model": "ckpt", "model_path": "ckpt"},
                                        "request": {}})
    run = measured_run(study, VERL, None)  # type: ignore[arg-type]
    assert run.model_id == str(tmp_path / "ckpt")
    plan = plan_export(VERL, STUDY, Topology(1, 1), None, SEARCHED, run=run)
    assert plan.values["actor_rollout_ref.model.path"] == str(tmp_path / "ckpt")


@pytest.mark.parametrize("written", [
    "target_modules: q_proj,v_proj",  # EasyR1's string: the edit once stopped at the comma
    "target_modules: q_proj,v_proj  # two of them",
    "target_modules: 'q_proj,v_proj'",
    'target_modules: "q_proj, v_proj"',
    "target_modules: [q_proj, v_proj]",
    "target_modules:\n    - q_proj\n    - v_proj",
    "target_modules: ${oc.env:TARGETS,q_proj}",
    "{target_modules: q_proj, rank: 8}",
    "target_modules: all-linear",
])
def test_a_key_written_over_in_place_round_trips_in_every_form_the_trainers_take(written):
    """A LoRA target list in each form the trainers accept, written over with another value:
    the file reads back with the new value and every other key as it was, whether the line is
    edited in place or the tree written again (a list, a quoted string)."""
    from autotune.trainers.render import _yaml, edit_in_place

    text = f"lora:\n  rank: 8\n  {written}\n  alpha: 16\n" if not written.startswith("{") \
        else f"lora: {written}\nother: 1\n"
    tree = _yaml().load(text)
    for value in ("all-linear", "q_proj,k_proj,v_proj"):
        edited = edit_in_place(text, tree, {"lora.target_modules": value})
        if edited is None:  # not a one-token scalar: the tree is written again (render)
            continue
        want = yaml.safe_load(text)
        want["lora"]["target_modules"] = value
        assert yaml.safe_load(edited) == want, edited


SILENT_BEFORE = [  # the ten kinds an outside check found written as the user had them, the
    # header saying nothing (the tenth, the comma, is the round trip above)
    (VERL, "actor_rollout_ref.model.enable_activation_offload", "true"),
    (VERL, "critic.model.enable_activation_offload", "true"),
    (VERL, "actor_rollout_ref.actor.fsdp_config.model_dtype", "bf16"),
    (EASYR1, "worker.actor.fsdp.torch_dtype", "bf16"),
    (VERL, "actor_rollout_ref.actor.optim.optimizer", "AdamW8bit"),
    (VERL, "actor_rollout_ref.actor.optim.optimizer_impl", "bitsandbytes.optim"),
    (EASYR1, "worker.actor.optim.strategy", "adamw_bf16"),
    (VERL, "actor_rollout_ref.model.use_liger", "true"),
    (VERL, "actor_rollout_ref.actor.fsdp_config.offload_policy", "true"),
    (VERL, "actor_rollout_ref.actor.fsdp_config.reshard_after_forward", "false"),
    (VERL, "actor_rollout_ref.actor.fsdp_config.fsdp_size", "4"),
    (EASYR1, "worker.actor.fsdp.enable_full_shard", "false"),
    (VERL, "trainer.use_legacy_worker_impl", "disable"),
    (VERL, "actor_rollout_ref.model.exclude_modules", "'.*visual.*'"),
    (VERL, "critic.model.lora_rank", "8"),
    (TRL, "use_dora", "true"),
    (TRL, "lora_modules_to_save", "[lm_head]"),
    (EASYR1, "data.mini_rollout_batch_size", "2"),
    (TRL, "load_in_4bit", "true"),
    (TRL, "torch_compile", "true"),
    (TRL, "cast_lm_head_to_fp32", "true"),
    (TRL, "use_transformers_paged", "true"),
]


def nested(key: str, value: str) -> str:
    *parents, leaf = key.split(".")
    lines = [f"{'  ' * depth}{name}:" for depth, name in enumerate(parents)]
    return "\n".join([*lines, f"{'  ' * len(parents)}{leaf}: {value}"]) + "\n"


@pytest.mark.parametrize("adapter,key,value", SILENT_BEFORE,
                         ids=[f"{a.name}-{k}" for a, k, _ in SILENT_BEFORE])
def test_a_base_setting_that_changes_the_run_is_refused_or_stated(tmp_path, adapter, key, value):
    path = tmp_path / "base.yaml"
    path.write_text(nested(key, value))
    tree = load_trainer_yaml(str(path))[0]
    refused = plan_export(adapter, STUDY, Topology(1, 1), tree, SEARCHED)
    assert [line for line in refused.problems if line.startswith(f"{key}=")], refused.problems
    forced = plan_export(adapter, STUDY, Topology(1, 1), tree, SEARCHED, force=True)
    assert not [line for line in forced.problems if key in line], forced.problems
    assert [line for line in forced.unmeasured if line.startswith(f"{key}=")], forced.unmeasured
    assert f"#   {key}=" in render_plan(forced, adapter, load_trainer_yaml(str(path)), ["p", ""])
    # and `run --trainer` on this base is refused before it probes another run than the user's
    assert [line for line in refused_settings(adapter, tree) if line.startswith(f"{key}=")]


def test_a_key_autotune_does_not_know_is_stated_and_refused_with_strict(tmp_path):
    """A newer trainer's key (in no class) is never silent: listed under NOT COMPARED in the
    header, refused with --strict; a key that changes nothing (a learning rate) is neither."""
    path = tmp_path / "base.yaml"
    path.write_text("actor_rollout_ref:\n  model:\n    fused_everything_v2: true\n"
                    "  actor:\n    optim:\n      lr: 3.0e-06\n")
    tree = load_trainer_yaml(str(path))[0]
    plan = plan_export(VERL, STUDY, Topology(1, 1), tree, SEARCHED)
    assert plan.problems == [] and plan.not_compared == [
        "actor_rollout_ref.model.fused_everything_v2=true"]
    text = render_plan(plan, VERL, load_trainer_yaml(str(path)), ["p", ""])
    assert "# NOT COMPARED (keys of your base config autotune does not classify" in text
    assert "#   actor_rollout_ref.model.fused_everything_v2=true" in text
    strict = plan_export(VERL, STUDY, Topology(1, 1), tree, SEARCHED, strict=True)
    assert [line for line in strict.problems if line.startswith(
        "actor_rollout_ref.model.fused_everything_v2=true in your base config is a key "
        "autotune does not classify for verl")], strict.problems
