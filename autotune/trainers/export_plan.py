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

from autotune.batching import BUDGET_KNOB, with_token_budgets
from autotune.config import LORA_KNOBS, Knobs, ProbeConfig, Topology, format_bytes
from autotune.trainers.adapter import (
    Adapter,
    Getter,
    Setting,
    TrainerKeys,
    TrainerTree,
    TrainerValue,
)
from autotune.trainers.key_classes import Compared, base_keys, same
from autotune.trainers.measured import MeasuredRun, differences, model_lines

MISSING = object()
# knobs only the vllm-like engine reads: the hf and policy engines' probes never measured them
ENGINE_ONLY_KNOBS = ("gpu_memory_utilization", "max_num_batched_tokens", "enable_sleep",
                     "kv_cache_memory_bytes")
FLAGS = ("offload_params", "offload_optimizer", "gradient_checkpointing",  # said when flipped
         "dynamic_batching", "critic_offload_params", "critic_offload_optimizer",
         "critic_gradient_checkpointing")


def dotted_get(tree: TrainerTree, key: str, default: TrainerValue = None) -> TrainerValue:
    """tree["a"]["b"] for "a.b"; `default` when a key is missing or holds null (a trainer
    reads a null as its built-in default)."""
    node = tree
    for part in key.split("."):
        if not hasattr(node, "get") or part not in node:
            return default
        node = node[part]
    return default if node is None and default is not None else node


def shown(value: TrainerValue) -> str:
    """A value as the user wrote it in YAML."""
    if value is None or value is MISSING:
        return "null" if value is None else "(not set)"
    return str(value).lower() if isinstance(value, bool) else str(value)


@dataclass
class ExportPlan:
    values: TrainerKeys = field(default_factory=dict)  # every key written, in order
    problems: list[str] = field(default_factory=list)  # rules broken, conflicts: not written
    changes: list[str] = field(default_factory=list)  # the header's account of the edit
    notes: list[str] = field(default_factory=list)  # settings flipped, for the terminal
    batching: str = ""  # how the file makes the trainer cut micro-batches, and why
    run: list[str] = field(default_factory=list)  # the header's account of the model, and
    # of what the trainer runs as measured but cannot be told in its config
    unmeasured: list[str] = field(default_factory=list)  # what --force exported unlike the
    # measured run: the header says so
    not_compared: list[str] = field(default_factory=list)  # base keys in no class
    # (key_classes.py): the header says so, --strict refuses them
    trainers: Topology | None = None  # placement=separate: the GPUs that train (the launch
    # line's processes), the engine's being the run's others
    engine_values: TrainerKeys = field(default_factory=dict)  # placement=separate: the keys
    # that place the engine on its GPUs
    launch: str = ""  # the launch line where it is not the adapter's (a trainer's recipe)


def measured_knobs(knobs: Knobs) -> Knobs:
    """The knobs the probe measured: the engine's reservation knobs only with an engine that
    reserves (a study probed with the hf engine never ran them; one that names no engine
    keeps them); a study recorded before dynamic batching was a knob ran fixed micro-batches,
    one before PPO ran GRPO, one before LoRA and Ulysses full fine-tuning without SP (LoRA's
    other knobs are dropped without a rank); a reference whose offload was not set waited where the
    actor's params did; one before fused_optimizer stepped torch's default AdamW; one before
    placement ran the engine beside the trainer."""
    measured: Knobs = {"dynamic_batching": False, "algorithm": "grpo", "fused_optimizer": False,
                       "lora_rank": 0, "ulysses_sequence_parallel_size": 1,
                       "placement": "colocated", **knobs}
    if not measured["lora_rank"]:  # LoRA's other knobs mean nothing without a rank
        measured = {k: v for k, v in measured.items() if k not in LORA_KNOBS}
    if measured.get("offload_ref_params") is None and "offload_params" in measured:
        measured["offload_ref_params"] = measured["offload_params"]  # the reference followed
    if "rollout_engine" not in knobs or ProbeConfig.from_knobs(measured).engine_reserves:
        return measured
    return {k: v for k, v in measured.items() if k not in ENGINE_ONLY_KNOBS}  # hf, policy


def recorded(knobs: Knobs) -> set[str]:
    """The knobs `knobs` give a value (a study's, as recorded): what an export writes."""
    return {knob for knob, value in knobs.items() if value is not None}


def plan_export(adapter: Adapter, knobs: Knobs, topology: Topology, tree: TrainerTree | None,
                searched: Collection[str] | None = None, force: bool = False,
                extra: TrainerKeys | None = None,
                run: MeasuredRun | None = None, strict: bool = False) -> ExportPlan:
    """The plan of writing `knobs` for `topology` into `tree` (the user's config, or None).
    `knobs`: a study's as recorded (one recorded before a knob existed lacks it), or a whole
    config's (a trial's); a knob not given is not written. `searched`: the knobs the study
    searched (None: every knob is the caller's to set, as for a trial's config, and nothing
    the study held fixed is compared with the base). `run`: what the study measured besides
    its knobs (topology, model, engine); another is a conflict. Every other key of `tree`
    is compared by its class (base_key_lines); `strict`: one in no class is refused."""
    if searched is not None and knobs.get("offload_ref_params") is None \
            and "offload_params" in searched:  # the reference followed the searched offload
        searched = {*searched, "offload_ref_params"}
    knobs = with_token_budgets(measured_knobs(knobs))
    config = ProbeConfig.from_knobs(knobs)  # the whole config the rules read, as the probe ran it
    plan, base = ExportPlan(), tree if tree is not None else {}
    plan.batching = batching_line(adapter, knobs, tree)
    measured = topology  # the study's run; the trainer's own GPUs are all but the engine's
    topology = separate_placement(plan, adapter, config, topology,
                                  run.base_model or run.model_id if run else None)
    plan.run += run_lines(adapter, knobs, config, topology)
    if run is not None:
        extra = {**measured_run_values(plan, adapter, run, knobs, config, measured,
                                       tree is not None, force), **(extra or {})}

    settled = settings_written(adapter, base, force, config)

    def get(key: str, default: TrainerValue) -> TrainerValue:  # as the file will hold it
        return settled[key] if key in settled else resolved_get(base, key, default)

    plan.problems += adapter.check(config, topology, get, recorded(knobs))
    why = tuned_keys(plan, adapter, knobs, topology, base, get if tree is not None else None,
                     searched)
    # the keys the placement writes itself (its recipe's): a base already of that placement
    placed = {**adapter.derived_values(knobs, topology), **plan.engine_values}
    if searched is not None and tree is not None:
        plan.problems += fixed_conflicts(adapter, knobs, topology, tree, searched, force,
                                         placed)
    if tree is not None and searched is not None and not (run is not None and run.command):
        base_key_lines(plan, adapter, tree, force, strict,  # a study's export (not a trial's
                       on_cpu=run is not None and run.on_cpu,  # config, nor one of a study
                       placed=placed)
        # of the user's own trainer, which ran its base's settings itself)
    if tree is not None:
        problems, notes = algorithm_lines(adapter, config, topology, tree, searched is None,
                                          force)
        plan.problems += problems
        plan.notes += notes
    setting_values(plan, adapter, base, why, force, config)
    if run is not None and not run.command:  # a study of the built-in step (a trainer's own
        unset_defaults_unlike_the_probes(plan, adapter, base, why, run.on_cpu)  # ran its own)
    if adapter.topology_keys:
        nodes_key, gpus_key = adapter.topology_keys
        plan.values.update({nodes_key: topology.nnodes, gpus_key: topology.gpus_per_node})
        why.update({nodes_key: "topology", gpus_key: "topology"})
    plan.values.update(plan.engine_values)  # the engine's GPUs (placement=separate)
    why.update(dict.fromkeys(plan.engine_values, "topology"))
    plan.values.update(extra or {})
    change_lines(plan, adapter, config, tree, why)
    return plan


def separate_placement(plan: ExportPlan, adapter: Adapter, config: ProbeConfig,
                       topology: Topology, model: str | None) -> Topology:
    """The GPUs the trainer's config describes: the run's, or with placement=separate the
    ones left to train (plan.trainers; the header says how to start each side). Refused
    where the trainer has no such placement, where autotune does not write it yet
    (docs/research/placement.md), or where the engine would take part of a node of a
    multi-node run."""
    if not config.separate:
        return topology
    if adapter.separate_launch is None:
        why = (f"{adapter.name} has no separate placement: {adapter.no_separate_placement}"
               if adapter.no_separate_placement else f"autotune does not write "
               f"{adapter.name}'s keys for it yet")
        plan.problems.append(f"placement=separate: {why}; export a study with "
                             "placement=colocated")
        return topology
    trainers = topology.without_engine(config.rollout_gpus)
    if trainers is None:
        plan.problems.append(
            f"placement=separate with rollout_gpus={config.rollout_gpus} on "
            f"{topology.nnodes} nodes of {topology.gpus_per_node} GPUs: the engine takes whole "
            f"nodes of a multi-node run (a multiple of {topology.gpus_per_node}), or fewer "
            f"than the {topology.world_size} GPUs of one node")
        return topology
    launch = adapter.separate_launch(config, topology, trainers, model)
    plan.run += launch.lines
    plan.problems += launch.problems
    plan.trainers, plan.engine_values, plan.launch = trainers, launch.values, launch.launch
    return trainers


def run_lines(adapter: Adapter, knobs: Knobs, config: ProbeConfig,
              topology: Topology) -> list[str]:
    """The header's lines on what the trainer runs as measured but its config cannot say
    (Adapter.unheld), and on a KV pool the study sized in bytes (no trainer has a key)."""
    lines = adapter.unheld(config, topology, recorded(knobs)) if adapter.unheld else []
    pool = config.kv_cache_memory_bytes if "kv_cache_memory_bytes" in knobs else None
    if pool is not None:  # measured: an engine that reserves
        lines.append(
            f"rollout: the study's engine had a KV pool of {format_bytes(pool)} "
            f"(kv_cache_memory_bytes); {adapter.name} has no key for it: its vLLM sizes the "
            f"pool from gpu_memory_utilization={knobs.get('gpu_memory_utilization')} of the "
            "GPU, so the rollout's memory and speed differ from what was measured")
    return lines


def measured_run_values(plan: ExportPlan, adapter: Adapter, run: MeasuredRun, knobs: Knobs,
                        config: ProbeConfig, topology: Topology, on_base: bool,
                        force: bool) -> TrainerKeys:
    """Each way the export is not the measured run into `plan` (a problem, or with --force a
    line under unmeasured), and the model's lines on top of plan.run; returns the model keys
    to write (a critic's model is the actor's)."""
    for difference in differences(adapter, run, knobs, topology):
        if force:
            plan.unmeasured.append(difference.unmeasured)
        else:
            plan.problems.append(difference.conflict)
    model_values, model_text = model_lines(adapter, run, on_base)
    actor_model = model_values.get(adapter.model_key or "", run.base_model or run.model_id)
    critic = adapter.critic_model_key
    if config.has_critic and critic and actor_model is not None and not run.command and (
            not on_base or run.base_critic_model is None):
        model_values[critic] = actor_model  # the critic: the actor's model, as probed
    plan.run = model_text + plan.run
    return model_values


def tuned_keys(plan: ExportPlan, adapter: Adapter, knobs: Knobs, topology: Topology,
               base: TrainerTree, get: Getter | None,
               searched: Collection[str] | None) -> dict[str, str]:
    """The tuned keys into plan.values (not a companion that only clears a key the user's
    file does not have), and why each is written: searched, or held fixed."""
    for key, value in adapter.tuned_values(knobs, topology, get).items():
        if value is None and dotted_get(base, key, MISSING) is MISSING:
            continue  # a companion that only clears a key the user's file does not have
        plan.values[key] = value
    why: dict[str, str] = {}
    config = ProbeConfig.from_knobs(knobs)
    table = adapter.keys_for(config)
    for knob in knobs:
        for key in table.get(knob, ()):
            why[key] = "searched" if searched is None or knob in searched else "held fixed"
    for part in adapter.derived:
        if all(knobs.get(knob) is not None for knob in part.knobs):
            tuned = searched is None or any(knob in searched for knob in part.knobs)
            why.update({key: "searched" if tuned else "held fixed"
                        for key in part.write(config, topology)})
    why.update({key: f"dynamic batching: {adapter.name} runs the token budgets and would still "
                "check a micro-batch set here" for key in adapter.unused_keys(config)
                if key in plan.values})
    return why


def settings_written(adapter: Adapter, base: TrainerTree, force: bool,
                     config: ProbeConfig) -> TrainerKeys:
    """The settings an export writes over `base` (setting_values' choice, without a plan)."""
    written = {}
    for setting in adapter.settings:
        if not setting.reads(config):
            continue
        have = dotted_get(base, setting.key, MISSING)
        if have is MISSING or have is None:
            if not setting.default_ok:
                written[setting.key] = setting.value
        elif not setting.ok(have) and (force or not setting.refuses(have)):
            written[setting.key] = setting.value
    return written


def setting_values(plan: ExportPlan, adapter: Adapter, base: TrainerTree, why: dict[str, str],
                   force: bool, config: ProbeConfig) -> None:
    """The trainer settings `config`'s run reads into `plan`: written with a note where the
    user's config (or the trainer's default) has another value than the probes ran, or
    refused where flipping it would change the algorithm (not with --force)."""
    for setting in adapter.settings:
        if not setting.reads(config):
            continue
        have = dotted_get(base, setting.key, MISSING)
        if have is MISSING or have is None:
            if setting.default_ok:
                continue
        elif setting.ok(have):
            continue
        elif setting.refuses(have) and not force:
            plan.problems.append(refusal(setting, have))
            continue
        # a key a knob also writes (TRL's optim: fused or not) keeps the study's value
        tuned = plan.values.get(setting.key, MISSING)
        value = tuned if tuned is not MISSING and setting.ok(tuned) else setting.value
        plan.values[setting.key] = value
        why[setting.key] = setting.why
        plan.notes.append(f"{setting.key}: {shown(have)} -> {shown(value)}, because "
                          f"{setting.why}")


def unset_defaults_unlike_the_probes(plan: ExportPlan, adapter: Adapter, base: TrainerTree,
                                     why: dict[str, str], on_cpu: bool) -> None:
    """A compared setting the base leaves unset whose trainer default is not what the probes
    ran (TRL's bf16 defaults on, a CPU study's probes computed fp32) into `plan`: written at
    the probes' value, with why in the header. A set one is base_key_lines' to compare."""
    for rule in adapter.key_classes.compared:
        ran = rule.ran(on_cpu)
        key = rule.pattern
        if None in ran or any(char in key for char in "*?[") or key in plan.values or \
                resolved_get(base, key, None) is not None:
            continue
        plan.values[key] = ran[0]
        where = " on a CPU (fp32 compute)" if on_cpu and rule.cpu_values is not None else ""
        why[key] = f"the study's probes ran it so{where}; the trainer's default differs"
        plan.notes.append(f"{key}: not set -> {shown(ran[0])}, because {why[key]}")


def change_lines(plan: ExportPlan, adapter: Adapter, config: ProbeConfig,
                 tree: TrainerTree | None, why: dict[str, str]) -> None:
    """The header's account of the edit into `plan`: each key changed from the user's config,
    with both values and why (offload and checkpointing said on the terminal too; a key that
    already follows a written one by interpolation is left as it is); without a base, the
    keys written for another reason than the study's knobs and the topology."""
    if tree is None:
        plan.changes = [f"  {key}: {shown(value)} ({why[key]})"
                        for key, value in plan.values.items() if key in why and why[key]
                        not in ("searched", "held fixed", "topology")]
        return
    for key in [key for key in plan.values if follows(tree, key, plan.values)]:
        del plan.values[key]  # the user's file already makes it the written key's value
    table = adapter.keys_for(config)
    flags = {key for knob in FLAGS for key in table.get(knob, ())}
    for key, value in plan.values.items():
        have = dotted_get(tree, key, MISSING)
        if same(have, value):
            continue
        plan.changes.append(f"  {key}: {shown(have)} -> {shown(value)}"
                            f"{f' ({why[key]})' if key in why else ''}")
        if key in flags:  # offload and checkpointing: said on the terminal too
            plan.notes.append(f"{key}: {shown(have)} -> {shown(value)} ({why[key]})")


INTERPOLATION = re.compile(r"\$\{(?:oc\.select:)?([\w.]+)(?:,([^{}]*))?\}")


def resolved_get(tree: TrainerTree, key: str, default: TrainerValue = None,
                 depth: int = 8) -> TrainerValue:
    """dotted_get, with a whole-value interpolation `${key}` or `${oc.select:key,default}`
    (how verl's ppo_trainer.yaml makes its log-prob keys follow the actor's) read through."""
    value = dotted_get(tree, key, default)
    match = INTERPOLATION.fullmatch(value) if isinstance(value, str) else None
    if match is None or depth == 0:
        return value
    fallback = default if match.group(2) is None else plain_scalar(match.group(2))
    return resolved_get(tree, match.group(1), fallback, depth - 1)


def plain_scalar(text: str) -> bool | int | str | None:
    """An interpolation's default as OmegaConf reads it: an int, a bool, null or a string."""
    text = text.strip()
    words = {"true": True, "false": False, "null": None, "": None}
    if text.lower() in words:
        return words[text.lower()]
    return int(text) if re.fullmatch(r"-?\d+", text) else text


def follows(tree: TrainerTree, key: str, values: TrainerKeys) -> bool:
    """Whether `key` holds an interpolation of another key written with the same value
    (verl's log-prob keys are ${oc.select:actor_rollout_ref.actor....} by default)."""
    have = dotted_get(tree, key, MISSING)
    match = INTERPOLATION.fullmatch(have) if isinstance(have, str) else None
    if match is None:
        return False
    source = match.group(1)
    return source != key and source in values and same(values[source], values[key])


def batching_line(adapter: Adapter, knobs: Knobs, tree: TrainerTree | None) -> str:
    """How the exported run cuts micro-batches, as measured: token budgets where the study
    probed them (`knobs`: with every budget written out), else fixed micro-batches and why
    (the trainer has none, or dynamic batching is off in the user's config, the trainer's
    default, or the study's --set)."""
    keys = adapter.keys.get("dynamic_batching")
    if not keys:
        return (f"batching: fixed micro-batches, as probed: {adapter.name} has no token "
                "budgets (no dynamic batching)")
    if knobs.get("dynamic_batching"):
        phases = ProbeConfig.from_knobs(knobs).batched_phases
        budgets = ", ".join(f"{knobs[BUDGET_KNOB[phase]]:,} tokens per GPU per {phase} "
                            "micro-batch" for phase in phases)
        return (f"batching: token budgets (dynamic batching on, as probed): {budgets}, "
                "probed with every response at its full length, so no micro-batch holds "
                "more tokens than measured")
    have = resolved_get(tree, keys[0], MISSING) if tree is not None else MISSING
    why = ("your base config turns dynamic batching off" if have is False else
           f"the study measured fixed micro-batches (dynamic_batching=false); {adapter.name}"
           f"'s default is {'on' if (adapter.defaults or {}).get('dynamic_batching') else 'off'}"
           "; sweep with dynamic_batching=true to tune token budgets")
    return f"batching: fixed micro-batches, as probed: {why}"


def refusal(setting: Setting, have: TrainerValue,
            force: str = ", or pass --force to export it") -> str:
    return (f"{setting.key} is {shown(have)} in your base config: {setting.why}; set "
            f"{setting.key}: {shown(setting.value)} there{force}")


def refused_settings(adapter: Adapter, tree: TrainerTree, compared: bool = True,
                     on_cpu: bool = False) -> list[str]:
    """The settings in the user's config that the probe cannot stand for (a critic; a
    compared setting it does not run, such as Liger kernels): a sweep on such a base config
    would measure another run than the user's. `compared`: the compared settings too (not
    where the probes are the user's own trainer, which runs them)."""
    lines = []
    for setting in adapter.settings:
        if setting.applies is not None and not compared:  # a setting of some configs'
            continue  # runs, compared with the probe's: the user's trainer runs its own
        have = dotted_get(tree, setting.key, MISSING)
        if have is not MISSING and have is not None and not setting.ok(have) \
                and setting.refuses(have):
            lines.append(refusal(setting, have, force=""))
    return lines + (compared_refusals(adapter, tree, on_cpu) if compared else [])


def algorithm_lines(adapter: Adapter, config: ProbeConfig, topology: Topology,
                    tree: TrainerTree, compare: bool, force: bool) -> tuple[list[str], list[str]]:
    """The user's config trains another algorithm than the study measured (a critic, or
    none): refused where the config says so (`compare`: not already a held-fixed conflict;
    --force writes the study's), said on the terminal where only the trainer's default
    does (verl's is gae: a critic)."""
    want = config.algorithm
    problems, notes = [], []
    for part in adapter.derived:
        if "algorithm" not in part.knobs:
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
            held = "a critic beside the actor" if config.has_critic else "no critic"
            problems.append(f"{' and '.join(stated)} in your base config train {have} but the "
                            f"study measured {want} ({held}): set them for {want} there, "
                            f"re-run the sweep with --algorithm {have}, or pass --force to "
                            "export the study's")
    return problems, notes


def placed_by(key: str, have: TrainerValue, placed: TrainerKeys) -> bool:
    """Whether the user's `key` = `have` is what the placement's own keys write (`placed`: a
    separate placement's recipe keys, which the export writes and its header states, such as
    verl's calculate_log_probs true), or lies in a block the placement clears (None): a base
    already of that placement, not a setting of the user's to compare."""
    if key in placed:
        return same(have, placed[key])
    return any(value is None and key.startswith(f"{written}.")
               for written, value in placed.items())


def base_key_lines(plan: ExportPlan, adapter: Adapter, tree: TrainerTree, force: bool,
                   strict: bool, on_cpu: bool = False, placed: TrainerKeys | None = None
                   ) -> None:
    """Each key of the user's config outside autotune's tables, by its class: a compared
    setting at a value the probe's run does not equal is a problem (with --force, a line
    under unmeasured); a key in no class is listed as not compared (with `strict`, a
    problem). Knob keys, checked and inert keys, and the keys the placement writes itself
    (`placed`, as placed_by reads it): nothing here."""
    declared = adapter.key_classes
    for key, value, found in base_keys(tree, declared, adapter.knob_keys):
        if placed_by(key, value, placed or {}):
            continue
        if found is None:
            if value is None:  # a null: the trainer's default, whatever the key is
                continue
            plan.not_compared.append(f"{key}={shown(value)}")  # as written
            if strict:
                plan.problems.append(
                    f"{key}={shown(value)} in your base config is a key autotune does not "
                    f"classify for {adapter.name} ({declared.source or 'no schema'}): it may "
                    "change what the probes measured; remove it, or export without --strict "
                    "(the file's header then lists it as not compared)")
            continue
        unlike = unlike_the_probes(tree, key, value, found, on_cpu)
        if unlike is None:
            continue
        setting, why, ran = unlike
        if force:
            plan.unmeasured.append(f"{setting}: {why} (the study's probes ran {ran})")
        else:
            plan.problems.append(
                f"{setting} in your base config is not what the study measured: {why}; its "
                f"probes ran {ran}. Set it so (or remove it), or pass --force to export it "
                "anyway (the file's header then says it is unmeasured)")


def unlike_the_probes(tree: TrainerTree, key: str, value: TrainerValue,
                      found: tuple[str, object], on_cpu: bool = False
                      ) -> tuple[str, str, str] | None:
    """For a compared setting the probes did not run: ("KEY=VALUE", why, what they ran);
    else None (another class, or a value the probes' run equals, as written or resolved).
    `on_cpu`: the probes ran on a CPU (fp32 compute there: Compared.cpu_values)."""
    kind, rule = found
    if kind != "compared" or not isinstance(rule, Compared):
        return None
    have = resolved_get(tree, key, None)
    if rule.measured(have, on_cpu) or rule.measured(value, on_cpu):  # as written: verl's
        return None  # own interpolations
    ran = next((shown(v) for v in rule.ran(on_cpu) if v is not None), "it unset")
    return f"{key}={shown(have)}", rule.why, ran


def compared_refusals(adapter: Adapter, tree: TrainerTree, on_cpu: bool) -> list[str]:
    """The compared settings of the user's config that autotune's probes (on a CPU: fp32)
    do not run: a sweep on it would measure another run than the user's."""
    lines = []
    for key, value, found in base_keys(tree, adapter.key_classes, adapter.knob_keys):
        unlike = unlike_the_probes(tree, key, value, found, on_cpu) if found else None
        if unlike is not None:
            setting, why, ran = unlike
            lines.append(f"{setting}: {why}; autotune's probes run {ran}: set it so (or "
                         "remove it) to sweep on this config")
    return lines


def holds_as_written(tree: TrainerTree, values: TrainerKeys) -> bool:
    """Whether `tree` holds every one of `values`' keys as `values` writes it (a None: absent
    or null): the study's knobs, written, are what the base says (TRL's num_iterations 1
    reads back as a pass left to the batches, use_vllm false as the policy engine: the same
    run as a study's pass on over two optimizer steps, or its hf engine, written so)."""
    for key, value in values.items():
        have = resolved_get(tree, key, MISSING)  # absent or null: MISSING
        if (have is not MISSING or value is not None) and not same(have, value):
            return False
    return True


def fixed_conflicts(adapter: Adapter, knobs: Knobs, topology: Topology, tree: TrainerTree,
                    searched: Collection[str], force: bool,
                    placed: TrainerKeys | None = None) -> list[str]:
    """One line per key the study held fixed at another value than the user's config has
    (none with --force: the study's values are then taken and listed in the header); a knob
    the study did not record is not compared. A knob's key at the value the placement writes
    itself (`placed`: verl's fully asynchronous data.train_batch_size 0) is compared as the
    placement's derived part reads it back, not as the knob's key."""
    if force:
        return []

    def get(key: str, default: TrainerValue) -> TrainerValue:
        return resolved_get(tree, key, default)

    stated: dict[str, tuple[str, TrainerValue]] = {}  # knob -> (where the user's value is,
    # the value)
    config = ProbeConfig.from_knobs(knobs)
    unused = adapter.unused_keys(config)  # keys the trainer does not run (written as null)
    for knob, keys in adapter.keys_for(config).items():
        for key in keys:  # every key the knob is written to (the critic's too)
            have = resolved_get(tree, key, MISSING)  # an interpolation read through
            if key not in unused and not placed_by(key, have, placed or {}) \
                    and have is not MISSING and have is not None \
                    and (knob not in stated or same(stated[knob][1], knobs.get(knob))):
                stated[knob] = (key, have)
    for part in adapter.derived:  # knobs the config holds in several keys (TRL's batches)
        if any(dotted_get(tree, key, MISSING) not in (MISSING, None) for key in part.keys) \
                and not holds_as_written(tree, part.write(config, topology)):
            read, where = part.read(get, topology), " and ".join(part.keys)
            stated.update({knob: (f"{knob} (from {where})", value)  # every knob it reads:
                           for knob, value in read.items()})  # verl's fully asynchronous
            # step's prompts too; verl's placement reads nothing from a colocated config
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
