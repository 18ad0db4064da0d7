"""Length headroom (issue 29): the longest response a config fits, everything else held."""

from __future__ import annotations

from dataclasses import replace

from autotune.config import ProbeConfig
from autotune.memory.length import (
    at_length,
    length_headroom,
    longest_fitting,
    longest_fitting_near,
)
from autotune.memory.model import allocator_reserve, estimate_memory
from autotune.memory.shape import model_shape
from autotune.memory.verdict import phase_totals

SHAPE = model_shape("qwen2.5-7b")
CONFIG = ProbeConfig(rollout_batch_size=64, rollout_n=8, global_batch_size=16,
                     micro_batch_size_update=4, micro_batch_size_experience=8,
                     gradient_checkpointing=True, max_prompt_length=512,
                     max_response_length=1024, rollout_engine="vllm-like",
                     gpu_memory_utilization=0.4, max_num_batched_tokens=32768)
# the allocator's reserve held at the config asked about, as the searches hold it
ARGS = {"num_gpus": 8, "state_shards": 8, "engine_capacity_bytes": 80 * 2**30}
ARGS["reserve_bytes"] = allocator_reserve(SHAPE, CONFIG, **ARGS)


def peaks(config: ProbeConfig) -> dict[str, int]:
    return phase_totals(estimate_memory(SHAPE, config, **ARGS), None)


def test_bisection_finds_the_last_length_that_fits():
    assert longest_fitting(lambda n: n <= 1184, 8192) == 1184
    assert longest_fitting(lambda n: False, 8192) == 0
    assert longest_fitting(lambda n: True, 100) == 100


def test_the_search_from_a_guess_gives_the_bisections_answer_in_fewer_calls():
    """From every guess to every answer on 0..64: the same answer as bisection from scratch;
    a guess one step off costs at most 3 calls, not bisection's 6 or 7."""
    for answer in range(65):
        for guess in range(65):
            calls: list[int] = []

            def fits(n: int, calls: list[int] = calls, answer: int = answer) -> bool:
                calls.append(n)
                assert 1 <= n <= 64, n  # never outside 1..high
                return n <= answer

            assert longest_fitting_near(fits, guess, 64) == answer, (guess, answer)
            assert len(set(calls)) == len(calls), calls  # nothing traced twice
            if abs(guess - answer) <= 1 and 0 < answer < 64:
                assert len(calls) <= 3, (guess, answer, calls)


def test_a_fixed_micro_batch_hits_its_wall_at_the_length_it_says():
    budget = int(0.9 * 80 * 2**30)
    reach = length_headroom(CONFIG, peaks, budget, SHAPE.context_tokens)
    assert reach.bounded_by_memory and reach.budget_growth == {}
    assert max(peaks(at_length(CONFIG, reach.fits_up_to)).values()) <= budget
    assert max(peaks(at_length(CONFIG, reach.fits_up_to + 1)).values()) > budget
    assert reach.describe().startswith(f"fits up to {reach.fits_up_to:,}-token responses")
    # the engine's prefill budget bounds where vLLM starts at all
    assert reach.searched_to == 32768 - 512


def test_a_token_budget_bounds_the_batched_phases_up_to_the_budget():
    budget_tokens = 16 * 1536
    dynamic = replace(CONFIG, dynamic_batching=True, max_token_len_update=budget_tokens,
                      max_token_len_experience=budget_tokens)
    reach = length_headroom(dynamic, peaks, 2**40, SHAPE.context_tokens)
    assert reach.searched_to == budget_tokens - 512 and not reach.bounded_by_memory
    assert "max_token_len_" in reach.limit and "=24,576" in reach.limit
    # 16 sequences of 1,536 tokens or one of 24,576: the same tokens, only the responses'
    # fp32 log-softmax grows; fixed micro-batches of the same 16 grow 16-fold in the update
    assert set(reach.budget_growth) == {"update", "experience"}
    assert 0 < max(reach.budget_growth.values()) < 0.35
    fixed = replace(CONFIG, micro_batch_size_update=16, micro_batch_size_experience=16)
    assert peaks(at_length(fixed, 24064))["update"] > 2 * peaks(fixed)["update"]
    assert "with token budgets the update and experience peaks grow at most" in \
        reach.describe()


def test_with_token_budgets_every_length_up_to_the_answer_fits():
    # n responses under a fixed budget: the rows fall as the length grows, so the peak is a
    # saw; the answer is where it first crosses the budget, not a bisection's guess
    dynamic = replace(CONFIG, dynamic_batching=True, max_token_len_update=8192,
                      max_token_len_experience=16384, max_num_batched_tokens=65536)
    budget = max(peaks(at_length(dynamic, 6990)).values())
    reach = length_headroom(dynamic, peaks, budget, SHAPE.context_tokens, world_size=8)
    assert 0 < reach.fits_up_to < reach.searched_to
    over = [n for n in range(1, reach.fits_up_to + 2)
            if max(peaks(at_length(dynamic, n)).values()) > budget]
    assert over == [] or over[0] > reach.fits_up_to
    assert max(peaks(at_length(dynamic, reach.fits_up_to + 1)).values()) > budget
    # a plain bisection lands past the saw's first tooth over the budget
    assert longest_fitting(lambda n: max(peaks(at_length(dynamic, n)).values()) <= budget,
                           reach.searched_to) > reach.fits_up_to
