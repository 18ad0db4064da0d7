"""The knobs act for real: checkpointing lowers peak memory, offload moves it to the host."""

from __future__ import annotations

import pytest
from conftest import small_request

from autotune.memory.host import NodeRun, node_host
from autotune.memory.shape import model_shape
from autotune.probe.measure.result import ProbeStatus
from autotune.runners.local import SubprocessRunner

# Long sequences and a large update micro-batch: activations dominate the update phase.
ACTIVATION_HEAVY = dict(rollout_batch_size=2, rollout_n=4, global_batch_size=2,
                        micro_batch_size_update=8, micro_batch_size_experience=8,
                        max_prompt_length=448, max_response_length=64, use_kl=False)


@pytest.fixture(scope="module")
def activation_heavy():
    """ACTIVATION_HEAVY at the knobs' defaults, no checkpointing and the old-log-prob pass on:
    the checkpointing test's plain probe and the old-log-prob test's `on` (one request)."""
    request = small_request(**ACTIVATION_HEAVY)
    assert request == small_request(**ACTIVATION_HEAVY, gradient_checkpointing=False) == \
        small_request(**ACTIVATION_HEAVY, old_logprob_pass=True)  # the defaults, still
    return SubprocessRunner().run(request)


def test_gradient_checkpointing_lowers_update_peak(make_request, activation_heavy):
    runner = SubprocessRunner()
    plain = activation_heavy
    ckpt = runner.run(make_request(**ACTIVATION_HEAVY, gradient_checkpointing=True))
    assert plain.ok and ckpt.ok, (plain.message, ckpt.message)
    saved = plain.phase_peak_mem_bytes["update"] - ckpt.phase_peak_mem_bytes["update"]
    # 4 layers x 4096 tokens x ~24 KB of fp32 activations per token and layer: ~390 MB.
    assert saved > 150 * 2**20, (plain.phase_peak_mem_bytes, ckpt.phase_peak_mem_bytes)


def test_offload_moves_states_from_device_to_host(make_request):
    runner = SubprocessRunner()
    # A warm-up step creates the AdamW state, so the timed rollout holds 16 -> 12 B/param.
    on = runner.run(make_request(warmup_steps=1, offload_params=True, offload_optimizer=True))
    off = runner.run(make_request(warmup_steps=1))
    assert on.ok and off.ok, (on.message, off.message)
    assert off.host_offload_bytes == 0
    states_bytes = 12 * on.num_params  # fp32 params 4 + Adam m, v 8
    assert on.host_offload_bytes >= states_bytes
    moved = off.phase_peak_mem_bytes["rollout"] - on.phase_peak_mem_bytes["rollout"]
    assert moved > 0.6 * states_bytes, (off.phase_peak_mem_bytes, on.phase_peak_mem_bytes)
    # The update phase loads everything back: it does not get cheaper (verl/EasyR1 semantics).
    assert on.phase_peak_mem_bytes["update"] > 0.8 * off.phase_peak_mem_bytes["update"]
    assert on.status is ProbeStatus.OK
    # what it holds on the host, measured (the shared memory of its offloaded tensors), is the
    # node model's held terms for its one rank within 10% (W = 2: test_host_memory.py)
    request = make_request(offload_params=True, offload_optimizer=True)
    host = node_host(model_shape(request.model), request.config, NodeRun(1, 1, False, 4),
                     2**40)
    assert on.host_held_peak_bytes == pytest.approx(host.rank_held_bytes, rel=0.10)
    assert off.host_held_peak_bytes < 0.1 * host.rank_held_bytes


def test_the_reference_waits_where_offload_ref_params_puts_it(make_request):
    """The reference model's params go to the host with offload_ref_params, apart from the
    actor's; unset, the reference follows offload_params (as every study before the knob)."""
    runner = SubprocessRunner()
    ref_only = runner.run(make_request(offload_ref_params=True))
    actor_only = runner.run(make_request(offload_params=True, offload_ref_params=False))
    both = runner.run(make_request(offload_params=True))
    assert ref_only.ok and actor_only.ok and both.ok
    ref_bytes = 4 * ref_only.num_params  # the fp32 reference of a CPU probe
    assert ref_only.host_offload_bytes == ref_bytes
    assert both.host_offload_bytes == actor_only.host_offload_bytes + ref_bytes
    # on the device, the rollout holds the reference unless it waits on the host
    assert both.phase_peak_mem_bytes["rollout"] < \
        actor_only.phase_peak_mem_bytes["rollout"] - 0.6 * ref_bytes


def test_without_the_old_log_prob_pass_trl_s_experience_runs_no_forward(make_request,
                                                                         activation_heavy):
    """TRL at beta 0 and num_iterations 1 (its defaults, one optimizer step a generation)
    takes no reference and no old-log-prob forward: the update uses its own log-probs,
    detached. A real probe of each: the pass off holds nothing of a forward in experience
    (its peak falls by the logits and activations of a micro-batch), the update is the
    same step, and the memory model follows the same switch."""
    from dataclasses import replace

    from autotune.memory.model import estimate_memory

    on = activation_heavy
    off = SubprocessRunner().run(make_request(**ACTIVATION_HEAVY, old_logprob_pass=False))
    assert on.ok and off.ok, (on.message, off.message)
    saved = on.phase_peak_mem_bytes["experience"] - off.phase_peak_mem_bytes["experience"]
    config = make_request(**ACTIVATION_HEAVY).config
    shape = model_shape("tiny-qwen2.5")
    modelled = {flag: estimate_memory(shape, replace(config, old_logprob_pass=flag),
                                      on_gpu=False).phases["experience"].total_bytes
                for flag in (True, False)}
    assert modelled[True] - modelled[False] > 100 * 2**20  # 8 x 512 tokens' logits at least
    assert saved > 0.5 * (modelled[True] - modelled[False]), (on.phase_peak_mem_bytes,
                                                               off.phase_peak_mem_bytes)
    # None: the batches decide, as TRL's own rule (one step a generation here: off)
    assert replace(config, old_logprob_pass=None).runs_old_logprob_pass is False
    assert replace(config, old_logprob_pass=None,
                   rollout_batch_size=4).runs_old_logprob_pass is True
