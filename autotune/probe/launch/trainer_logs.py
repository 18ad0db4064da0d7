"""The trainers' own step lines: what a command probe reads its throughput from.

Each trainer prints a record per step on the console (the formats, with the code that prints
them, are in tests/data/captured_trainer_logs.yaml beside real lines users posted):

- verl (and its forks), console logger (verl/utils/logger/aggregate_logger.py): `step:3 -
  actor/pg_loss:0.010 - ... - timing_s/step:41.2 - perf/total_num_tokens:123456.000 -
  perf/throughput:1234.5`, one line behind Ray's coloured `(TaskRunner pid=1)` prefix; newer
  verl prints numpy scalars as `np.float64(0.31)`; `step:0` is validation before training;
- EasyR1, console logger (verl/utils/logger/logger.py): `Step 3`, then the metrics unflattened
  and `yaml.dump`ed with indent 2 (numpy scalars become `!!python/object/apply` blocks; the
  keys read here, timing_s/ and perf/ tokens and throughput, are plain numbers), every line
  behind Ray's `(Runner pid=1)` prefix;
- TRL (transformers' Trainer with disable_tqdm): one Python dict per logged step, values
  printed as strings, `{'loss': '2.98e-08', 'num_tokens': '96', ..., 'step_time': '0.1417'}`,
  where num_tokens counts all tokens so far and step_time is the step's seconds.

Throughput comes from the steps after the first (the first one pays compilation, caches and
engine start): tokens over seconds, from the trainer's own per-step tokens and times when it
logs them (verl, EasyR1), else from num_tokens and TRL's step_time (or, without it, the times
the lines were printed). The phases' seconds come from the trainer's own per-phase timers
(`timing_s/gen`, `timing_s/update_actor`, ...) where it logs them.
Torch-free.
"""

from __future__ import annotations

import ast
import json
import math
import re
import statistics
from dataclasses import dataclass, field

# the trainer's own keys for: tokens in the step, its seconds, throughput (tokens/s per GPU)
STEP_TOKENS_KEYS = ("perf/total_num_tokens",)
STEP_TIME_KEYS = ("timing_s/step", "perf/time_per_step")
MEMORY_KEYS = ("perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb",
               "perf/cpu_memory_used_gb", "perf/throughput")
# the trainer's own per-phase seconds (verl: timing_s/gen, old_log_prob, ...; EasyR1: old for
# the old log-probs; ../shared/reference/trainers.md), summed into the probe's phases
PHASE_TIME_KEYS = {
    "rollout": ("timing_s/gen", "timing_s/update_weights"),
    "experience": ("timing_s/reward", "timing_s/old_log_prob", "timing_s/old", "timing_s/ref",
                   "timing_s/values", "timing_s/adv"),
    "critic_update": ("timing_s/update_critic",),
    "update": ("timing_s/update_actor",),
    "validation": ("timing_s/validation", "timing_s/testing"),
}
CUMULATIVE_TOKENS_KEY = "num_tokens"  # TRL: tokens seen so far, all processes
TRL_STEP_TIME_KEY = "step_time"  # TRL: seconds of the optimizer step just logged
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_PREFIX = re.compile(r"^\s*\([\w\-.:]+ pid=\d+(?:, ip=[\d.]+)?\)\s?")
VERL_STEP = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")
EASYR1_STEP = re.compile(r"^\s*Step (\d+)\s*$")
YAML_KEY = re.compile(r"^( *)([^\s:#][^:]*):(?: (.*))?$")  # `  throughput: 12.5`, `perf:`
NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")  # np.float64(0.31) -> 0.31
NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^[-+]?(nan|inf)$")


def clean(line: str) -> str:
    """A line without colour codes and without Ray's `(Actor pid=N)` prefix."""
    return RAY_PREFIX.sub("", ANSI.sub("", line.rstrip("\r\n")))


def number(text: str) -> float | None:
    text = text.strip()
    unwrapped = NUMPY_SCALAR.match(text)
    if unwrapped:
        text = unwrapped.group(1).strip()
    return float(text) if NUMBER.match(text) else None


@dataclass(frozen=True)
class StepRecord:
    step: int
    at_s: float  # when the line was read (the probe's monotonic clock)
    values: dict[str, float]


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    step_s: float | None
    step_times_s: tuple[float, ...] = ()  # each timed step's seconds, where the log says

    @property
    def step_se_s(self) -> float | None:
        """The standard error of step_s from the logged step times (two at least)."""
        if len(self.step_times_s) < 2:
            return None
        return statistics.stdev(self.step_times_s) / math.sqrt(len(self.step_times_s))


def flatten(tree: dict, prefix: str = "") -> dict[str, float]:
    """{'perf': {'throughput': 1.0}} -> {'perf/throughput': 1.0}; numbers only (also numbers
    printed as strings, as transformers' Trainer logs them)."""
    out: dict[str, float] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, str) and NUMBER.match(value.strip()):
            out[name] = float(value)
    return out


def parse_verl_line(line: str) -> tuple[int, dict[str, float]] | None:
    """verl's console line: `step:N - key:value - key:value ...`."""
    match = VERL_STEP.search(clean(line))
    if match is None:
        return None
    values: dict[str, float] = {}
    for item in match.group(2).split(" - "):
        key, sep, raw = item.partition(":")
        value = number(raw) if sep else None
        if value is not None:
            values[key.strip()] = value
    return int(match.group(1)), values


def parse_yaml_block(lines: list[str]) -> dict[str, float]:
    """EasyR1's `yaml.dump` of nested metrics, read by indentation: every `key: number` with
    its parents' keys as a path (`perf/throughput`); other values (numpy objects) skipped."""
    values: dict[str, float] = {}
    path: list[tuple[int, str]] = []  # (indent, key) of the open parents
    for line in lines:
        match = YAML_KEY.match(line)
        if match is None:
            continue
        indent, key, raw = len(match.group(1)), match.group(2).strip(), match.group(3)
        while path and path[-1][0] >= indent:
            path.pop()
        if raw is None or not raw.strip():
            path.append((indent, key))
            continue
        value = number(raw)
        if value is not None:
            values["/".join([*(k for _, k in path), key])] = value
    return values


def parse_dict_line(line: str) -> dict[str, float] | None:
    """A Python or JSON dict printed on one line (TRL's per-step record)."""
    text = RAY_PREFIX.sub("", line.strip())
    if not (text.startswith("{") and text.endswith("}")):
        return None
    for parse in (ast.literal_eval, json.loads):
        try:
            data = parse(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        return flatten(data) if isinstance(data, dict) else None
    return None


@dataclass
class StepLog:
    """Feed it the trainer's output line by line; it keeps the step records it recognises."""

    trainer: str
    records: list[StepRecord] = field(default_factory=list)
    steps_per_cycle: int = 1  # TRL: logged (optimizer) steps per generation
    pending: tuple[int, float, list[str]] | None = None  # EasyR1: a `Step N` block being read

    @property
    def steps_seen(self) -> int:
        return len(self.records)

    @property
    def first_step_at(self) -> float | None:
        return self.records[0].at_s if self.records else None

    def feed(self, line: str, at_s: float) -> None:
        if self.trainer == "trl":
            values = parse_dict_line(clean(line))
            if values is not None and "train_runtime" not in values and \
                    (CUMULATIVE_TOKENS_KEY in values or "loss" in values):
                self.records.append(StepRecord(len(self.records) + 1, at_s, values))
        elif self.trainer == "easyr1":
            self.feed_easyr1(line, at_s)
        else:
            self.add(parse_verl_line(line), at_s)

    def add(self, parsed: tuple[int, dict[str, float]] | None, at_s: float) -> None:
        """A verl or EasyR1 record; step 0 is validation before training, not a step."""
        if parsed is not None and parsed[0] >= 1:
            self.records.append(StepRecord(parsed[0], at_s, parsed[1]))

    def feed_easyr1(self, line: str, at_s: float) -> None:
        text = clean(line)
        start = EASYR1_STEP.match(text)
        if start is not None:
            self.finish()
            self.pending = (int(start.group(1)), at_s, [])
            return
        if self.pending is None:
            self.add(parse_verl_line(text), at_s)  # releases that printed verl's line format
            return
        step, began_s, lines = self.pending
        if text and not text.startswith((" ", "-")) and YAML_KEY.match(text) is None:
            self.finish()  # the YAML block ended: another log line
            self.feed_easyr1(line, at_s)
            return
        lines.append(text)
        self.pending = (step, began_s, lines)

    def finish(self) -> None:
        """End of output (or of a block): keep the `Step N` block being read."""
        if self.pending is None:
            return
        step, at_s, lines = self.pending
        self.pending = None
        self.add((step, parse_yaml_block(lines)), at_s)

    def throughput(self) -> Throughput | None:
        """Tokens/s over the steps after the first, or None when it cannot be told."""
        later = self.records[1:]
        if later and all(_first(r.values, STEP_TOKENS_KEYS) is not None and
                         _first(r.values, STEP_TIME_KEYS) for r in later):
            tokens = sum(_first(r.values, STEP_TOKENS_KEYS) or 0.0 for r in later)
            times = tuple(_first(r.values, STEP_TIME_KEYS) or 0.0 for r in later)
            return Throughput(tokens / sum(times), sum(times) / len(later), times)
        return self.cumulative_throughput()

    def cumulative_throughput(self) -> Throughput | None:
        """From a running token count (which grows when a rollout is generated): from the end
        of the first rollout cycle (steps_per_cycle logged steps) to the end of the last one,
        over the trainer's own step times when it logs them, else the times the lines came."""
        cycle = max(1, self.steps_per_cycle)
        counted = [r for r in self.records if CUMULATIVE_TOKENS_KEY in r.values]
        ends = counted[cycle - 1::cycle]
        if len(ends) < 2:
            return None
        first, last = ends[0], ends[-1]
        after = counted[counted.index(first) + 1:counted.index(last) + 1]
        if all(TRL_STEP_TIME_KEY in r.values for r in after):
            seconds = sum(r.values[TRL_STEP_TIME_KEY] for r in after)
        else:
            seconds = last.at_s - first.at_s
        tokens = last.values[CUMULATIVE_TOKENS_KEY] - first.values[CUMULATIVE_TOKENS_KEY]
        if seconds <= 0 or tokens <= 0:
            return None
        return Throughput(tokens / seconds, seconds / (len(ends) - 1))

    def phase_times(self) -> dict[str, float]:
        """Seconds per probe phase (PHASE_TIME_KEYS) as the trainer timed them: each phase's
        keys summed per step, the mean over the steps after the first; only phases every
        such step logged (none for TRL, which times only its whole step)."""
        later = self.records[1:]
        out: dict[str, float] = {}
        for phase, keys in PHASE_TIME_KEYS.items():
            per_step = [sum(r.values[k] for k in keys if k in r.values) for r in later
                        if any(k in r.values for k in keys)]
            if later and len(per_step) == len(later):
                out[phase] = sum(per_step) / len(per_step)
        return out

    def trainer_metrics(self) -> dict[str, float]:
        """The trainer's own step time, throughput and memory figures: means over the steps
        after the first (the only step, when there is one), as it logged them."""
        later = self.records[1:] or self.records
        out: dict[str, float] = {}
        for key in (*STEP_TIME_KEYS, TRL_STEP_TIME_KEY, *MEMORY_KEYS, *STEP_TOKENS_KEYS):
            values = [r.values[key] for r in later if key in r.values]
            if values:
                out[key] = sum(values) / len(values)
        return out


def _first(values: dict[str, float], keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if key in values:
            return values[key]
    return None
