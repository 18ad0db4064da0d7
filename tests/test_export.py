"""Trainer export: the real default configs of EasyR1 and verl (shared/trainer-configs) as
bases, the trainers' quoted rules against an independent simulation, and the round trip."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.config import ProbeConfig, Topology
from autotune.errors import ConfigError
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.export_plan import measured_knobs
from autotune.trainers.render import dotted_get, load_trainer_yaml, render, topology_for
from autotune.trainers.verl import VERL

FIXTURES = Path(__file__).resolve().parent / "fixtures"  # the trainers' real default configs
BASES = {"easyr1": FIXTURES / "easyr1-config.yaml", "verl": FIXTURES / "verl-ppo-trainer.yaml"}
KNOBS = {"rollout_batch_size": 512, "rollout_n": 5, "global_batch_size": 128,
         "micro_batch_size_update": 4, "micro_batch_size_experience": 8,
         "gradient_checkpointing": True, "offload_params": False, "offload_optimizer": True,
         "max_prompt_length": 2048, "max_response_length": 2048, "val_batch_size": None}


def flatten(tree, prefix=""):
    out = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def random_knobs(rng):
    n = rng.choice([1, 2, 4, 5, 8, 16])
    return {"rollout_batch_size": rng.choice([8, 16, 32, 64, 96, 128, 512]), "rollout_n": n,
            "global_batch_size": rng.choice([4, 8, 16, 32, 64, 128]),
            "micro_batch_size_update": rng.choice([1, 2, 3, 4, 8, 16, 32]),
            "micro_batch_size_experience": rng.choice([1, 2, 4, 6, 8, 16, 64]),
            "gradient_checkpointing": rng.random() < 0.5, "offload_params": rng.random() < 0.5,
            "offload_optimizer": rng.random() < 0.5,
            "max_prompt_length": rng.choice([512, 2048, 4096]),
            "max_response_length": rng.choice([512, 2048, 8192]), "val_batch_size": None}


def easyr1_accepts(k, nnodes, gpus, cfg):
    """EasyR1's start-up path, simulated step by step (RayPPOTrainer.__init__, then each
    FSDP worker's _init_dist_mesh, vLLM rollout construction, DataProto.chunk)."""
    world = nnodes * gpus
    if k["rollout_batch_size"] % k["global_batch_size"] != 0:
        return False
    if (k["rollout_batch_size"] * k["rollout_n"]) % k["micro_batch_size_experience"] != 0:
        return False
    if cfg["adv"] in ("grpo", "rloo") and not k["rollout_n"] > 1:
        return False
    global_batch = k["global_batch_size"]
    if k["rollout_n"] > 1:
        global_batch *= k["rollout_n"]
    per_device = global_batch // (world // cfg["ulysses"])
    if per_device == 0 or per_device % k["micro_batch_size_update"] != 0:
        return False
    if cfg["cpu_offload"] and per_device != k["micro_batch_size_update"]:
        return False
    if world % cfg["tp"] != 0:
        return False
    if cfg["max_tokens"] < k["max_prompt_length"] + k["max_response_length"]:
        return False
    chunks = [k["rollout_batch_size"], k["rollout_batch_size"] * k["rollout_n"]]
    if not all(len(range(0, c, c // world or 1)) == world and c % world == 0 for c in chunks):
        return False
    # dp_actor: the device's share is split into mini-batches, and (dynamic batching off, as
    # exported) into experience micro-batches; DataProto.split asserts equal splits
    share = k["rollout_batch_size"] * k["rollout_n"] // world * cfg["ulysses"]
    return share % per_device == 0 and share % k["micro_batch_size_experience"] == 0


def verl_accepts(k, nnodes, gpus, cfg):
    """verl's start-up path, simulated: validate_config, ActorConfig.validate, the FSDP
    worker's mini-batch normalization and the rollout device mesh."""
    world = nnodes * gpus
    if not (k["rollout_batch_size"] * k["rollout_n"]) % world == 0:
        return False
    if not k["rollout_batch_size"] >= k["global_batch_size"]:
        return False
    mini = k["global_batch_size"] * k["rollout_n"]
    mini //= world // cfg["ulysses"]
    if not mini > 0 or mini % k["micro_batch_size_update"] != 0:
        return False
    return world % cfg["tp"] == 0


@pytest.mark.parametrize("adapter, accepts", [(EASYR1, easyr1_accepts), (VERL, verl_accepts)])
def test_rule_checker_agrees_with_the_simulated_trainer_on_random_configs(adapter, accepts):
    rng = random.Random(7)
    refused = accepted = 0
    for _ in range(3000):
        knobs = random_knobs(rng)
        nnodes, gpus = rng.choice([1, 1, 2, 4]), rng.choice([1, 2, 4, 8])
        cfg = {"tp": rng.choice([1, 2, 4]), "ulysses": 1, "cpu_offload": rng.random() < 0.1,
               "max_tokens": rng.choice([8192, 16384]), "adv": "grpo"}
        tree = ({"worker": {"rollout": {"tensor_parallel_size": cfg["tp"],
                                        "max_num_batched_tokens": cfg["max_tokens"]},
                            "actor": {"fsdp": {"enable_cpu_offload": cfg["cpu_offload"]}}}}
                if adapter is EASYR1 else
                {"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": cfg["tp"]}}})
        config = ProbeConfig(**knobs, rollout_tensor_parallel=cfg["tp"],
                             max_num_batched_tokens=cfg["max_tokens"])  # written as probed
        problems = adapter.check(config, Topology(nnodes, gpus),
                                 lambda key, default, tree=tree: dotted_get(tree, key, default))
        assert (not problems) == accepts(knobs, nnodes, gpus, cfg), (knobs, nnodes, gpus, cfg,
                                                                       problems)
        refused += bool(problems)
        accepted += not problems
    assert refused > 300 and accepted > 300  # both sides of every rule were exercised


def split_header(text):
    """The exported file's header comment lines (up to the first empty comment line) and its
    body (the user's file, edited, its own comments included)."""
    lines = text.splitlines(keepends=True)
    count = lines.index("#\n") + 1
    return [line[2:].rstrip("\n") for line in lines[:count]], "".join(lines[count:])


@pytest.mark.parametrize("adapter", [EASYR1, VERL])
def test_merge_into_the_real_default_config_changes_only_the_tuned_keys(adapter):
    path = BASES[adapter.name]
    original_text = path.read_text()
    base = load_trainer_yaml(str(path))
    # verl's default trains a critic (adv_estimator: gae): --force exports GRPO's estimator
    text = render(adapter, KNOBS, topology_for(adapter, base[0], None, None), base,
                  ["provenance line", ""], force=adapter is VERL)
    header, body = split_header(text)
    assert header[0] == "provenance line" and header[-1] == ""
    tuned = adapter.tuned_values(measured_knobs(KNOBS), Topology(1, 8))  # dynamic off: said
    settings = {setting.key: setting.value for setting in adapter.settings}
    before, after = flatten(yaml.safe_load(original_text)), flatten(yaml.safe_load(body))
    assert list(before) == [k for k in after if k in before]  # every key kept, in order
    changed = {k for k in before if before[k] != after[k]}
    assert changed and changed <= set(tuned) | set(settings)
    for key in changed:  # the header names every key changed, with both values
        assert any(line.startswith(f"  {key}: ") and " -> " in line for line in header), key
    for key, value in tuned.items():
        if str(before.get(key)).startswith("${"):  # follows a written key: left as it is
            assert after[key] == before[key], key
        elif key in before or value is not None:
            assert after[key] == value, key
    # byte for byte, only the lines holding changed keys differ; every comment is still there
    old_lines, new_lines = original_text.splitlines(), body.splitlines()
    assert len(old_lines) == len(new_lines)
    differ = [(o, n) for o, n in zip(old_lines, new_lines, strict=True) if o != n]
    assert len(differ) == len(changed)
    for old, new in zip(old_lines, new_lines, strict=True):  # comments kept on every line
        if "  #" in old:
            assert new.endswith(old[old.index("  #"):]), (old, new)


@pytest.mark.parametrize("adapter", [EASYR1, VERL])
def test_round_trip_reads_back_the_same_canonical_knobs(adapter):
    for base in (load_trainer_yaml(str(BASES[adapter.name])), None):
        topology = Topology(1, 8)
        text = render(adapter, KNOBS, topology, base, ["p"], force=True)
        tree = yaml.safe_load(text)
        read = adapter.read_knobs(lambda key, default, tree=tree: dotted_get(tree, key, default),
                                  topology)
        expected = {k: v for k, v in KNOBS.items() if v is not None and k in adapter.keys}
        assert {k: read[k] for k in expected} == expected
        assert dotted_get(tree, "trainer.n_gpus_per_node") == 8


def test_a_config_the_trainer_rejects_is_never_written_and_the_rule_is_named():
    knobs = {**KNOBS, "micro_batch_size_update": 3}
    with pytest.raises(ConfigError) as err:
        render(VERL, knobs, Topology(1, 8), None, ["p"])
    assert err.value.problems == [
        "verl: normalized ppo_mini_batch_size 80 should be divisible by "
        "ppo_micro_batch_size_per_gpu 3"]
    with pytest.raises(ConfigError, match="must be divisible by the 8 GPUs"):
        render(EASYR1, {**KNOBS, "rollout_batch_size": 260, "global_batch_size": 130},
               Topology(1, 8), None, ["p"])


def test_export_command_writes_once_and_prints_the_launch_line(tmp_path):
    from scripted_runner import model_study

    model_study(tmp_path, "x", trials=4)

    def export(*args):
        return subprocess.run([sys.executable, "-m", "autotune", "export", "--study", "x",
                               "--results-dir", str(tmp_path), *args],
                              capture_output=True, text=True)

    one_gpu = tmp_path / "verl-1gpu.yaml"
    one_gpu.write_text("actor_rollout_ref:\n  rollout:\n    tensor_model_parallel_size: 1\n"
                       "trainer:\n  nnodes: 1\n  n_gpus_per_node: 1\n")
    # the study probed the hf engine: verl's vLLM is another engine, refused in one line
    refused = export("--trainer", "verl", "--out", str(tmp_path / "plain.yaml"))
    assert refused.returncode == 2 and not (tmp_path / "plain.yaml").exists()
    assert refused.stderr.count("\n") == 1 and "--engine vllm-like" in refused.stderr
    # verl's default rollout TP of 2 needs 2 GPUs; the export writes the TP the study measured
    plain = export("--trainer", "verl", "--out", str(tmp_path / "plain.yaml"), "--force")
    assert plain.returncode == 0, plain.stderr
    assert "actor_rollout_ref.rollout.tensor_model_parallel_size=1" in plain.stdout
    assert "# UNMEASURED (exported with --force" in (tmp_path / "plain.yaml").read_text()
    out = export("--trainer", "verl", "--base-config", str(one_gpu), "--force")
    assert out.returncode == 0, out.stderr
    written = tmp_path / "x" / "best.verl.yaml"
    assert f"wrote {written}" in out.stdout
    # the base names no estimator: verl's default (gae, with a critic) is replaced, and said
    assert ("algorithm.adv_estimator and critic.enable: not set in your base config, where "
            "verl's default trains ppo; set to the study's algorithm, grpo") in out.stdout
    assert (f"launch: python3 -m verl.trainer.main_ppo --config-path {written.parent} "
            "--config-name best.verl\n") in out.stdout
    assert "or as overrides on your base config: data.train_batch_size=4" in out.stdout
    text = written.read_text()
    assert text.startswith("# exported by autotune") and "study x, trial" in text
    again = export("--trainer", "verl", "--base-config", str(one_gpu), "--force")
    assert again.returncode == 2 and "file exists" in again.stderr
    assert written.read_text() == text  # nothing already there is overwritten
    easy = export("--trainer", "easyr1", "--base-config", str(BASES["easyr1"]),
                  "--out", str(tmp_path / "e.yaml"), "--force")
    assert easy.returncode == 2 and "easyr1: data.rollout_batch_size=4" in easy.stderr
    assert not (tmp_path / "e.yaml").exists()  # 8 GPUs in the base: refused, not written
    easy_base = tmp_path / "easyr1-1gpu.yaml"
    easy_base.write_text(BASES["easyr1"].read_text().replace("tensor_parallel_size: 2",
                                                             "tensor_parallel_size: 1"))
    fits = export("--trainer", "easyr1", "--base-config", str(easy_base),
                  "--gpus-per-node", "1", "--out", str(tmp_path / "e.yaml"), "--force")
    assert fits.returncode == 0, fits.stderr
    assert "config=" in fits.stdout and "or as overrides on your base config:" in fits.stdout


def _grpo_config(tmp_path, values):
    from trl import GRPOConfig

    kwargs = {k: v for k, v in values.items() if v is not None}
    # this machine has no GPU: TrainingArguments refuses bf16 there unless told to use the CPU
    return GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True,
                      bf16=False, **kwargs)


def test_exported_trl_config_is_loaded_by_the_real_grpo_config(tmp_path):
    pytest.importorskip("trl")  # installed by the test extra; skipped only outside it
    from autotune.trainers.trl import TRL

    knobs = {**KNOBS, "offload_optimizer": False, "micro_batch_size_update": 8}
    text = render(TRL, knobs, Topology(1, 1), None, ["p"])
    values = yaml.safe_load(text)
    config = _grpo_config(tmp_path, values)
    assert config.per_device_train_batch_size == 8 and config.num_generations == 5
    assert config.gradient_accumulation_steps == 128 * 5 // 8  # one optimizer step = 128 prompts
    assert config.generation_batch_size == 512 * 5 and config.steps_per_generation == 320
    assert config.max_completion_length == 2048 and config.gradient_checkpointing is True
    read = TRL.read_knobs(lambda key, default: values.get(key, default), Topology(1, 1))
    assert {k: read[k] for k in ("rollout_batch_size", "rollout_n", "global_batch_size",
                                 "micro_batch_size_update", "max_response_length")} == \
        {k: knobs[k] for k in ("rollout_batch_size", "rollout_n", "global_batch_size",
                               "micro_batch_size_update", "max_response_length")}
    with pytest.raises(ConfigError, match="offload_optimizer=true has no GRPOConfig key"):
        render(TRL, KNOBS, Topology(1, 1), None, ["p"])


def test_trl_rules_agree_with_grpo_config_on_random_configs(tmp_path):
    pytest.importorskip("trl")
    from autotune.trainers.trl import TRL

    rng, accepted, refused = random.Random(3), 0, 0
    for _ in range(300):
        knobs = {**random_knobs(rng), "offload_params": False, "offload_optimizer": False}
        knobs.update(TRL.ties(ProbeConfig(**knobs)))  # the sweep's tie: log-probs at the
        # train micro-batch
        problems = TRL.check(ProbeConfig(**knobs), Topology(1, 1))
        whole_steps = (knobs["global_batch_size"] * knobs["rollout_n"]) \
            % knobs["micro_batch_size_update"] == 0
        if not whole_steps:  # no integer gradient_accumulation_steps: never exported
            assert problems
            continue
        values = TRL.tuned_values(knobs, Topology(1, 1))
        try:
            _grpo_config(tmp_path, values)
            trl_accepts = True
        except ValueError:
            trl_accepts = False
        assert (not problems) == trl_accepts, (knobs, problems)
        accepted += trl_accepts
        refused += not trl_accepts
    assert accepted > 30 and refused > 30


def test_flow_style_and_quoted_values_are_edited_or_reserialised_safely(tmp_path):
    path = tmp_path / "flow.yaml"
    path.write_text("data: {train_batch_size: 8, max_prompt_length: 64}  # flow\n"
                    "actor_rollout_ref:\n  rollout: {n: 4, tensor_model_parallel_size: 1}\n"
                    "  actor: {ppo_mini_batch_size: '2'}\n")
    base = load_trainer_yaml(str(path))
    knobs = {**KNOBS, "rollout_batch_size": 8, "rollout_n": 4, "global_batch_size": 2,
             "max_prompt_length": 64, "max_response_length": 64}
    text = render(VERL, knobs, Topology(1, 1), base, ["p"])
    tree = yaml.safe_load(text)  # still valid YAML, with the tuned values
    assert tree["data"] == {"train_batch_size": 8, "max_prompt_length": 64,
                            "max_response_length": 64}
    assert tree["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] == 2
    assert tree["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == 1


def test_an_interpolated_setting_the_rules_read_is_one_clear_error(tmp_path):
    path = tmp_path / "interp.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n"
                    "    tensor_model_parallel_size: ${oc.env:TP}\n")
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=.*needs a plain int"):
        render(VERL, KNOBS, Topology(1, 8), load_trainer_yaml(str(path)), ["p"])
    # a key that follows another (or its default) is read through, as OmegaConf reads it
    path.write_text("actor_rollout_ref:\n  rollout:\n"
                    "    tensor_model_parallel_size: ${oc.select:foo,3}\n")
    knobs = {k: v for k, v in KNOBS.items() if k != "rollout_tensor_parallel"}
    with pytest.raises(ConfigError, match="infer_world_size 3"):
        render(VERL, knobs, Topology(1, 8), load_trainer_yaml(str(path)), ["p"])


@pytest.mark.parametrize("adapter, keys", [
    (EASYR1, {"worker.rollout.gpu_memory_utilization": 0.45,
              "worker.rollout.max_num_batched_tokens": 16384}),
    (VERL, {"actor_rollout_ref.rollout.gpu_memory_utilization": 0.45,
            "actor_rollout_ref.rollout.max_num_batched_tokens": 16384,
            "actor_rollout_ref.rollout.free_cache_engine": True})])
def test_the_engine_knobs_land_on_the_trainers_vllm_keys(adapter, keys):
    knobs = {**KNOBS, "gpu_memory_utilization": 0.45, "max_num_batched_tokens": 16384,
             "enable_sleep": True}
    for base in (load_trainer_yaml(str(BASES[adapter.name])), None):
        tree = yaml.safe_load(render(adapter, knobs, Topology(1, 8), base, ["p"], force=True))
        assert {key: dotted_get(tree, key, None) for key in keys} == keys
        read = adapter.read_knobs(lambda key, default, tree=tree: dotted_get(tree, key,
                                                                             default),
                                  Topology(1, 8))
        assert read["gpu_memory_utilization"] == 0.45
    # vLLM needs room for one whole sequence in a prefill budget; EasyR1 always sleeps
    with pytest.raises(ConfigError, match="max_num_batched_tokens=2048 must be at least"):
        render(EASYR1, {**knobs, "max_num_batched_tokens": 2048}, Topology(1, 8), None, ["p"])
    with pytest.raises(ConfigError, match="enable_sleep=false cannot be exported"):
        render(EASYR1, {**knobs, "enable_sleep": False}, Topology(1, 8), None, ["p"])


@pytest.mark.parametrize("adapter", [EASYR1, VERL])
def test_round_trip_reads_back_how_the_study_batched(adapter):
    """Token budgets written from a study read back as the same knobs, with a base config
    and without; nothing the probe ran is lost on the way (EasyR1's budget is micro-batch x
    length, so it reads back as the micro-batches)."""
    length = KNOBS["max_prompt_length"] + KNOBS["max_response_length"]
    budgets = {"max_token_len_update": 3 * length, "max_token_len_experience": 5 * length} \
        if adapter is VERL else {}
    knobs = {**KNOBS, "dynamic_batching": True, **budgets}
    for base in (load_trainer_yaml(str(BASES[adapter.name])), None):
        topology = Topology(1, 8)
        text = render(adapter, knobs, topology, base, ["p", ""], force=True)
        assert "# batching: token budgets (dynamic batching on, as probed)" in text
        tree = yaml.safe_load(text)
        read = adapter.read_knobs(lambda key, default, tree=tree: dotted_get(tree, key, default),
                                  topology)
        expected = {k: v for k, v in knobs.items() if v is not None and k in adapter.keys}
        # verl asserts a per-GPU micro-batch it would not run (token budgets) divides the
        # normalised mini-batch: written as null, so it reads back as none
        unused = [k for k in expected if adapter.keys[k][0] in
                  adapter.unused_keys(ProbeConfig.from_knobs(knobs))]
        assert unused == (["micro_batch_size_update"] if adapter is VERL else [])
        assert all(k not in read for k in unused), read
        assert {k: read[k] for k in expected if k not in unused} == \
            {k: v for k, v in expected.items() if k not in unused}


def test_the_fsdp_wrapper_the_study_ran_is_written_or_stated():
    """verl's actor strategy carries the wrapper the probes ran and reads back as it; EasyR1
    wraps with FSDP1 only, so a study probed with FSDP2 says so."""
    topology = Topology(1, 8)
    for strategy in ("fsdp", "fsdp2"):
        knobs = {**KNOBS, "fsdp_strategy": strategy}
        tree = yaml.safe_load(render(VERL, knobs, topology, None, ["p"], force=True))
        assert dotted_get(tree, "actor_rollout_ref.actor.strategy") == strategy
        read = VERL.read_knobs(lambda key, default, tree=tree: dotted_get(tree, key, default),
                               topology)
        assert read["fsdp_strategy"] == strategy
    easyr1 = render(EASYR1, {**KNOBS, "fsdp_strategy": "fsdp2"}, topology, None, ["p", ""])
    assert "sharding: the study's ranks ran FSDP2 (fully_shard); EasyR1 wraps with FSDP1" \
        in easyr1
    assert "sharding:" not in render(EASYR1, {**KNOBS, "fsdp_strategy": "fsdp"}, topology,
                                     None, ["p", ""])
    # GRPOConfig's file leaves the wrapper to the launch: the header names the one probed
    from autotune.trainers.trl import TRL

    trl_knobs = {**KNOBS, "offload_optimizer": False, "micro_batch_size_update": 8}
    for strategy, version in (("fsdp", 1), ("fsdp2", 2)):
        text = render(TRL, {**trl_knobs, "fsdp_strategy": strategy}, topology, None, ["p", ""])
        assert f"# sharding: the study's ranks ran FSDP{version}" in text
        assert f"fsdp_config: {{version: {version}}}" in text
    assert "sharding:" not in render(TRL, {**trl_knobs, "fsdp_strategy": "fsdp2"},
                                     Topology(1, 1), None, ["p", ""])
