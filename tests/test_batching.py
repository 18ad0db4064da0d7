"""Token budgets (issue 29): micro-batches cut as verl's dynamic batching cuts them, the same
worst case for the probe, the memory model and dominance, and prompts free of special ids."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from autotune.batching import micro_batches, token_budget, worst_case_rows
from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.memory.model import estimate_memory
from autotune.memory.shape import model_shape
from autotune.probe.measure.result import ProbeRequest
from autotune.probe.modeling.models import (
    load_model_config,
    special_token_ids,
    synthetic_prompt_ids,
)
from autotune.probe.step.training import TrainingProbe
from autotune.registry import REGISTRY
from autotune.sweep.feasibility.dominance import at_least_as_demanding

DYNAMIC = {"dynamic_batching": True, "max_prompt_length": 64, "max_response_length": 64,
           "micro_batch_size_update": 2, "micro_batch_size_experience": 4,
           "max_token_len_update": None, "max_token_len_experience": None}


def test_a_token_budget_cuts_as_verl_does():
    # verl: ceil(total / budget) micro-batches, balanced; a balanced one may pass the budget
    knobs = {**DYNAMIC, "max_token_len_update": 150}
    groups = micro_batches([100, 100, 100], knobs, "update")
    assert sorted(len(g) for g in groups) == [1, 2]
    rng = random.Random(3)
    for _ in range(300):
        lengths = [rng.randint(10, 128) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(128, 1024)
        groups = micro_batches(lengths, {**DYNAMIC, "max_token_len_update": budget}, "update")
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert len(groups) == min(len(lengths), -(-sum(lengths) // budget))
        sums = [sum(lengths[i] for i in g) for g in groups]
        assert max(sums) - min(sums) <= max(lengths)  # balanced within one sequence
        # every response at full length: the worst case the memory model reads
        full = micro_batches([128] * len(lengths), {**DYNAMIC, "max_token_len_update": budget},
                             "update")
        assert max(len(g) for g in full) == worst_case_rows(
            {**DYNAMIC, "max_token_len_update": budget}, len(lengths), "update")
    # no budget given: EasyR1's, micro-batch x padded length; off: fixed micro-batches
    assert token_budget(DYNAMIC, "update") == 2 * 128
    assert token_budget({**DYNAMIC, "dynamic_batching": False}, "update") is None
    assert micro_batches([5] * 5, {**DYNAMIC, "dynamic_batching": False}, "experience") == [
        [0, 1, 2, 3], [4]]


def test_the_memory_model_reads_the_worst_case_rows():
    shape = model_shape("tiny-qwen2.5")
    fixed = ProbeConfig(rollout_batch_size=4, rollout_n=4, global_batch_size=4,
                        micro_batch_size_update=4, micro_batch_size_experience=4)
    same = replace(fixed, dynamic_batching=True)  # budget = 4 whole sequences: same peak
    wider = replace(same, max_token_len_update=8 * fixed.sequence_length)
    peaks = [estimate_memory(shape, c, on_gpu=False).phases["update"].total_bytes
             for c in (fixed, same, wider)]
    assert peaks[0] == peaks[1] < peaks[2]


def test_with_token_budgets_responses_counted_must_be_equal_to_prove_an_oom():
    known = {"rollout_n": 3, "max_token_len_update": 384}  # 3 x 128 tokens: one of 3
    candidate = {"rollout_n": 4, "max_token_len_update": 384}  # 4: two of 2, less memory
    assert at_least_as_demanding(candidate, known, phase="update")  # fixed micro-batches
    assert not at_least_as_demanding(candidate, known, phase="update", token_batched=True)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_synthetic_prompts_never_hold_a_special_token(name):
    config = load_model_config(name)
    specials = special_token_ids(config)
    assert specials  # every registry model names its BOS/EOS (and image tokens)
    ids = synthetic_prompt_ids(config, 64, 1024, torch.Generator().manual_seed(0))
    assert not torch.isin(ids, torch.tensor(sorted(specials))).any()


class SampledLengths(TrainingProbe):
    """Responses that end at drawn lengths, as a benchmark's landscape has them."""

    def _response_lengths(self, responses: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        return torch.randint(1, self.config.max_response_length + 1, (responses,),
                             generator=generator)


def test_a_probe_with_token_budgets_packs_short_responses():
    config = ProbeConfig(rollout_batch_size=4, rollout_n=4, global_batch_size=4,
                         micro_batch_size_update=2, micro_batch_size_experience=2,
                         max_prompt_length=16, max_response_length=32, dynamic_batching=True,
                         use_kl=False)
    request = ProbeRequest(model="tiny-qwen2.5", config=config, device=Device("cpu"),
                           cpu_threads=2, warmup_steps=0, timed_steps=1, timeout_s=300.0)
    probe = SampledLengths(request)
    probe.build()
    probe.step()
    lengths = (probe.response_lengths + 16).tolist()
    budget = 2 * 48
    groups = micro_batches(lengths, config.as_dict(), "update")
    assert len(groups) == -(-sum(lengths) // budget) < 8  # fewer than fixed micro-batches
    assert probe.ran["update_micro_batch_rows"] == max(len(g) for g in groups) > 2
    assert probe.old_log_probs.shape == (16, 32)
    # positions past a response's end are padding removed: zero
    short = int(probe.response_lengths.argmin())
    assert probe.old_log_probs[short, int(probe.response_lengths[short]):].abs().sum() == 0


def test_a_verl_base_that_batches_by_tokens_is_swept_by_budgets(tmp_path):
    from pathlib import Path

    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.space.trainer_target import trainer_target

    fixture = Path(__file__).parent / "fixtures" / "verl-ppo-trainer.yaml"
    base = tmp_path / "ppo.yaml"
    base.write_text(fixture.read_text().replace("    use_dynamic_bsz: false",
                                                "    use_dynamic_bsz: true")
                    .replace("adv_estimator: gae", "adv_estimator: grpo"))
    target, start, space, notes = trainer_target("verl", str(base), load_search_space("verl"),
                                                 None, None)
    assert start["dynamic_batching"] is True
    # the log-prob budgets follow the actor's 16384 through ${oc.select:...}; each moves to
    # the nearest whole number of 1024-token sequences the space searches
    assert "micro_batch_size_update" not in space.params
    choices = space.params["max_token_len_update"].values()
    assert choices == tuple(1024 * m for m in (1, 2, 4, 8, 16))
    assert start["max_token_len_update"] == start["max_token_len_experience"] == 16384
    assert notes[0].startswith("verl batches by tokens (dynamic batching on)")
    assert space.with_user_values({}, start)[0].batches_by_tokens  # dominance is told
