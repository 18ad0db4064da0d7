"""What an export writes into the user's trainer config, and what it must not do silently.

The plan of one export: every key written with its value, the trainer's rules the config
breaks, the conflicts with the user's base config, and the lines that say what changed (the
file's header) and what was flipped (the terminal). A knob the study searched replaces the
user's value: that is what was tuned. A knob the study held fixed at another value than the
user's is a conflict: the study measured other shapes than the user runs, so the export is
refused (naming each key with both values) unless `--force` takes the study's. A trainer setting
the measured shapes need (Adapter.settings: dynamic batching off, no critic) is written with a
note, or refused where flipping it would change the algorithm. No YAML library here.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from autotune.batching import BUDGET_KNOB, batched_phases, with_token_budgets
from autotune.config import VLLM_ENGINES, Topology, format_bytes
from autotune.trainers.adapter import Adapter, Setting
from autotune.trainers.measured import MeasuredRun, differences, model_lines

MISSING = object()
# knobs only the vllm-like engine reads: the hf and policy engines' probes never measured them
ENGINE_ONLY_KNOBS = ("gpu_memory_utilization", "max_num_batched_tokens", "enable_sleep",
                     "kv_cache_memory_bytes")
FLAGS = ("offload_params", "offload_optimizer", "gradient_checkpointing",  # said when flipped
         "dynamic_batching", "critic_offload_params", "critic_offload_optimizer",
         "critic_gradient_checkpointing")


def dotted_get(tree: Any, key: str, default: Any = None) -> Any:
    """tree["a"]["b"] for "a.b"; `default` when a key is missing or holds null (a trainer
    reads a null as its built-in default)."""
    node = tree
    for part in key.split("."):
        if not hasattr(node, "get") or part not in node:
            return default
        node = node[part]
    return default if node is None and default is not None else node


def same(have: Any, value: Any) -> bool:
    """Whether the user's value is the study's (true is not 1 here, 0.6 is 0.6)."""
    return have == value and isinstance(have, bool) == isinstance(value, bool)


def shown(value: Any) -> str:
    """A value as the user wrote it in YAML."""
    if value is None or value is MISSING:
        return "null" if value is None else "(not set)"
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class ExportPlan:
    values: dict[str, Any] = field(default_factory=dict)  # every key written, in order
    problems: list[str] = field(default_factory=list)  # rules broken, conflicts: not written
    changes: list[str] = field(default_factory=list)  # the header's account of the edit
    notes: list[str] = field(default_factory=list)  # settings flipped, for the terminal
    batching: str = ""  # how the file makes the trainer cut micro-batches, and why
    run: list[str] = field(default_factory=list)  # the header's account of the model, and
    # of what the trainer runs as measured but cannot be told in its config
    unmeasured: list[str] = field(default_factory=list)  # what --force exported unlike the
    # measured run: the header says so


def measured_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    """The knobs the probe measured: the engine's reservation knobs only with an engine that
    reserves (a study probed with the hf engine never ran them); a study recorded before
    dynamic batching was a knob ran fixed micro-batches, and one before PPO ran GRPO; a
    reference whose offload was not set waited where the actor's params did; one before
    fused_optimizer stepped torch's default AdamW."""
    measured = {"dynamic_batching": False, "algorithm": "grpo", "fused_optimizer": False,
                **knobs}
    if measured.get("offload_ref_params") is None and "offload_params" in measured:
        measured["offload_ref_params"] = measured["offload_params"]  # the reference followed
    if knobs.get("rollout_engine", "vllm") in VLLM_ENGINES:  # hf, policy: no reservation
        return measured
    return {k: v for k, v in measured.items() if k not in ENGINE_ONLY_KNOBS}


def plan_export(adapter: Adapter, knobs: dict[str, Any], topology: Topology, tree: Any,
                searched: Collection[str] | None = None, force: bool = False,
                extra: dict[str, Any] | None = None,
                run: MeasuredRun | None = None) -> ExportPlan:
    """The plan of writing `knobs` for `topology` into `tree` (the user's config, or None).
    `searched`: the knobs the study searched (None: every knob is the caller's to set, as for
    a trial's config, and nothing the study held fixed is compared with the base). `run`: what
    the study measured besides its knobs (topology, model, engine); another is a conflict."""
    if searched is not None and knobs.get("offload_ref_params") is None \
            and "offload_params" in searched:  # the reference followed the searched offload
        searched = {*searched, "offload_ref_params"}
    knobs = with_token_budgets(measured_knobs(knobs))
    plan, base = ExportPlan(), tree if tree is not None else {}
    plan.batching = batching_line(adapter, knobs, tree)
    plan.run = adapter.unheld(knobs, topology) if adapter.unheld else []
    if knobs.get("kv_cache_memory_bytes") is not None:  # no trainer has a key for it
        plan.run.append(
            f"rollout: the study's engine had a KV pool of "
            f"{format_bytes(knobs['kv_cache_memory_bytes'])} (kv_cache_memory_bytes); "
            f"{adapter.name} has no key for it: its vLLM sizes the pool from "
            f"gpu_memory_utilization={knobs.get('gpu_memory_utilization')} of the GPU, so the "
            "rollout's memory and speed differ from what was measured")
    if run is not None:
        for difference in differences(adapter, run, knobs, topology):
            if force:
                plan.unmeasured.append(difference.unmeasured)
            else:
                plan.problems.append(difference.conflict)
        model_values, model_text = model_lines(adapter, run, tree is not None)
        if knobs.get("algorithm") == "ppo" and adapter.critic_model_key \
                and adapter.model_key in model_values:  # the critic: the actor's model
            model_values[adapter.critic_model_key] = model_values[adapter.model_key]
        plan.run = model_text + plan.run
        extra = {**model_values, **(extra or {})}

    def get(key: str, default: Any) -> Any:
        return resolved_get(base, key, default)

    plan.problems += adapter.check(knobs, topology, get)
    why: dict[str, str] = {}
    for key, value in adapter.tuned_values(knobs, topology,
                                           get if tree is not None else None).items():
        if value is None and dotted_get(base, key, MISSING) is MISSING:
            continue  # a companion that only clears a key the user's file does not have
        plan.values[key] = value
    table = adapter.keys_for(knobs)
    for knob in knobs:
        for key in table.get(knob, ()):
            why[key] = "searched" if searched is None or knob in searched else "held fixed"
    for part in adapter.derived:
        if all(knobs.get(knob) is not None for knob in part.knobs):
            tuned = searched is None or any(knob in searched for knob in part.knobs)
            why.update({key: "searched" if tuned else "held fixed"
                        for key in part.write(knobs, topology)})
    if searched is not None and tree is not None:
        plan.problems += fixed_conflicts(adapter, knobs, topology, tree, searched, force)
    if tree is not None:
        problems, notes = algorithm_lines(adapter, knobs, topology, tree, searched is None,
                                          force)
        plan.problems += problems
        plan.notes += notes
    for setting in adapter.settings:
        have = dotted_get(base, setting.key, MISSING)
        if have is MISSING or have is None:
            if setting.default_ok:
                continue
        elif setting.ok(have):
            continue
        elif setting.refuse and not force:
            plan.problems.append(refusal(setting, have))
            continue
        plan.values[setting.key] = setting.value
        why[setting.key] = setting.why
        plan.notes.append(f"{setting.key}: {shown(have)} -> {shown(setting.value)}, because "
                          f"{setting.why}")
    if adapter.topology_keys:
        nodes_key, gpus_key = adapter.topology_keys
        plan.values.update({nodes_key: topology.nnodes, gpus_key: topology.gpus_per_node})
        why.update({nodes_key: "topology", gpus_key: "topology"})
    plan.values.update(extra or {})
    if tree is not None:
        for key in [key for key in plan.values if follows(tree, key, plan.values)]:
            del plan.values[key]  # the user's file already makes it the written key's value
        flags = {key for knob in FLAGS for key in table.get(knob, ())}
        for key, value in plan.values.items():
            have = dotted_get(tree, key, MISSING)
            if same(have, value):
                continue
            plan.changes.append(f"  {key}: {shown(have)} -> {shown(value)}"
                                f"{f' ({why[key]})' if key in why else ''}")
            if key in flags:  # offload and checkpointing: said on the terminal too
                plan.notes.append(f"{key}: {shown(have)} -> {shown(value)} ({why[key]})")
    else:
        plan.changes = [f"  {key}: {shown(value)} ({why[key]})"
                        for key, value in plan.values.items() if key in why and why[key]
                        not in ("searched", "held fixed", "topology")]
    return plan


INTERPOLATION = re.compile(r"\$\{(?:oc\.select:)?([\w.]+)(?:,([^{}]*))?\}")


def resolved_get(tree: Any, key: str, default: Any = None, depth: int = 8) -> Any:
    """dotted_get, with a whole-value interpolation `${key}` or `${oc.select:key,default}`
    (how verl's ppo_trainer.yaml makes its log-prob keys follow the actor's) read through."""
    value = dotted_get(tree, key, default)
    match = INTERPOLATION.fullmatch(value) if isinstance(value, str) else None
    if match is None or depth == 0:
        return value
    fallback = default if match.group(2) is None else plain_scalar(match.group(2))
    return resolved_get(tree, match.group(1), fallback, depth - 1)


def plain_scalar(text: str) -> Any:
    """An interpolation's default as OmegaConf reads it: an int, a bool, null or a string."""
    text = text.strip()
    words = {"true": True, "false": False, "null": None, "": None}
    if text.lower() in words:
        return words[text.lower()]
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def follows(tree: Any, key: str, values: dict[str, Any]) -> bool:
    """Whether `key` holds an interpolation of another key written with the same value
    (verl's log-prob keys are ${oc.select:actor_rollout_ref.actor....} by default)."""
    have = dotted_get(tree, key, MISSING)
    match = INTERPOLATION.fullmatch(have) if isinstance(have, str) else None
    if match is None:
        return False
    source = match.group(1)
    return source != key and source in values and same(values[source], values[key])


def batching_line(adapter: Adapter, knobs: dict[str, Any], tree: Any) -> str:
    """How the exported run cuts micro-batches, as measured: token budgets where the study
    probed them, else fixed micro-batches and why (the trainer has none, or dynamic batching
    is off in the user's config, the trainer's default, or the study's --set)."""
    keys = adapter.keys.get("dynamic_batching")
    if not keys:
        return (f"batching: fixed micro-batches, as probed: {adapter.name} has no token "
                "budgets (no dynamic batching)")
    if knobs.get("dynamic_batching"):
        budgets = ", ".join(f"{knobs[BUDGET_KNOB[phase]]:,} tokens per GPU per {phase} "
                            "micro-batch" for phase in batched_phases(knobs))
        return (f"batching: token budgets (dynamic batching on, as probed): {budgets}, "
                "probed with every response at its full length, so no micro-batch holds "
                "more tokens than measured")
    have = resolved_get(tree, keys[0], MISSING) if tree is not None else MISSING
    why = ("your base config turns dynamic batching off" if have is False else
           f"the study measured fixed micro-batches (dynamic_batching=false); {adapter.name}"
           f"'s default is {'on' if (adapter.defaults or {}).get('dynamic_batching') else 'off'}"
           "; sweep with dynamic_batching=true to tune token budgets")
    return f"batching: fixed micro-batches, as probed: {why}"


def refusal(setting: Setting, have: Any, force: str = ", or pass --force to export it") -> str:
    return (f"{setting.key} is {shown(have)} in your base config: {setting.why}; set "
            f"{setting.key}: {shown(setting.value)} there{force}")


def refused_settings(adapter: Adapter, tree: Any) -> list[str]:
    """The settings in the user's config that the probe cannot stand for (a critic): a sweep
    on such a base config would measure another algorithm than the user runs."""
    lines = []
    for setting in adapter.settings:
        have = dotted_get(tree, setting.key, MISSING)
        if setting.refuse and have is not MISSING and have is not None and not setting.ok(have):
            lines.append(refusal(setting, have, force=""))
    return lines


def algorithm_lines(adapter: Adapter, knobs: dict[str, Any], topology: Topology, tree: Any,
                    compare: bool, force: bool) -> tuple[list[str], list[str]]:
    """The user's config trains another algorithm than the study measured (a critic, or
    none): refused where the config says so (`compare`: not already a held-fixed conflict;
    --force writes the study's), said on the terminal where only the trainer's default
    does (verl's is gae: a critic)."""
    want = knobs.get("algorithm")
    problems, notes = [], []
    for part in adapter.derived:
        if "algorithm" not in part.knobs or want is None:
            continue
        have = part.read(lambda key, default: resolved_get(tree, key, default),
                         topology)["algorithm"]
        if have == want:
            continue
        stated = [key for key in part.keys if dotted_get(tree, key, MISSING) not in (MISSING,
                                                                                    None)]
        where = " and ".join(part.keys)
        if not stated:
            notes.append(f"{where}: not set in your base config, where {adapter.name}'s "
                         f"default trains {have}; set to the study's algorithm, {want}")
        elif compare and not force:
            held = "a critic beside the actor" if want == "ppo" else "no critic"
            problems.append(f"{' and '.join(stated)} in your base config train {have} but the "
                            f"study measured {want} ({held}): set them for {want} there, "
                            f"re-run the sweep with --algorithm {have}, or pass --force to "
                            "export the study's")
    return problems, notes


def fixed_conflicts(adapter: Adapter, knobs: dict[str, Any], topology: Topology, tree: Any,
                    searched: Collection[str], force: bool) -> list[str]:
    """One line per key the study held fixed at another value than the user's config has
    (none with --force: the study's values are then taken and listed in the header)."""
    if force:
        return []

    def get(key: str, default: Any) -> Any:
        return resolved_get(tree, key, default)

    stated: dict[str, tuple[str, Any]] = {}  # knob -> (where the user's value is, the value)
    for knob, keys in adapter.keys_for(knobs).items():
        have = resolved_get(tree, keys[0], MISSING)  # an interpolation read through
        if have is not MISSING and have is not None:
            stated[knob] = (keys[0], have)
    for part in adapter.derived:  # knobs the config holds in several keys (TRL's batches)
        if any(dotted_get(tree, key, MISSING) not in (MISSING, None) for key in part.keys):
            read, where = part.read(get, topology), " and ".join(part.keys)
            stated.update({knob: (f"{knob} (from {where})", read[knob])
                           for knob in part.knobs})
    lines = []
    for knob, (where, have) in stated.items():
        value = knobs.get(knob)
        if knob in searched or value is None or same(have, value):
            continue
        lines.append(f"{where} is {shown(have)} in your base config but the study measured "
                     f"{shown(value)} (held fixed, not searched): re-run the sweep with this "
                     "--base-config so it measures your shapes, or pass --force to export the "
                     "study's")
    return lines
