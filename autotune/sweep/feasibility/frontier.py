"""What is left to try: the valid configs nobody holds yet, and whether any of them could fit.

The sampler proposes; most proposals late in a sweep are configs already tried (reused) or
proven to run out of memory (predicted). Neither runs a probe, so neither counts against
--trials, and a sweep whose space has nothing left that could fit would ask forever. The
frontier stops that: after every new measured OOM, and whenever the sampler keeps proposing
known configs, it looks for an untried config the feasibility rules do not rule out. The check
after a probe starts no trace (a trace only adds OOMs, so an untraced config the other rules
leave open may fit); the configs it queues to be probed are traced first, as any candidate
is. It also lists the neighbours of a config (one knob one step away), which the sweep
probes between the sampler's proposals: the best configs of these spaces sit in smooth
basins. None left
means the sweep is over, said in one line; if the safe config itself (every saver on,
smallest micro-batches) ran out of device memory, nothing in the space can fit, and the line
says what to change instead: first the fixed knob (--set lora_rank=4096) whose default alone
would bring the safe config under the memory model's wall, where one does.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING

from autotune.config import Knobs
from autotune.config.schema import ProbeConfig
from autotune.probe.measure.result import ProbeStatus
from autotune.sweep.feasibility.screen import Feasibility
from autotune.sweep.space.params import params_key
from autotune.sweep.space.search_space import SearchSpace

if TYPE_CHECKING:
    from optuna.trial import FrozenTrial

WHAT_TO_CHANGE = ("use a larger device (or a higher --gpu-memory-limit), more GPUs, shorter "
                  "lengths (--set max_response_length=...), or a smaller model")


class Frontier:
    """The untried valid configs of an enumerable space, and the stop when none could fit."""

    def __init__(self, space: SearchSpace, feasibility: Feasibility, seed: int) -> None:
        self.space, self.feasibility = space, feasibility
        self.rng = random.Random(seed)
        grid = space.valid_grid()
        self.valid_keys = {params_key(p) for p in grid} if grid is not None else None
        self.checked_at: tuple[int, int] = (0, 0)  # (known OOMs, calibration samples) seen

    def untried(self, seen: Iterable[str]) -> list[str]:
        if self.valid_keys is None:
            return []
        return sorted(self.valid_keys - set(seen))

    def params_of(self, key: str) -> Knobs:
        """A params_key's config in the space's order (the key sorts the names)."""
        stored = json.loads(key)
        return {name: stored[name] for name in self.space.params if name in stored}

    def pick_untried(self, seen: Iterable[str], trace: bool = True) -> Knobs | None:
        """An untried config the feasibility rules leave open (at random), or None.
        `trace=False`: no new trace (Feasibility.predict), for a question no probe follows."""
        left = self.untried(seen)
        self.rng.shuffle(left)
        for key in left:
            params = self.params_of(key)
            if self.feasibility.predict(self.space.candidate(params), trace=trace) is None:
                return params
        return None

    def neighbours(self, params: Knobs) -> list[Knobs]:
        """Configs one step from `params`: one knob moved to the next value on its axis
        (an int's or a numeric choice's neighbour in order; any other choice, flipped)."""
        found = []
        for name, spec in self.space.params.items():
            values = list(spec.values())
            if name not in params or params[name] not in values:
                continue
            at = values.index(params[name])
            ordered = all(isinstance(v, int | float) and not isinstance(v, bool)
                          for v in values)
            steps = [values[i] for i in (at - 1, at + 1) if 0 <= i < len(values)] \
                if ordered else [v for v in values if v != params[name]]
            found += [{**params, name: value} for value in steps]
        return found

    def neighbour(self, params: Knobs, seen: Iterable[str],
                  moving: frozenset[str] | None = None) -> Knobs | None:
        """An untried valid neighbour of `params` the feasibility rules leave open (at
        random; one that moves a knob of `moving` first, where given), or None."""
        seen = set(seen)
        near = self.neighbours(params)
        self.rng.shuffle(near)
        if moving is not None:  # a stable sort: the shuffled order within each group
            near.sort(key=lambda other: not any(other[name] != params[name]
                                                for name in moving if name in params))
        for other in near:
            key = params_key(other)
            if key in seen or (self.valid_keys is not None and key not in self.valid_keys):
                continue
            candidate = self.space.candidate(other)
            if not candidate.problems and self.feasibility.predict(candidate) is None:
                return other
        return None

    def learned_something(self) -> bool:
        """Whether a new OOM or calibration sample arrived since the last call."""
        now = self.feasibility.evidence()
        changed, self.checked_at = now != self.checked_at, now
        return changed

    def nothing_fits(self, seen: Iterable[str], trials: Iterable[FrozenTrial]) -> str | None:
        """Why the sweep must stop because nothing left could fit, or None. In a space too
        large to list, the safe config is the lightest value of every axis, so its OOM among
        the study's `trials` alone settles it."""
        seen, safe_oom = set(seen), _safe_oom(trials)
        if self.valid_keys is not None:
            left = self.untried(seen)
            if not left or self.pick_untried(seen, trace=False) is not None:
                return None  # exhausted (its own stop rule), or something may still fit
        elif safe_oom is None:
            return None
        blamed = self.blame()
        advice = f"{blamed}: lower it, or {WHAT_TO_CHANGE}" if blamed else WHAT_TO_CHANGE
        if safe_oom is not None:
            result = safe_oom.user_attrs.get("result") or {}
            where = f" in {result['failed_phase']}" if result.get("failed_phase") else ""
            return (f"nothing in the space can fit: its safe config (trial {safe_oom.number}: "
                    f"every memory saver on, smallest micro-batches) ran out of device memory"
                    f"{where}; {advice}")
        what = f"the {len(left)} configs not yet tried are all" if len(left) > 1 else \
            "the one config not yet tried is"
        return f"nothing left that could fit: {what} predicted to run out of memory; {advice}"

    def blame(self) -> str | None:
        """The fixed knobs (--set, or the space's) that alone put the safe config past the
        memory model's wall: each one's default would bring it under. None when none does
        (or the model does not put the safe config past it)."""
        safe = self.space.candidate(self.space.safe_params()).config
        if self.feasibility.model_past(safe) is None:
            return None
        named, defaults = [], []
        for name, value in self.space.fixed.items():
            field = ProbeConfig.__dataclass_fields__.get(name)
            if field is None or field.default is dataclasses.MISSING or field.default == value:
                continue
            try:
                lighter = dataclasses.replace(safe, **{name: field.default})
            except (TypeError, ValueError):  # the default breaks a rule of this config
                continue
            if self.feasibility.model_past(lighter) is None:
                named.append(f"{name}={value}")
                defaults.append(f"{name}={field.default}")
        if not named:
            return None
        return (f"{' or '.join(named)} makes it so (at its default, {' or '.join(defaults)}, "
                "the safe config is not predicted to run out)")


def _safe_oom(trials: Iterable[FrozenTrial]) -> FrozenTrial | None:
    """The safe config's trial, if it was probed and ran out of device memory."""
    for frozen in trials:
        attrs = frozen.user_attrs
        status = ProbeStatus.of(attrs.get("status"))
        if attrs.get("origin") == "safe" and attrs.get("probed") and status is not None \
                and status.is_device_oom:
            return frozen
    return None
