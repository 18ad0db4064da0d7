"""Probes the size of the real run: FSDP2-sharded ranks, real (gloo processes) or emulated
(one rank over torch's fake process group), on the CPU with the tiny models.

Every probe here is a real GRPO step: real sharding, real collectives between real processes,
real allocations. The only thing standing in is the device: the CPU's anonymous RSS is each
rank's device memory, as everywhere in the CPU tests.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time

import optuna
import psutil
import pytest
import yaml

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.memory.shape import model_shape
from autotune.memory.states import model_state_bytes
from autotune.probe.launch.launcher import FAULT_LIMIT_ENV
from autotune.probe.measure.result import ProbeRequest, ProbeStatus
from autotune.runners.local import SubprocessRunner

pytestmark = pytest.mark.slow

TEXT = ProbeConfig(rollout_batch_size=4, rollout_n=4, global_batch_size=2,
                   micro_batch_size_update=2, micro_batch_size_experience=4,
                   max_prompt_length=32, max_response_length=32)
VL = ProbeConfig(**{**TEXT.as_dict(), "max_prompt_length": 64, "image_size_px": 112})


def request(model="tiny-qwen2.5", config=TEXT, world=2, emulated=False, **extra):
    return ProbeRequest(model=model, config=config, device=Device("cpu"), cpu_threads=2,
                        warmup_steps=0, timed_steps=1, timeout_s=300.0, nnodes=1,
                        gpus_per_node=world, emulated=emulated, **extra)


def probe(tmp_path, name, **kwargs):
    result = SubprocessRunner().run(request(**kwargs), tmp_path / f"{name}.log")
    assert result.status is ProbeStatus.OK, (result.message, result.stderr_tail)
    return result


@pytest.fixture(scope="module")
def text_probes(tmp_path_factory):
    """One 1-rank probe, one real 2-rank probe and one emulated 2-rank probe of one config."""
    where = tmp_path_factory.mktemp("text")
    return {"one": probe(where, "one", world=1), "real": probe(where, "real"),
            "emulated": probe(where, "emulated", emulated=True)}


@pytest.fixture(scope="module")
def vl_real(tmp_path_factory):
    """The real 2-rank probe of the VL model: its own test's, and the tensor-parallel test's
    untouched engine in its VL case (the same request)."""
    return probe(tmp_path_factory.mktemp("vl"), "vl", model="tiny-qwen2.5-vl", config=VL)


def test_a_real_two_rank_probe_holds_half_the_model_states(text_probes):
    one, real = text_probes["one"], text_probes["real"]
    assert (real.world_size, real.emulated, len(real.rank_peak_mem_bytes)) == (2, False, 2)
    assert set(real.phase_peak_mem_bytes) == {"rollout", "experience", "update"}
    for part in ("params", "grads", "optimizer"):
        assert real.model_state_bytes[part] == pytest.approx(
            one.model_state_bytes[part] / 2, rel=0.02), part
    # the memory model's states term is the probe's, exactly, at W = 1 and W = 2
    psi = model_shape("tiny-qwen2.5").num_params
    for world, result in ((1, one), (2, real)):
        assert sum(result.model_state_bytes.values()) == \
            model_state_bytes(psi, world).update_bytes


def test_an_emulated_rank_matches_the_real_ranks_per_phase(text_probes):
    real, emulated = text_probes["real"], text_probes["emulated"]
    assert (emulated.world_size, emulated.emulated, emulated.rank_peak_mem_bytes) == \
        (2, True, [])
    assert emulated.model_state_bytes == real.model_state_bytes
    for phase, peak in real.phase_peak_mem_bytes.items():
        assert emulated.phase_peak_mem_bytes[phase] == pytest.approx(peak, rel=0.10), phase


def test_a_real_two_rank_probe_of_the_vl_model_runs_every_phase(vl_real):
    result = vl_real
    assert set(result.phase_peak_mem_bytes) == {"rollout", "experience", "update"}
    psi = model_shape("tiny-qwen2.5-vl").num_params
    assert sum(result.model_state_bytes.values()) == pytest.approx(
        model_state_bytes(psi, 2).update_bytes, rel=0.001)  # FSDP pads odd rows a little


def test_an_emulated_rank_of_eight_runs(tmp_path):
    config = ProbeConfig(**{**TEXT.as_dict(), "rollout_batch_size": 8, "global_batch_size": 8,
                            "micro_batch_size_update": 4})
    result = probe(tmp_path, "w8", config=config, world=8, emulated=True)
    psi = model_shape("tiny-qwen2.5").num_params
    assert sum(result.model_state_bytes.values()) == model_state_bytes(psi, 8).update_bytes
    assert result.share["responses_per_step"] == 4


@pytest.mark.parametrize("model,config", [("tiny-qwen2.5", TEXT), ("tiny-qwen2.5-vl", VL)])
def test_a_tensor_parallel_engine_holds_what_the_memory_model_says(tmp_path, model, config,
                                                                   text_probes, vl_real):
    """rollout_tensor_parallel=2 over two real ranks: each rank's engine holds its shard of
    every layer (torch's tensor-parallel API on the engine copy), exactly memory.py's count.
    (The tiny model's saving, 6 MiB, is within the rollout peak's noise: that is not tested.)"""
    split = ProbeConfig(**{**config.as_dict(), "rollout_tensor_parallel": 2})
    # the untouched engine (rollout_tensor_parallel=1): the very request text_probes["real"]
    # and vl_real probed, so its result is theirs
    whole = text_probes["real"] if config is TEXT else vl_real
    halved = probe(tmp_path, "tp2", model=model, config=split)
    shape = model_shape(model)
    assert whole.engine_weight_bytes == 4 * shape.engine_params(1) == 4 * shape.num_params
    assert halved.engine_weight_bytes == 4 * shape.engine_params(2)
    assert halved.phase_peak_mem_bytes["rollout"] < 1.02 * whole.phase_peak_mem_bytes["rollout"]


def test_an_oom_in_rank_one_ends_the_probe_naming_that_rank(tmp_path, monkeypatch):
    """A cap on rank 1 alone: rank 1 runs out, rank 0 is not left waiting in a collective."""
    monkeypatch.setenv(FAULT_LIMIT_ENV, "1:380MiB")
    started = time.monotonic()
    result = SubprocessRunner().run(request(), tmp_path / "oom.log")
    assert result.status is ProbeStatus.GPU_OOM, (result.message, result.stderr_tail)
    assert result.failed_rank == 1 and result.message.startswith("rank 1: ")
    assert result.failed_phase in ("rollout", "experience", "update")
    assert time.monotonic() - started < 120
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers


def autotune(*args, **kwargs):
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True,
                          text=True, timeout=900, **kwargs)


def test_real_ranks_that_are_not_here_are_refused_in_one_line():
    cores = len(psutil.Process().cpu_affinity())
    refused = autotune("probe", "--model", "tiny-qwen2.5", "--device", "cpu", "--ranks", "real",
                       "--nnodes", "2", "--gpus-per-node", str(cores))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"Error: --ranks real: the run's {2 * cores} GPUs need {2 * cores} cores here, "
        f"{cores} found; use --ranks emulated (exact per-rank memory on one device)"]


SPACE = """
params:
  micro_batch_size_update: {type: categorical, choices: [1, 2]}
  gradient_checkpointing: {type: bool}
fixed: {rollout_batch_size: 4, rollout_n: 2, global_batch_size: 2, max_prompt_length: 32,
        max_response_length: 32, micro_batch_size_experience: 4}
"""


def test_a_two_rank_sweep_runs_real_probes_and_resumes_after_sigkill(tmp_path):
    space = tmp_path / "space.yaml"
    # two configs: the first probed, the second killed mid-probe and probed again on resume
    space.write_text(SPACE.replace("choices: [1, 2]", "choices: [1]"))
    command = [sys.executable, "-m", "autotune", "run", "--finalists", "0",
               "--model", "tiny-qwen2.5",
               "--device", "cpu", "--gpus-per-node", "2", "--ranks", "real",
               "--space", str(space), "--study", "w2", "--results-dir", str(tmp_path),
               "--warmup-steps", "0", "--timed-steps", "1", "--sampler", "random",
               "--no-trace"]  # the resume is under test, not the traced pre-screen
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    logs = tmp_path / "w2" / "logs"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and driver.poll() is None:
        if len(list(logs.glob("trial-*.rank1.request.json"))) >= 2:  # the second probe runs
            break
        time.sleep(0.2)
    time.sleep(2)
    probes = psutil.Process(driver.pid).children(recursive=True)
    assert len(probes) >= 3, driver.stderr.read().decode()[-2000:]  # launcher and two ranks
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    _, alive = psutil.wait_procs(probes, timeout=10)
    assert not alive, "a rank outlived its killed driver"
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    study = optuna.load_study(study_name="w2", storage=f"sqlite:///{tmp_path}/w2/study.db")
    probed = [json.dumps(t.params, sort_keys=True) for t in study.trials
              if t.user_attrs.get("probed")]
    assert len(probed) == len(set(probed)) == 2  # every config once, none twice
    for trial in study.trials:
        if trial.user_attrs.get("probed") and trial.user_attrs["status"] == "ok":
            result = trial.user_attrs["result"]
            assert (result["world_size"], result["emulated"]) == (2, False)
            assert len(result["rank_peak_mem_bytes"]) == 2


MID_MODEL = {  # 78M parameters: 1.16 GiB of fp32 params, grads and AdamW on one rank
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 512,
    "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 4,
    "intermediate_size": 1536, "vocab_size": 4096, "tie_word_embeddings": True,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6,
    "max_position_embeddings": 4096}
HEADLINE_SPACE = """
params:  # one config: the path, not the search, is what this test holds
  gradient_checkpointing: {type: categorical, choices: [true]}
fixed: {rollout_batch_size: 8, rollout_n: 1, global_batch_size: 8, max_prompt_length: 32,
        max_response_length: 32, micro_batch_size_update: 1, micro_batch_size_experience: 1}
"""


def test_states_too_big_for_one_device_fit_an_emulated_eight_way_shard(tmp_path):
    """The headline path with a model standing in for the 7B: its states alone exceed the
    1 GiB device, so one rank cannot hold it; one rank of eight can, and the sweep finds it."""
    model = tmp_path / "mid"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MID_MODEL))
    space = tmp_path / "space.yaml"
    space.write_text(HEADLINE_SPACE)
    common = ["run", "--finalists", "0",
              "--model-path", str(model), "--device", "cpu", "--space", str(space),
              "--gpu-memory-limit", "1GiB", "--results-dir", str(tmp_path / "results"),
              "--warmup-steps", "0", "--timed-steps", "1", "--threads", "2",
              "--no-trace"]  # one config, the safe one: probed whatever a trace says
    alone = autotune(*common, "--study", "w1")
    assert alone.returncode == 2 and "model states" in alone.stderr, alone.stderr[-2000:]
    sharded = autotune(*common, "--study", "w8", "--gpus-per-node", "8")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert "emulate one rank of the run's 8 GPUs" in sharded.stderr
    best = yaml.safe_load((tmp_path / "results" / "w8" / "best.yaml").read_text())
    assert best["provenance"]["topology"]["ranks"] == "emulated"
    assert best["measured"]["peak_mem_bytes"] <= best["measured"]["budget_bytes"]


def test_an_emulated_sweep_confirms_its_best_with_real_ranks_once(tmp_path):
    """--ranks auto on a 2-GPU run whose ranks fit here: emulated probes, then the best one
    probed again with two real ranks; best.yaml carries both; a resume confirms nothing again."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE.replace("choices: [1, 2]", "choices: [2]"))
    command = ["run", "--finalists", "0",
               "--model", "tiny-qwen2.5", "--device", "cpu", "--gpus-per-node", "2",
               "--space", str(space), "--study", "c", "--results-dir", str(tmp_path),
               "--warmup-steps", "0", "--timed-steps", "1", "--confirm", "1", "--no-trace"]
    first = autotune(*command)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "then probed with 2 real ranks" in first.stderr
    assert first.stderr.count("confirming trial ") == 1
    best = yaml.safe_load((tmp_path / "c" / "best.yaml").read_text())
    assert best["provenance"]["topology"]["ranks"] == "emulated"
    confirmed = best["confirmed"]
    assert (confirmed["status"], confirmed["world_size"], confirmed["feasible"]) == \
        ("ok", 2, True)
    assert len(confirmed["rank_peak_mem_bytes"]) == 2
    again = autotune(*command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "confirming trial" not in again.stderr


TRAINER_SPACE = """
params:
  micro_batch_size_update: {type: categorical, choices: [1, 2]}
fixed: {rollout_batch_size: 4, rollout_n: 2, global_batch_size: 2, max_prompt_length: 32,
        max_response_length: 32, micro_batch_size_experience: 2, dynamic_batching: false,
        offload_params: false, offload_optimizer: false, use_kl: true,
        gradient_checkpointing: true}
"""


@pytest.mark.parametrize("trainer, strategy_in_base, wrapper, alloc_conf", [
    ("easyr1", None, "fsdp", "expandable_segments:False"),  # FSDP1, its Ray runtime env
    ("verl", None, "fsdp", None),  # verl's default strategy: fsdp (FSDP1)
    ("verl", "fsdp2", "fsdp2", None),  # a base config of strategy: fsdp2
])
def test_a_probe_runs_as_its_trainer_runs(tmp_path, trainer, strategy_in_base, wrapper,
                                          alloc_conf):
    """--trainer decides how the probe's ranks are wrapped (EasyR1: FSDP1 always; verl: its
    base config's actor strategy, else its default fsdp) and the environment its workers get
    (EasyR1's Ray runtime env: expandable segments off, no record_stream for NCCL); a real
    probe of the planned request records both, as it ran them."""
    from autotune.sweep.plan import ProbeOptions, RunOptions, plan_sweep

    space = tmp_path / "space.yaml"
    space.write_text(TRAINER_SPACE)
    base = None
    if strategy_in_base:
        base = tmp_path / "verl.yaml"
        base.write_text(f"algorithm:\n  adv_estimator: grpo\nactor_rollout_ref:\n  actor:\n"
                        f"    strategy: {strategy_in_base}\n")
    plan = plan_sweep(RunOptions(
        probe=ProbeOptions(model="tiny-qwen2.5", device="cpu", gpus_per_node=2,
                           ranks="emulated", cpu_threads=2, timed_steps=1),
        space=str(space), trainer=trainer, base_config=str(base) if base else None,
        results_dir=str(tmp_path), study=trainer))
    plan.runner.close()
    request = plan.settings.request
    assert request.config.fsdp_strategy == wrapper
    assert request.env.get("PYTORCH_CUDA_ALLOC_CONF") == alloc_conf
    result = SubprocessRunner().run(
        dataclasses.replace(request, warmup_steps=0, timeout_s=300.0), tmp_path / "probe.log")
    assert result.ok, result.stderr_tail
    assert result.fsdp_strategy == wrapper
    assert result.allocator.get("PYTORCH_CUDA_ALLOC_CONF") == alloc_conf
    if trainer == "easyr1":
        assert result.allocator["TORCH_NCCL_AVOID_RECORD_STREAMS"] == "1"
    # expandable segments: verl turns them on for its training phases (on a GPU; on this
    # CPU the knob is off), EasyR1 never
    assert result.allocator["expandable_segments_in"] == "none"


def test_fsdp1_ranks_real_and_emulated_hold_the_same_half_states(tmp_path):
    """FSDP1 (EasyR1's and verl's default wrapper) over two real gloo ranks and over one
    emulated rank: each rank holds half the model states as flat shards, and the emulated
    rank's phase peaks are the real ranks' within 10%."""
    config = dataclasses.replace(TEXT, fsdp_strategy="fsdp")
    real = probe(tmp_path, "fsdp1-real", config=config)
    emulated = probe(tmp_path, "fsdp1-emulated", config=config, emulated=True)
    psi = model_shape("tiny-qwen2.5").num_params
    for result in (real, emulated):
        assert result.fsdp_strategy == "fsdp"
        # flat shards are padded to a multiple of the world size: at most a few elements
        assert sum(result.model_state_bytes.values()) == pytest.approx(
            model_state_bytes(psi, 2).update_bytes, rel=0.001)
    for phase, peak in real.phase_peak_mem_bytes.items():
        assert emulated.phase_peak_mem_bytes[phase] == pytest.approx(peak, rel=0.10), phase


def test_a_shard_moved_off_its_mesh_device_stays_where_it_was_moved():
    """map_local (offload's move of an FSDP2 shard or AdamW state) wraps the moved local
    itself: DTensor.from_local would move a local on another device back to the mesh's (the
    GPU), which kept offloaded states resident on an H200 (held-out rows 00 and 08). Here
    the other device is `meta`; tests/test_probe_gpu.py holds the GPU rank to it."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from autotune.probe.modeling.sharding import join_group, leave_group, local_tensor, map_local

    group = join_group(2, emulated=True, device=torch.device("cpu"))
    try:
        sharded = distribute_tensor(torch.ones(8, 4), group.mesh, [Shard(0)])
        moved = torch.empty(4, 4, device="meta")
        result = map_local(sharded, lambda local: moved)
        assert local_tensor(result) is moved
        assert result.device.type == "meta" and tuple(result.shape) == (8, 4)
        assert result.placements == sharded.placements
    finally:
        leave_group()
