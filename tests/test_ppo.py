"""PPO: a critic of the actor's architecture trained on the same GPUs (issue 32).

Real CPU probes of the tiny models with a critic, their traces, the memory model's critic
terms, the exports for verl and EasyR1 with a critic (verl's own ppo_trainer.yaml as the base),
and a PPO sweep killed and resumed.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml
from sweep_driver import kill_after_trials

from autotune.config import ProbeConfig, Topology, make_probe_config, parse_assignments
from autotune.errors import ConfigError
from autotune.memory.model import TRACE_CPU_CONTEXT_BYTES, estimate_memory
from autotune.memory.shape import model_shape
from autotune.memory.states import model_state_bytes
from autotune.runners.local import SubprocessRunner
from autotune.trainers.easyr1 import EASYR1
from autotune.trainers.export_plan import plan_export
from autotune.trainers.render import load_trainer_yaml
from autotune.trainers.trl import TRL
from autotune.trainers.verl import VERL

ROOT = Path(__file__).resolve().parents[1]
VERL_BASE = ROOT / "tests" / "fixtures" / "verl-ppo-trainer.yaml"
PPO = {"algorithm": "ppo", "rollout_n": 1, "rollout_batch_size": 8, "global_batch_size": 4,
       "micro_batch_size_update": 2, "micro_batch_size_experience": 4,
       "critic_micro_batch_size_update": 4}


def test_a_ppo_probe_trains_a_critic_and_its_trace_holds_the_same_bytes(make_request):
    """One uncapped CPU probe with a critic: its own phase, its states counted as the
    model's arithmetic has them (16 bytes per parameter, no LM head), and the trace of the
    same step within 9% per phase: -2.0% to -5.9% here, quiet or beside one busy process per
    core (benchmarks/trace_under_load.py); an outside run under load 6 to 12 measured -7.2% in
    the update."""
    from autotune.probe.trace import trace_request

    request = make_request(warmup_steps=1, **PPO)  # the steady state: both AdamW states made
    measured = SubprocessRunner().run(request)
    assert measured.ok, measured.message
    assert set(measured.phase_peak_mem_bytes) == {"rollout", "experience", "critic_update",
                                                  "update"}
    psi_c = model_shape("tiny-qwen2.5").critic_params
    states = measured.model_state_bytes
    assert (states["critic_params"], states["critic_grads"], states["critic_optimizer"]) == (
        4 * psi_c, 4 * psi_c, 8 * psi_c)
    assert measured.share["critic_update_micro_batch_rows"] == 4
    traced = trace_request(request, TRACE_CPU_CONTEXT_BYTES)
    assert traced.share == measured.share
    for phase, peak in measured.phase_peak_mem_bytes.items():
        error = (traced.phase_peak_mem_bytes[phase] - peak) / peak
        assert abs(error) <= 0.09, (phase, error, traced.phase_peak_mem_bytes, peak)
    assert traced.model_state_bytes == measured.model_state_bytes


@pytest.mark.parametrize("knobs", [
    {"gpus_per_node": 2, "rollout_batch_size": 12, "global_batch_size": 4,
     "critic_micro_batch_size_update": 1, "critic_offload_params": True,
     "critic_offload_optimizer": True, "critic_gradient_checkpointing": True},
    {"dynamic_batching": True, "critic_max_token_len_update": 200,
     "rollout_batch_size": 6, "global_batch_size": 2},
])
def test_the_traces_shortcuts_hold_the_critics_loops(make_request, knobs):
    """The critic's value forwards, mini-batches and micro-batches run through the trace's
    shortcuts (first and last iteration): every phase's peak and the host's equal a trace of
    every iteration, sharded over two ranks with the critic offloaded, and by token budget."""
    from autotune.probe.trace import trace_request

    request = make_request(**{**PPO, "max_response_length": 8, "micro_batch_size_update": 1,
                              "micro_batch_size_experience": 2, **knobs})
    short = trace_request(request, 0)
    full = trace_request(request, 0, every_iteration=True)
    assert short.phase_peak_mem_bytes == full.phase_peak_mem_bytes
    assert short.host_offload_bytes == full.host_offload_bytes
    assert "critic_update" in short.phase_peak_mem_bytes
    if knobs.get("critic_offload_params"):  # fp32 params and AdamW state of half the critic
        psi_c = model_shape("tiny-qwen2.5").critic_params
        assert short.host_offload_bytes >= 12 * psi_c // 2


def test_the_memory_model_counts_the_critic_in_every_phase():
    """Qwen2.5-7B on 8 GPUs: the critic's 16 bytes per parameter in its own update and 12
    between phases, none with its offload; the actor's update unchanged by it otherwise."""
    shape = model_shape("qwen2.5-7b")
    grpo = ProbeConfig(rollout_batch_size=64, rollout_n=1, global_batch_size=32,
                       micro_batch_size_update=2, micro_batch_size_experience=4)
    ppo = ProbeConfig(**{**grpo.as_dict(), "algorithm": "ppo"})
    psi_c = shape.critic_params
    assert psi_c == shape.num_params - shape.embedding_params + shape.hidden + 1  # untied head
    without = estimate_memory(shape, grpo, num_gpus=8)
    with_critic = estimate_memory(shape, ppo, num_gpus=8)
    assert "critic_update" not in without.phases
    critic = model_state_bytes(psi_c, 8)
    assert with_critic.phases["critic_update"].parts["critic_params_grads_adam"] == \
        critic.update_bytes == 4 * psi_c // 8 * 2 + 8 * psi_c // 8
    assert with_critic.critic_bytes("update") == critic.resident_bytes
    assert with_critic.phases["update"].total_bytes - without.phases["update"].total_bytes \
        == with_critic.critic_bytes("update")
    offloaded = estimate_memory(shape, ProbeConfig(**{**ppo.as_dict(),
                                                      "critic_offload_params": True,
                                                      "critic_offload_optimizer": True}),
                                num_gpus=8)
    assert offloaded.critic_bytes("update") == 0
    assert offloaded.host_offload_bytes - with_critic.host_offload_bytes == critic.resident_bytes


def test_critic_knobs_need_ppo_and_ppo_defaults_to_one_response():
    with pytest.raises(ConfigError, match="critic_micro_batch_size_update: critic knobs, but "
                                          "algorithm=grpo trains no critic"):
        make_probe_config({"critic_micro_batch_size_update": 2})
    with pytest.raises(ConfigError, match="not divisible by critic_micro_batch_size_update=3"):
        make_probe_config({**PPO, "critic_micro_batch_size_update": 3})
    # verl's own keys set the critic's knobs (--trainer verl --set ...)
    knobs = parse_assignments(["critic.ppo_micro_batch_size_per_gpu=2",
                               "critic.model.fsdp_config.param_offload=true"],
                              lambda keys: VERL.knobs_of_keys(keys, Topology(1, 1)))
    assert knobs == {"critic_micro_batch_size_update": 2, "critic_offload_params": True}


def estimate_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "autotune", "estimate", "--json", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_estimate_algorithm_ppo_states_the_critics_share_per_phase():
    """The issue's two runs: qwen2.5-0.5b on 2 x A100-40GB, qwen2.5-7b on 8 x A100-80GB."""
    small = estimate_json("--algorithm", "ppo", "--model", "qwen2.5-0.5b", "--gpus-per-node",
                          "2", "--capacity", "40GiB", "--host-memory", "256GiB")
    assert small["algorithm"] == "ppo"
    assert list(small["phase_bytes"]) == ["rollout", "experience", "critic_update", "update"]
    psi_c = model_shape("qwen2.5-0.5b").critic_params
    assert small["critic_phase_bytes"]["critic_update"] > 16 * psi_c // 2
    assert small["critic_phase_bytes"]["update"] == 12 * psi_c // 2
    big = estimate_json("--algorithm", "ppo", "--model", "qwen2.5-7b", "--gpus-per-node", "8",
                        "--capacity", "80GiB", "--host-memory", "1TiB",
                        "--set", "critic_offload_params=true",
                        "--set", "critic_offload_optimizer=true")
    assert big["critic_phase_bytes"]["rollout"] == 0  # offloaded between phases
    # ... to the node's host memory: the critic's fp32 params and AdamW state, every rank's
    host = big["node_host"]["terms"]["rollout"]
    psi_7b = model_shape("qwen2.5-7b").critic_params
    assert host["critic_offloaded_params x8"] >= 8 * 4 * psi_7b // 8
    assert host["critic_offloaded_optimizer x8"] >= 8 * 8 * psi_7b // 8
    assert big["critic_phase_bytes"]["critic_update"] > 16 * model_shape(
        "qwen2.5-7b").critic_params // 8
    text = subprocess.run([sys.executable, "-m", "autotune", "estimate", "--algorithm", "ppo",
                           "--model", "qwen2.5-0.5b", "--gpus-per-node", "2"],
                          capture_output=True, text=True, timeout=120).stdout
    assert "critic (ppo), per GPU: rollout " in text
    assert "largest critic_micro_batch_size_update within the budget:" in text


STUDY = {**PPO, "gradient_checkpointing": True, "offload_params": False,
         "offload_optimizer": False, "critic_gradient_checkpointing": False,
         "critic_offload_params": True, "critic_offload_optimizer": True,
         "max_prompt_length": 512, "max_response_length": 512, "rollout_engine": "vllm-like",
         "gpu_memory_utilization": 0.5, "rollout_tensor_parallel": 1,
         "rollout_batch_size": 64, "global_batch_size": 32, "use_kl": False,
         "dynamic_batching": False}
SEARCHED = ("micro_batch_size_update", "critic_micro_batch_size_update",
            "critic_offload_params", "critic_offload_optimizer", "critic_gradient_checkpointing")


@pytest.mark.parametrize("topology", [Topology(1, 2), Topology(1, 4), Topology(1, 8),
                                      Topology(2, 8)])
def test_a_ppo_study_exports_for_verl_on_its_own_ppo_trainer_yaml(topology):
    """verl's ppo_trainer.yaml trains a critic (gae): a PPO study's export keeps the
    estimator and writes the critic's searched keys, its forward micro-batch as its update's."""
    base = load_trainer_yaml(str(VERL_BASE))[0]
    study = {**STUDY, "rollout_batch_size": 1024, "global_batch_size": 256,  # its shapes
             "rollout_tensor_parallel": 2}
    plan = plan_export(VERL, study, topology, base, searched=(*SEARCHED,
                                                              "gpu_memory_utilization"))
    assert plan.problems == []
    assert "algorithm.adv_estimator" not in plan.values  # gae already
    assert plan.values["critic.ppo_micro_batch_size_per_gpu"] == 4
    assert plan.values["critic.forward_micro_batch_size_per_gpu"] == 4
    assert plan.values["critic.model.fsdp_config.param_offload"] is True
    assert plan.values["critic.model.enable_gradient_checkpointing"] is False
    assert any("critic.model.fsdp_config.optimizer_offload: false -> true" in line
               for line in plan.changes)
    # the same study as GRPO writes no critic key
    grpo = {k: v for k, v in STUDY.items() if not k.startswith("critic_")}
    grpo_plan = plan_export(VERL, {**grpo, "algorithm": "grpo", "rollout_n": 4}, topology,
                            None)
    assert not [key for key in grpo_plan.values if key.startswith("critic.") and
                key != "critic.enable"]


def test_a_ppo_study_exports_for_easyr1_and_is_refused_for_trl():
    plain = plan_export(EASYR1, STUDY, Topology(1, 8), None)
    assert plain.problems == []
    values = plain.values
    assert values["algorithm.adv_estimator"] == "gae"
    assert values["worker.critic.global_batch_size"] == values["worker.actor.global_batch_size"]
    assert values["worker.critic.micro_batch_size_per_device_for_experience"] == 4
    assert values["worker.critic.offload.offload_params"] is True
    # a critic micro-batch that does not split a device's share: EasyR1's own rule
    bad = plan_export(EASYR1, {**STUDY, "critic_micro_batch_size_update": 3}, Topology(1, 8),
                      None)
    assert any("worker.critic.micro_batch_size_per_device_for_update=3" in p
               for p in bad.problems)
    # EasyR1's default estimator is grpo: a PPO study on a base that says so is refused
    base = {"algorithm": {"adv_estimator": "grpo"}}
    refused = plan_export(EASYR1, STUDY, Topology(1, 8), base)
    assert any("algorithm.adv_estimator in your base config train grpo but the study "
               "measured ppo" in p for p in refused.problems)
    assert plan_export(EASYR1, STUDY, Topology(1, 8), base, force=True).problems == []
    trl = plan_export(TRL, {**STUDY, "rollout_engine": "hf"}, Topology(1, 1), None)
    assert any("trl: PPO (a critic) is not supported" in p for p in trl.problems)


@pytest.mark.slow
def test_a_ppo_sweep_runs_out_of_memory_is_killed_and_resumes(tmp_path):
    """`autotune run --algorithm ppo` (the CPU demo's PPO space) under a 520 MiB cap, its
    first trial a base config too large for it (about 565 MiB: no offload, the largest
    micro-batches): the OOM is measured, the driver killed after two trials, and the same
    command resumes with every finished trial kept and none probed twice."""
    base = tmp_path / "heavy.yaml"
    base.write_text("micro_batch_size_update: 4\nmicro_batch_size_experience: 8\n"
                    "critic_micro_batch_size_update: 4\ngradient_checkpointing: false\n"
                    "offload_params: false\ncritic_offload_params: false\n"
                    "critic_offload_optimizer: false\n")
    results = tmp_path / "results"
    command = [sys.executable, "-m", "autotune", "run", "--finalists", "0",
               "--algorithm", "ppo", "--study", "ppo",
               "--results-dir", str(results), "--gpu-memory-limit", "520MiB", "--trials", "3",
               "--warmup-steps", "0", "--timed-steps", "1", "--threads", "2", "--no-trace",
               "--base-config",
               str(base)]
    trials_csv = results / "ppo" / "trials.csv"
    assert not kill_after_trials(command, trials_csv, 2)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = f"sqlite:///{results / 'ppo' / 'study.db'}"
    before = {t.number: (t.state, t.params, t.values, t.user_attrs.get("status"))
              for t in optuna.load_study(study_name="ppo", storage=storage).trials
              if t.state.is_finished()}
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    study = optuna.load_study(study_name="ppo", storage=storage)
    for number, kept in before.items():
        trial = study.trials[number]
        assert (trial.state, trial.params, trial.values, trial.user_attrs.get("status")) == kept
    probed = [json.dumps(t.params, sort_keys=True) for t in study.trials
              if t.user_attrs.get("probed")]
    assert len(probed) == len(set(probed)) >= 3
    ooms = [t for t in study.trials if t.user_attrs.get("status") == "gpu_oom"
            and t.user_attrs.get("probed")]
    assert ooms and ooms[0].params["critic_micro_batch_size_update"] == 4
    rows = list(csv.DictReader(open(trials_csv)))
    ok = [r for r in rows if r["status"] == "ok" and r["reused_from"] == ""]
    assert ok and all(int(r["peak_mem_critic_update_bytes"]) > 0 for r in ok)
    best = yaml.safe_load((results / "ppo" / "best.yaml").read_text())
    assert best["config"]["algorithm"] == "ppo" and best["config"]["rollout_n"] == 1
    assert "critic_update" in best["measured"]["phase_peak_mem_bytes"]


@pytest.mark.parametrize("adapter", [VERL, EASYR1])
def test_a_ppo_export_reads_back_as_the_critic_the_study_measured(adapter):
    """The round trip of the critic's keys: the file's values, read as the trainer's config,
    give back the algorithm and every critic knob the study ran."""
    plan = plan_export(adapter, STUDY, Topology(1, 8), None)
    assert plan.problems == []
    read = adapter.read_knobs(lambda key, default: plan.values.get(key, default),
                              Topology(1, 8))
    assert read["algorithm"] == "ppo"
    for knob in ("critic_micro_batch_size_update", "critic_gradient_checkpointing",
                 "critic_offload_params", "critic_offload_optimizer", "global_batch_size"):
        assert read[knob] == STUDY[knob], knob
