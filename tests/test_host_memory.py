"""The node's host memory (memory/host.py): its terms against what real probes hold on the host,
its verdict in `estimate` and in a real CPU sweep."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.config import ProbeConfig
from autotune.errors import ConfigError
from autotune.hardware import Device
from autotune.memory.host import (
    RAY_THRESHOLD_ENV,
    NodeRun,
    engine_blocks,
    fsdp_unit_params,
    node_host,
    offload_units,
    parameter_sizes,
    pinned_bytes,
    ray_threshold,
)
from autotune.memory.shape import model_shape
from autotune.probe.measure.result import ProbeRequest, ProbeStatus
from autotune.registry import REGISTRY
from autotune.runners.local import SubprocessRunner

GiB = 2**30
OFFLOADED = ProbeConfig(rollout_batch_size=4, rollout_n=2, global_batch_size=2,
                        micro_batch_size_update=2, micro_batch_size_experience=4,
                        max_prompt_length=32, max_response_length=32, offload_params=True,
                        offload_optimizer=True)


def test_pinned_blocks_round_up_to_a_power_of_two():
    assert pinned_bytes([4096, 4097, 3 * GiB, 0]) == 4096 + 8192 + 4 * GiB
    assert pinned_bytes([1]) == 1


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_blocks_hold_every_parameter_once(name):
    shape = model_shape(name)
    units = fsdp_unit_params(shape)
    assert sum(units) == shape.num_params and min(units) > 0
    assert sum(parameter_sizes(shape)) == shape.num_params  # one entry a tensor
    for tp in (1, 2):
        assert sum(engine_blocks(shape, 2, tp)) == 2 * shape.engine_params(tp)


def test_ray_threshold_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(RAY_THRESHOLD_ENV, raising=False)
    assert ray_threshold() == 0.95
    monkeypatch.setenv(RAY_THRESHOLD_ENV, "0.8")
    assert ray_threshold() == 0.8
    for bad in ("1.5", "nope", "0"):
        monkeypatch.setenv(RAY_THRESHOLD_ENV, bad)
        with pytest.raises(ConfigError, match=RAY_THRESHOLD_ENV):
            ray_threshold()


def test_each_trainer_loads_and_kills_as_its_code_does(monkeypatch):
    monkeypatch.delenv(RAY_THRESHOLD_ENV, raising=False)
    shape = model_shape("qwen2.5-7b")  # untied embeddings: verl loads on rank 0 only
    tied = model_shape("qwen2.5-0.5b")  # tied: verl's ranks each load it
    config = ProbeConfig(rollout_engine="vllm-like")
    psi = shape.num_params

    def host(trainer, model=shape):
        return node_host(model, config, NodeRun(8, 8, True, 2, trainer), 2000 * GiB)

    assert host("easyr1").phases["startup"]["checkpoint_load x1"] == 4 * psi
    assert host("verl").phases["startup"]["checkpoint_load x1"] == 4 * psi
    assert host("verl", tied).phases["startup"]["checkpoint_load x8"] == 8 * 4 * tied.num_params
    assert host("trl").phases["startup"]["checkpoint_load x8"] == 8 * (4 + 4) * psi  # + ref
    assert (host("easyr1").threshold, host("trl").threshold) == (0.95, 1.0)
    assert "ray_processes" in host("verl").phases["update"]
    assert "ray_processes" not in host("trl").phases["update"]


def test_offload_and_sleep_are_on_the_host_once_pinned_blocks_are_cached():
    shape = model_shape("qwen2.5-7b")
    psi = shape.num_params
    run = NodeRun(8, 8, True, 2, "easyr1")
    off = node_host(shape, ProbeConfig(rollout_engine="vllm-like", sleep_level=2), run,
                    2000 * GiB)
    on = node_host(shape, ProbeConfig(rollout_engine="vllm-like", offload_params=True,
                                      offload_optimizer=True, sleep_level=1), run, 2000 * GiB)
    held = on.total("update") - off.total("update")
    # params 4 + AdamW 8 B/param over 8 ranks x 8 ranks on the node, the reference (2 B x 2
    # pinned buffers) and each rank's engine asleep (2 B/param): with power-of-two rounding
    exact = 12 * psi + 4 * psi + 8 * 2 * shape.engine_params(1)
    assert exact < held < 2 * exact
    assert on.total("update") == on.total("rollout")  # pinned blocks stay cached
    assert off.total("rollout") == off.total("update")


GPU_EVIDENCE = Path(__file__).parent.parent / "benchmarks" / "results" / "gpu" / \
    "gpu_evidence.json"


def test_offload_pins_a_block_a_tensor_as_the_wrapper_holds_them():
    """Measured on an H200: the probe's 0.5B offloading params, AdamW's state and the
    reference pinned 13,007,669,249 bytes in PyTorch's host allocator, one block per tensor,
    each rounded up to a power of two (benchmarks/results/gpu). The node model's held terms
    for that rank are those blocks; FSDP1 (EasyR1's and verl's fsdp) moves one flat
    parameter per unit instead."""
    row = next(r for r in json.loads(GPU_EVIDENCE.read_text()) if r["label"] == "0.5b offload")
    shape = model_shape("qwen2.5-0.5b")
    config = ProbeConfig(offload_params=True, offload_optimizer=True)  # reference: on host
    held = node_host(shape, config, NodeRun(1, 1, True, 2), 2000 * GiB).rank_held_bytes
    assert held == pytest.approx(row["host_held_peak_bytes"], abs=1 << 20)
    assert offload_units(shape, config, 1) == parameter_sizes(shape)
    fsdp1 = dataclasses.replace(config, fsdp_strategy="fsdp")
    assert offload_units(shape, fsdp1, 8) == fsdp_unit_params(shape)
    assert offload_units(shape, fsdp1, 1) == parameter_sizes(shape)  # one GPU: no wrapper


@pytest.mark.slow
def test_two_ranks_hold_on_the_host_what_the_node_model_says(tmp_path):
    """A real CPU probe of two real FSDP ranks with every offload on: the host memory they
    hold, measured (the shared memory the offloaded tensors live in), within 10% of the node
    model's held terms for the ranks on the node (W = 1: test_probe_knobs.py)."""
    world = 2
    request = ProbeRequest(model="tiny-qwen2.5", config=OFFLOADED, device=Device("cpu"),
                           cpu_threads=2, warmup_steps=1, timed_steps=1, timeout_s=300.0,
                           nnodes=1, gpus_per_node=world)
    result = SubprocessRunner().run(request, tmp_path / "probe.log")
    assert result.status is ProbeStatus.OK, (result.message, result.stderr_tail)
    host = node_host(model_shape("tiny-qwen2.5"), OFFLOADED,
                     NodeRun(world, world, False, 4), 64 * GiB)
    modelled = world * host.rank_held_bytes
    assert result.host_held_peak_bytes == pytest.approx(modelled, rel=0.10), \
        (result.host_held_peak_bytes, modelled)
    # params 4 + AdamW 8 + the fp32 reference 4 B/param, over W ranks, on the node
    assert modelled == pytest.approx(16 * result.num_params, rel=0.01)


def test_estimate_takes_every_constraint_run_takes():
    def estimate(*args):
        return subprocess.run([sys.executable, "-m", "autotune", "estimate", "--model",
                               "qwen2.5-vl-7b", "--gpus-per-node", "8", *args],
                              capture_output=True, text=True)

    offload = ["--set", "offload_params=true", "--set", "offload_optimizer=true",
               "--engine", "vllm-like"]
    small = estimate(*offload, "--trainer", "easyr1", "--host-memory", "128GiB", "--json")
    large = estimate(*offload, "--trainer", "easyr1", "--host-memory", "2TiB", "--json")
    assert small.returncode == 0 and large.returncode == 0, small.stderr
    small_host, large_host = json.loads(small.stdout), json.loads(large.stdout)
    assert small_host["node_host"]["host_oom"] and not large_host["node_host"]["host_oom"]
    assert small_host["binding_constraint"].startswith("past constraint: the node's host")
    text = estimate(*offload, "--trainer", "easyr1", "--host-memory", "128GiB",
                    "--host-memory-limit", "8GiB", "--gpu-memory-limit", "40GiB",
                    "--reserve-gpu-memory", "4GiB")
    assert text.returncode == 0, text.stderr
    assert "node host memory: predicted host_oom" in text.stdout
    assert "capacity 40.00 GiB per device, budget 36.00 GiB" in text.stdout  # the lower cap
    # the trainer's own spellings: TRL's rollout.n and micro-batch, verl's micro-batch
    trl = estimate("--trainer", "trl", "--set", "num_generations=8", "--set",
                   "per_device_train_batch_size=2", "--json")
    verl = estimate("--trainer", "verl", "--set", "ppo_micro_batch_size_per_gpu=2", "--json")
    plain = estimate("--set", "rollout_n=8", "--set", "micro_batch_size_update=2", "--json")
    assert trl.returncode == 0 and verl.returncode == 0, (trl.stderr, verl.stderr)
    assert json.loads(trl.stdout)["phase_bytes"]["update"] == \
        json.loads(estimate("--trainer", "trl", "--set", "rollout_n=8", "--set",
                            "micro_batch_size_update=2", "--json").stdout)["phase_bytes"]["update"]
    assert json.loads(verl.stdout)["phase_bytes"]["update"] < \
        json.loads(plain.stdout)["phase_bytes"]["update"] * 2
    for args, needle in ((["--host-memory", "lots"], "--host-memory 'lots'"),
                         (["--host-memory-limit", "0"], "--host-memory-limit"),
                         (["--trainer", "verl", "--set", "nonsense=1"], "nonsense"),
                         # a key TRL reads with others: all of them, or the knobs
                         (["--trainer", "trl", "--set", "vllm_tensor_parallel_size=2"],
                          "use_vllm, vllm_mode; give those too"),
                         # TRL's server mode is placement=separate: it needs the split
                         (["--trainer", "trl", "--set", "use_vllm=true", "--set",
                           "vllm_mode=server", "--set", "vllm_tensor_parallel_size=1"],
                          "placement=separate needs rollout_gpus"),
                         # values TRL reads into no knob autotune can probe: one line too
                         (["--trainer", "trl", "--set", "use_vllm=true", "--set",
                           "vllm_mode=offline", "--set", "vllm_tensor_parallel_size=1"],
                          "autotune cannot probe"),
                         (["--trainer", "trl", "--set", "per_device_train_batch_size=4",
                           "--set", "generation_batch_size=abc", "--set",
                           "steps_per_generation=4", "--set", "gradient_accumulation_steps=4"],
                          "check the values"),
                         (["--trainer", "nope"], "--trainer")):
        bad = estimate(*args)
        assert bad.returncode == 2, (args, bad.stderr)
        assert needle in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) <= 2, bad.stderr
    # TRL's batch keys are per process: without the run's topology they say nothing
    batches = ["--set", "per_device_train_batch_size=4", "--set", "steps_per_generation=4",
               "--set", "generation_batch_size=128", "--set", "gradient_accumulation_steps=4"]
    alone = subprocess.run([sys.executable, "-m", "autotune", "estimate", "--model",
                            "qwen2.5-7b", "--trainer", "trl", *batches], capture_output=True,
                           text=True)
    assert alone.returncode == 2 and "give --nnodes and --gpus-per-node" in alone.stderr
    read = json.loads(estimate("--trainer", "trl", *batches, "--set", "num_generations=8",
                               "--json").stdout)
    # 4 responses x 8 processes x 4 steps = 128 responses, 16 prompts of 8, a step and an
    # optimizer step alike
    assert read["phase_bytes"] == json.loads(estimate(
        "--trainer", "trl", "--set", "rollout_n=8", "--set", "rollout_batch_size=16", "--set",
        "global_batch_size=16", "--set", "micro_batch_size_update=4", "--json").stdout
                                             )["phase_bytes"]


@pytest.mark.slow
def test_a_sweep_never_probes_a_config_the_node_cannot_hold(tmp_path):
    """A real CPU sweep on a node too small for any offloaded config (its Ray processes and
    batch fit; the offloaded states on top do not): every such config is predicted host_oom,
    none probed, and the best keeps offload off."""
    shape = model_shape("tiny-qwen2.5")
    run = NodeRun(1, 1, False, 4)
    kept = node_host(shape, dataclasses.replace(OFFLOADED, offload_params=False,
                                                offload_optimizer=False), run, 64 * GiB)
    assert kept.peak_bytes < node_host(shape, OFFLOADED, run, 64 * GiB).peak_bytes
    host_bytes = int((kept.peak_bytes + 8 * 2**20) / 0.95)  # the smallest offload: 28 MiB
    out = subprocess.run(
        [sys.executable, "-m", "autotune", "run", "--finalists", "0",
         "--model", "tiny-qwen2.5", "--device", "cpu",
         "--space", "cpu-demo", "--trials", "2", "--warmup-steps", "0", "--timed-steps", "1",
         "--set", "max_prompt_length=16", "--set", "max_response_length=16",
         "--sampler", "random", "--no-trace", "--host-memory", f"{host_bytes}B",
         "--results-dir", str(tmp_path), "--study", "node"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "RAY_memory_usage_threshold": "0.95"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "node" / "trials.csv")))
    offloaded = [r for r in rows if r["offload_params"] == "True" or
                 r["offload_optimizer"] == "True"]
    assert offloaded, "the sweep never asked an offloaded config (the safe one is)"
    assert all(r["status"] == "host_oom" and r["predicted"] == "True" for r in offloaded), rows
    probed = [r for r in rows if r["predicted"] == "False" and not r["reused_from"]]
    assert len(probed) == 2 and all(r["offload_params"] == "False" and
                                    r["offload_optimizer"] == "False" for r in probed)
    best = yaml.safe_load((tmp_path / "node" / "best.yaml").read_text())
    assert not best["config"]["offload_params"] and not best["config"]["offload_optimizer"]
    assert best["node_host"]["host_oom"] is False
    assert best["node_host"]["kill_bytes"] == int(0.95 * host_bytes)
    show = subprocess.run([sys.executable, "-m", "autotune", "show", "--results-dir",
                           str(tmp_path), "--study", "node"], capture_output=True, text=True)
    assert "node host memory: fits" in show.stdout, show.stdout + show.stderr


def test_estimate_prints_easyr1s_own_figures_as_it_logs_them():
    """`estimate --trainer easyr1` predicts the two figures EasyR1 logs: torch's reserved
    peak less what the engine's sleep freed (the largest phase without the engine's pool or
    what lives outside torch) and psutil's used memory of the node at the end of the update
    (every host term but /dev/shm's object store); other trainers get none."""
    argv = [sys.executable, "-m", "autotune", "estimate", "--model", "qwen2.5-vl-7b",
            "--gpus-per-node", "8", "--device", "cuda", "--capacity", "80GiB",
            "--host-memory", "2TB", "--json", "--set", "rollout_engine=vllm-like",
            "--set", "offload_params=true", "--set", "offload_optimizer=true"]
    easyr1 = json.loads(subprocess.run([*argv, "--trainer", "easyr1"], capture_output=True,
                                       text=True, check=True).stdout)
    figures = easyr1["trainer_figures"]
    reserved = figures["perf/max_memory_reserved_gb"]
    assert reserved["label"] == "Peak VRAM"
    phases = easyr1["phase_bytes"]
    training = max(phases["experience"], phases["update"])
    # the rollout binds the card with the engine's pool; EasyR1's figure leaves the pool and
    # what lives outside torch out: the training phases' reserve
    assert phases["rollout"] > training > reserved["bytes"] > training - 2 * GiB
    update_terms = easyr1["node_host"]["terms"]["update"]
    assert figures["perf/cpu_memory_used_gb"]["bytes"] == sum(update_terms.values()) \
        - update_terms["ray_object_store_batch"]
    verl = json.loads(subprocess.run([*argv, "--trainer", "verl"], capture_output=True,
                                     text=True, check=True).stdout)
    assert verl["trainer_figures"] == {}
