"""Real probes on an NVIDIA GPU (marked `gpu`: run with `pytest -m gpu` where CUDA exists)."""

from __future__ import annotations

import pytest
import torch

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeStatus
from autotune.runners.local import SubprocessRunner

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONFIG = ProbeConfig(rollout_batch_size=8, rollout_n=4, global_batch_size=4,
                     micro_batch_size_update=4, micro_batch_size_experience=8,
                     max_prompt_length=256, max_response_length=128)


def test_qwen_05b_probe_on_gpu():
    result = SubprocessRunner().run(ProbeRequest(model="qwen2.5-0.5b", config=CONFIG,
                                                 device=Device("cuda")))
    assert result.status is ProbeStatus.OK, result.stderr_tail
    assert result.phase_allocator_peak_bytes["update"] > 16 * result.num_params
    assert result.tokens_per_s > 0


def test_forced_gpu_oom_is_classified():
    # 2 GiB cannot hold the 16 bytes/param of a 0.5B model's update (7.9 GB).
    request = ProbeRequest(model="qwen2.5-0.5b", config=CONFIG,
                           device=Device("cuda", limit_bytes=2 * 2**30))
    result = SubprocessRunner().run(request)
    assert result.status is ProbeStatus.GPU_OOM, (result.message, result.stderr_tail)
    assert "out of memory" in result.message.lower()


def test_memory_model_bounds_the_measured_gpu_peaks():
    """The exact model states are a lower bound of every measured phase; the uncalibrated
    prior is within a factor of 1.5 either way (calibration takes it the rest of the way)."""
    from autotune.memory.model import estimate_memory
    from autotune.memory.shape import model_shape

    result = SubprocessRunner().run(ProbeRequest(model="qwen2.5-0.5b", config=CONFIG,
                                                 device=Device("cuda")))
    assert result.status is ProbeStatus.OK, result.stderr_tail
    estimate = estimate_memory(model_shape("qwen2.5-0.5b"), CONFIG, on_gpu=True)
    for phase, measured in result.phase_peak_mem_bytes.items():
        part = estimate.phases[phase]
        assert measured >= part.states_bytes, phase
        assert 1 / 1.5 <= part.total_bytes / measured <= 1.5, (phase, part, measured)


def test_fsdp2_offload_leaves_the_gpu_on_an_emulated_rank():
    """offload_optimizer under FSDP2 (rank 0 of 2): AdamW's shard states go to the host for
    the rollout. DTensor.from_local moved them straight back to the GPU (held-out H200 rows
    00 and 08 held them resident); a CPU probe cannot show it (its host is its device)."""
    base = dict(rollout_batch_size=8, rollout_n=4, global_batch_size=8,
                micro_batch_size_update=4, micro_batch_size_experience=8,
                max_prompt_length=256, max_response_length=64, fsdp_strategy="fsdp2")
    runner = SubprocessRunner()
    results = {offload: runner.run(ProbeRequest(
        model="qwen2.5-0.5b", config=ProbeConfig(**base, offload_optimizer=offload),
        device=Device("cuda"), gpus_per_node=2, emulated=True, warmup_steps=1, timed_steps=1))
        for offload in (False, True)}
    assert all(r.ok for r in results.values()), [r.message for r in results.values()]
    adam_shard_bytes = 8 * results[True].num_params // 2
    moved = (results[False].phase_tensor_peak_bytes["rollout"]
             - results[True].phase_tensor_peak_bytes["rollout"])
    assert moved > 0.9 * adam_shard_bytes, (moved, adam_shard_bytes)
