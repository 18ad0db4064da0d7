"""One batch vocabulary: batches count prompts for the whole run, micro-batches count responses
per GPU, and every part agrees on one GPU's share for W = 1, 2 and 8.

config.device_share is the definition; the memory model, each trainer adapter (computing the
share as that trainer's own code normalises it) and a real probe (counting what it ran) must
all come out the same.
"""

from __future__ import annotations

import pytest

from autotune.config import ProbeConfig, Topology, device_share, validate_probe_config
from autotune.hardware import Device
from autotune.memory.model import estimate_memory
from autotune.memory.shape import model_shape
from autotune.probe.measure.result import ProbeRequest, ProbeStatus
from autotune.runners.local import SubprocessRunner
from autotune.trainers import ADAPTERS

# 8 prompts x 2 responses per step, 4 prompts per optimizer step: valid on 1, 2 and 8 GPUs
CONFIG = ProbeConfig(rollout_batch_size=8, rollout_n=2, global_batch_size=4,
                     micro_batch_size_update=1, micro_batch_size_experience=2, val_batch_size=8,
                     max_prompt_length=16, max_response_length=8, max_num_seqs=64)
EXPECTED = {  # W: (prompts, responses per step, per optimizer step, optimizer steps, val)
    1: (8, 16, 8, 2, 8),
    2: (4, 8, 4, 2, 4),
    8: (1, 2, 1, 2, 1),
}


@pytest.mark.parametrize("world", sorted(EXPECTED))
def test_the_share_is_the_same_everywhere(world):
    assert validate_probe_config(CONFIG, world) == []
    share = device_share(CONFIG, world)
    assert (share.prompts_per_step, share.responses_per_step, share.responses_per_minibatch,
            share.minibatches, share.val_prompts) == EXPECTED[world]
    assert estimate_memory(model_shape("tiny-qwen2.5"), CONFIG, num_gpus=world).share == share
    for adapter in ADAPTERS.values():
        assert adapter.share(CONFIG, Topology(1, world)) == {
            "responses_per_step": share.responses_per_step,
            "responses_per_minibatch": share.responses_per_minibatch}, adapter.name
        assert adapter.share(CONFIG, Topology(world, 1)) == adapter.share(
            CONFIG, Topology(1, world))  # nodes x GPUs: only the product counts


@pytest.mark.parametrize("world,emulated", [(1, False), (2, False), (8, True)])
def test_a_real_probe_runs_exactly_its_share(world, emulated):
    """Each rank runs its share (W = 2: two real gloo ranks; W = 8: one emulated rank); the
    rate is the whole run's, W shares per step."""
    request = ProbeRequest(model="tiny-qwen2.5", config=CONFIG, device=Device("cpu"),
                           cpu_threads=2,
                           warmup_steps=0, timed_steps=1, timeout_s=300.0,
                           nnodes=1, gpus_per_node=world, emulated=emulated)
    result = SubprocessRunner().run(request)
    assert result.status is ProbeStatus.OK, result.stderr_tail
    share = dict(result.share)  # the share as it ran, and its largest micro-batches
    rows = {phase: share.pop(f"{phase}_micro_batch_rows") for phase in ("update", "experience")}
    assert share == device_share(CONFIG, world).as_dict()
    assert rows == {"update": CONFIG.micro_batch_size_update,
                    "experience": CONFIG.micro_batch_size_experience}
    assert (result.world_size, result.emulated) == (world, emulated)
    assert result.samples_per_s * result.step_s == pytest.approx(EXPECTED[world][1] * world)


def test_a_batch_that_does_not_split_over_the_gpus_is_refused():
    problems = validate_probe_config(CONFIG, 16)  # 8 prompts cannot go to 16 GPUs
    assert any("not divisible by the 16 GPUs" in p for p in problems)
    wide = ProbeConfig(**{**CONFIG.as_dict(), "micro_batch_size_update": 8})
    assert validate_probe_config(wide, 1) == []
    assert validate_probe_config(wide, 2) == [  # 4 responses per GPU cannot fill 8
        "global_batch_size*rollout_n/2 GPUs=4 is not divisible by micro_batch_size_update=8"]
