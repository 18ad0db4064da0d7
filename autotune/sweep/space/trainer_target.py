"""`run --trainer T`: the trainer a sweep writes its best config for, and what it starts from.

The trainer's rules (for the run's topology) join the space's, so a config the trainer would
reject is recorded invalid and never run; the sweep starts from the user's trainer YAML (its
knobs, snapped to the values the space searches) or the trainer's own defaults; and
best.<trainer>.yaml is written from the study as it goes (export.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import Knobs, ProbeConfig, Topology
from autotune.errors import ConfigError
from autotune.sweep.space.search_space import SearchSpace
from autotune.trainers import get_adapter
from autotune.trainers.adapter import Adapter
from autotune.trainers.export_plan import dotted_get, refused_settings
from autotune.trainers.render import TrainerYaml, trainer_start


@dataclass(frozen=True)
class TrainerTarget:
    """The trainer of `run --trainer`: its adapter, the user's trainer YAML (None: the
    trainer's defaults) and the topology of the run, from the flags or that YAML."""

    adapter: Adapter
    base: TrainerYaml | None
    topology: Topology


def trainer_target(trainer: str, base_config: str | None, space: SearchSpace,
                   nnodes: int | None, gpus_per_node: int | None, launched: bool = False,
                   on_cpu: bool = False) -> tuple[TrainerTarget, Knobs, SearchSpace, list[str]]:
    """The target, the knobs the sweep starts from, the space with the trainer's rules, and
    the lines to say (starting values moved onto the space's). `launched`: the probes are the
    user's trainer on its config (--launch), which runs the base's compared settings itself;
    `on_cpu`: the probes run on a CPU (fp32 compute)."""
    adapter = get_adapter(trainer)
    base, topology, start = trainer_start(adapter, base_config, nnodes, gpus_per_node)
    refused = refused_settings(adapter, base[0], compared=not launched, on_cpu=on_cpu) \
        if base else []
    if refused:
        raise ConfigError([f"--base-config {base_config}: {line}" for line in refused])
    if base is None:  # the trainer's defaults seed the searched knobs, how it batches and
        # whether (and where) it holds a reference model
        start = {k: v for k, v in start.items()
                 if k in space.params or k in ("dynamic_batching", "use_kl", "offload_ref_params")}
    notes = []
    if start.get("dynamic_batching") and "max_token_len_update" in adapter.keys:
        # the run batches by tokens: search the budgets the trainer takes (verl), in whole
        # sequences of the run's length; EasyR1's budget is its micro-batch x that length
        tokens = ProbeConfig.from_knobs(start).sequence_length
        space = space.with_token_budgets(tokens)
        notes.append(f"{trainer} batches by tokens (dynamic batching on): searching "
                     f"token budgets in whole {tokens}-token sequences")
    start, moved = space.snapped(start)
    tree = base[0] if base else {}
    ruled = space.with_rules(lambda config: adapter.check(
        config, topology, lambda key, default: dotted_get(tree, key, default))
    ).with_ties(adapter.ties)
    notes += [f"{trainer} starting config: {line}" for line in moved]
    return TrainerTarget(adapter, base, topology), start, ruled, notes
