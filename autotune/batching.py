"""How one GPU's responses are cut into micro-batches: a fixed count, or a token budget.

With dynamic batching off, the update's mini-batch and the log-prob forwards' share are cut
into micro-batches of `micro_batch_size_*` responses, each padded to the full sequence length.
With it on (verl's `use_dynamic_bsz`, EasyR1's `dynamic_batching`), each is cut as verl's
`seqlen_balancing.rearrange_micro_batches` cuts it: `ceil(total tokens / budget)`
micro-batches (never more than there are sequences), balanced by token count, padding removed.
The count is what bounds a micro-batch: a balanced one can hold more tokens than the budget
(three 100-token sequences under a 150-token budget make two micro-batches, one of 200
tokens), and the probe, the memory model and the trace all run the micro-batches cut here.

The budget is `max_token_len_update` / `max_token_len_experience` /
`critic_max_token_len_update` tokens when set (verl's `ppo_max_token_len_per_gpu`,
`log_prob_max_token_len_per_gpu` and the critic's `ppo_max_token_len_per_gpu`), else EasyR1's
rule: the micro-batch size times the padded sequence length. Memory verdicts take every response at
its full length (`worst_case_rows`): a token budget then bounds the peak whatever lengths the
run reaches. Pure arithmetic on plain mappings: imports no torch and nothing else of autotune.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import TypeAlias

# a knob's value (config.schema re-exports it: the schema's types, declared here because the
# schema's rules read this module)
KnobValue: TypeAlias = "bool | int | float | str | None"
KnobMapping: TypeAlias = "Mapping[str, KnobValue]"  # knobs by name, some or all

# the phases cut into micro-batches; PPO's critic cuts its value forwards and its update by
# one micro-batch (verl's critic.forward_micro_batch_size_per_gpu follows its update's)
BATCHED_PHASES = ("update", "experience", "critic_update")
MICRO_KNOB = {"update": "micro_batch_size_update",
               "experience": "micro_batch_size_experience",
               "critic_update": "critic_micro_batch_size_update"}
BUDGET_KNOB = {"update": "max_token_len_update", "experience": "max_token_len_experience",
               "critic_update": "critic_max_token_len_update"}
# how many responses there are to cut: with a token budget the largest micro-batch's rows
# are not monotone in them (3 under a budget of 3 sequences make one micro-batch of 3, 4 make
# two of 2), so memory reasoning must hold them equal
ROW_COUNT_KNOBS = ("rollout_batch_size", "rollout_n", "global_batch_size")
# the algorithm that trains a critic (config.ProbeConfig.has_critic asks the same of a config)
ALGORITHM_WITH_CRITIC = "ppo"


def as_count(value: KnobValue) -> int:
    """A count knob's value (a micro-batch, a budget, a length) as the int it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a count, got {value!r}")
    return int(value)


def batched_phases(knobs: KnobMapping) -> tuple[str, ...]:
    """The phases `knobs` cut into micro-batches: the critic's only where there is one."""
    return tuple(phase for phase in BATCHED_PHASES
                 if phase != "critic_update" or knobs.get("algorithm") == ALGORITHM_WITH_CRITIC)


def token_budget(knobs: KnobMapping, phase: str) -> int | None:
    """Tokens one GPU may put in a micro-batch of `phase` (None: dynamic batching off)."""
    if not knobs.get("dynamic_batching"):
        return None
    budget = knobs.get(BUDGET_KNOB[phase])
    if budget is not None:
        return as_count(budget)
    return as_count(knobs[MICRO_KNOB[phase]]) * sequence_tokens(knobs)


def sequence_tokens(knobs: KnobMapping) -> int:
    """Tokens of one whole sequence (a VL prompt's image tokens are inside the prompt)."""
    return as_count(knobs["max_prompt_length"]) + as_count(knobs["max_response_length"])


def micro_batches(lengths: Sequence[int], knobs: KnobMapping,
                  phase: str) -> list[list[int]]:
    """The indices of `lengths` (each sequence's tokens) in each micro-batch of `phase`."""
    budget = token_budget(knobs, phase)
    if budget is None:
        size = as_count(knobs[MICRO_KNOB[phase]])
        return [list(range(start, min(start + size, len(lengths))))
                for start in range(0, len(lengths), size)]
    count = min(len(lengths), -(-sum(lengths) // budget))
    return balanced_partitions(lengths, count)


def balanced_partitions(lengths: Sequence[int], count: int) -> list[list[int]]:
    """`count` groups of indices with token sums as even as largest-first assignment makes
    them (verl balances with Karmarkar-Karp: equal lengths give both the same group sizes,
    unequal ones the same count, each group within one sequence of the other's), each group
    in index order, the groups largest first."""
    if count <= 0:
        return []
    heap = [(0, group) for group in range(count)]
    groups: list[list[int]] = [[] for _ in range(count)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        tokens, group = heapq.heappop(heap)
        groups[group].append(index)
        heapq.heappush(heap, (tokens + lengths[index], group))
    return sorted((sorted(group) for group in groups),
                  key=lambda group: (-sum(lengths[i] for i in group), group))


def worst_case_rows(knobs: KnobMapping, sequences: int, phase: str) -> int:
    """Sequences in the largest micro-batch of `phase` when every one of `sequences` responses
    runs to the full length: what binds memory."""
    if sequences <= 0:
        return 0
    budget = token_budget(knobs, phase)
    if budget is None:  # not capped at `sequences`: the rules make it divide them
        return as_count(knobs[MICRO_KNOB[phase]])
    count = min(sequences, -(-sequences * sequence_tokens(knobs) // budget))
    return -(-sequences // count)  # equal lengths: balanced groups differ by one at most


def budget_problems(knobs: KnobMapping) -> list[str]:
    """A token budget must hold one whole sequence (verl asserts it in seqlen_balancing)."""
    problems = []
    for phase in batched_phases(knobs):
        budget = token_budget(knobs, phase)
        if budget is not None and budget < sequence_tokens(knobs):
            problems.append(f"{BUDGET_KNOB[phase]}={budget} is less than one sequence "
                            f"(max_prompt_length+max_response_length={sequence_tokens(knobs)});"
                            " a micro-batch must hold at least one whole sequence")
        elif budget is None and knobs.get(BUDGET_KNOB[phase]) is not None:
            problems.append(f"{BUDGET_KNOB[phase]}={knobs[BUDGET_KNOB[phase]]} is a token "
                            "budget, read only with dynamic_batching=true; set that too, or "
                            "remove the budget")
    return problems


def with_token_budgets(knobs: KnobMapping) -> dict[str, KnobValue]:
    """`knobs` with each token budget written out as the probe ran it (dynamic batching on:
    the budget given, or micro-batch x sequence length), for an export to set."""
    out = dict(knobs)
    for phase in batched_phases(knobs):
        budget = token_budget(knobs, phase) if "max_prompt_length" in knobs else None
        if budget is not None:
            out[BUDGET_KNOB[phase]] = budget
    return out
