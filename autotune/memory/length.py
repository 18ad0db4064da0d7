"""Length headroom: the longest response a config still fits, everything else held.

Response lengths grow as RL trains (Search-R1 and VLM-R1 runs ran out of memory after 40 and 4
steps, when the lengths reached the wall, not at step 1), so a verdict at one length is not
the whole answer. Peak memory grows with `max_response_length` (config.MEMORY_DIRECTION), so
a bisection over it finds the longest length that fits a budget. The peaks come from the
caller: the (calibrated) memory model here, a trace bisection in `estimate --trace`. With a
token budget the update's and log-prob's micro-batches hold the budget's tokens whatever the
length (fewer, longer sequences), so those phases grow only as responses take a larger share of
the tokens (their fp32 log-softmax), up to the longest sequence the budget holds, where the
search stops. Pure arithmetic: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from autotune.batching import BUDGET_KNOB
from autotune.config import ProbeConfig
from autotune.files import JsonObject

PhasePeaks = Callable[[ProbeConfig], dict[str, int]]  # a config's peak bytes per phase


@dataclass(frozen=True)
class LengthHeadroom:
    """The longest response length a config fits, and what bounded the search."""

    fits_up_to: int  # tokens (0: not even the shortest response fits)
    searched_to: int  # the longest length the config is valid at
    limit: str  # what sets searched_to: the model's context, a token budget, vLLM's prefill
    # with token budgets: how much each batched phase's peak grows from the probed length to
    # searched_to (a micro-batch holds the budget's tokens at any length)
    budget_growth: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def bounded_by_memory(self) -> bool:
        return self.fits_up_to < self.searched_to

    def describe(self, where: str = "on this card") -> str:
        """`fits up to 1,184-token responses on this card`, or why there is no wall."""
        if self.fits_up_to == 0:
            return f"does not fit {where} even with 1-token responses"
        if self.bounded_by_memory:
            text = f"fits up to {self.fits_up_to:,}-token responses {where}"
        else:
            text = (f"fits {where} at every response length up to {self.searched_to:,} "
                    f"tokens ({self.limit})")
        if self.budget_growth:
            growth = max(self.budget_growth.values())
            text += (f"; with token budgets the {' and '.join(self.budget_growth)} peaks grow "
                     f"at most {growth:.0%} up to {self.searched_to:,} tokens (a micro-batch "
                     "holds the budget's tokens at any length)")
        return text

    def as_dict(self) -> JsonObject:
        return {"fits_up_to_response_tokens": self.fits_up_to,
                "searched_to_response_tokens": self.searched_to, "limit": self.limit,
                "budget_growth": dict(self.budget_growth)}


def response_length_limit(config: ProbeConfig, context_tokens: int) -> tuple[int, str]:
    """The longest response `config` is valid at, and which rule sets it: the model's
    context, a token budget given in tokens (a micro-batch holds one whole sequence), or the
    vllm-like engine's prefill budget (vLLM's max_model_len)."""
    prompt = config.max_prompt_length
    limits = [(context_tokens - prompt, f"the model's context of {context_tokens:,} tokens")]
    if config.dynamic_batching:
        for phase in config.batched_phases:
            budget = getattr(config, BUDGET_KNOB[phase])
            if budget is not None:
                limits.append((budget - prompt, f"{BUDGET_KNOB[phase]}={budget:,}"))
    if config.engine_reserves:
        limits.append((config.max_num_batched_tokens - prompt,
                       f"max_num_batched_tokens={config.max_num_batched_tokens:,}"))
    return min(limits)


def longest_fitting(fits: Callable[[int], bool], high: int) -> int:
    """The largest length in 1..high that `fits` (memory grows with it: bisect), else 0."""
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def longest_fitting_near(fits: Callable[[int], bool], guess: int, high: int) -> int:
    """`longest_fitting` started from a close guess (the memory model's answer when the trace
    checks it): steps of 1, 1, 2, 4, ... away from the guess until the answer is bracketed,
    then bisection inside the bracket; two calls when the guess is right, three when it is one
    off, about 2 log2 of the miss otherwise, against log2(high) from scratch."""
    guess = min(max(guess, 1), high)

    def fits_in(low: int, top: int) -> int:  # low fits, top + 1 does not: bisect between
        return low + longest_fitting(lambda n: fits(low + n), top - low)

    if fits(guess):
        low, stride = guess, 1
        while low < high:
            probe = min(low + stride, high)
            if not fits(probe):
                return fits_in(low, probe - 1)
            low, stride = probe, stride * 2 if probe - guess > 1 else 1
        return low
    top, stride = guess - 1, 1
    while top > 0:
        probe = max(top - stride + 1, 1)
        if fits(probe):
            return fits_in(probe, top)
        top, stride = probe - 1, stride * 2 if guess - probe > 1 else 1
    return 0


def at_length(config: ProbeConfig, tokens: int) -> ProbeConfig:
    return config.replace(max_response_length=tokens)


def row_breaks(config: ProbeConfig, world_size: int, high: int) -> list[int]:
    """The response lengths (below `high`) after which a token-budgeted micro-batch of
    full-length responses holds fewer sequences: n responses under a budget of B tokens make
    ceil(n x (prompt + L) / B) micro-batches, one more past L = k x B / n - prompt. Between
    two breaks the rows stay and the peak grows with L; at a break it falls back. None with
    fixed micro-batches, or EasyR1's budget (micro-batch x length: the same rows at any L)."""
    if not config.dynamic_batching:
        return []
    share, knobs = config.trained_share(world_size), config.batching_knobs()
    breaks: set[int] = set()
    counts = {"update": share.responses_per_minibatch, "experience": share.responses_per_step,
              "critic_update": share.responses_per_step}  # the critic's value forwards
    for phase in config.batched_phases:
        count = counts[phase]
        budget = knobs[BUDGET_KNOB[phase]]  # a sequence-parallel group's
        if not isinstance(budget, int):
            continue
        for k in range(1, count + 1):
            length = k * budget // count - config.max_prompt_length
            if 0 < length < high:
                breaks.add(length)
    return sorted(breaks)


def length_headroom(config: ProbeConfig, peaks: PhasePeaks, budget_bytes: int,
                    context_tokens: int, world_size: int = 1) -> LengthHeadroom:
    """The longest response length up to which `config` fits in `budget_bytes` at every
    length (the run's responses grow through each), by `peaks` (memory model): bisected
    between the lengths where a token budget's rows change (row_breaks), in order."""
    high, limit = response_length_limit(config, context_tokens)
    high = max(0, high)

    def fits(tokens: int) -> bool:
        return max(peaks(at_length(config, tokens)).values()) <= budget_bytes

    fits_up_to = 0
    for end in [*row_breaks(config, world_size, high), high]:
        if fits(end):
            fits_up_to = end
            continue
        start = fits_up_to  # the peak grows from here to `end`: the wall is between

        def fits_past(extra: int, start: int = start) -> bool:
            return fits(start + extra)

        fits_up_to = start + longest_fitting(fits_past, end - start)
        break
    growth: dict[str, float] = {}
    if config.dynamic_batching and high > config.max_response_length:
        here, there = peaks(config), peaks(at_length(config, high))
        growth = {phase: round(there[phase] / here[phase] - 1, 4)
                  for phase in config.batched_phases if here.get(phase)}
    return LengthHeadroom(fits_up_to, high, limit, growth)
