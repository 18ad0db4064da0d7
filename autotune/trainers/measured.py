"""The run a study measured beside its knobs, and how an export would differ from it.

A study's probes ran one topology, one model and one rollout engine. An export for another
topology (each GPU would take other shares of the batches), another model (other shapes) or a
trainer whose rollout engine the probe did not stand for is not the measured run: each is a
conflict (one line naming both sides and what to do), or with `--force` a line the exported
file's header keeps under "unmeasured". Pure data: the model's identity is decided by the
caller (sweep/pick/best_export.py reads the registry and local checkpoints).
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import Knobs, ProbeConfig, Topology
from autotune.trainers.adapter import Adapter, TrainerKeys, TrainerValue

RERUN = "re-run the sweep for that run"
FORCE = "or pass --force to export it anyway (the file's header then says it is unmeasured)"


@dataclass(frozen=True)
class MeasuredRun:
    """What a study's probes ran besides its knobs."""

    topology: Topology
    model: str  # as the study names it: a registry name, or a local checkpoint's folder
    model_id: str | None  # what a file without a base config names as its model (a Hugging
    # Face id or the local checkpoint's path); None: a model built here (random weights)
    base_model: TrainerValue = None  # the model the user's base config names (None: it names none)
    same_model: bool | None = None  # whether that model has the study's shapes (None: autotune
    # cannot tell: not in the registry and not a local checkpoint)
    command: bool = False  # probed by the user's own trainer: its config named the model
    base_critic_model: TrainerValue = None  # the critic's model the base config names (PPO)
    same_critic_model: bool | None = None  # whether it has the study's shapes (the probe's
    # critic is the actor's architecture with a value head: probe/modeling/critic.py)
    on_cpu: bool = False  # the probes ran on a CPU (fp32 compute): key_classes' cpu_values


@dataclass(frozen=True)
class Difference:
    """A way the export would not be the measured run."""

    conflict: str  # the refusal line
    unmeasured: str  # the header's line when --force exports it anyway


def differences(adapter: Adapter, run: MeasuredRun, knobs: Knobs,
                topology: Topology) -> list[Difference]:
    """Every way exporting `knobs` (a study's, as recorded: one recorded before the engine was
    a knob names none) for `topology` would not be the run the study measured."""
    found = []
    if topology != run.topology:
        probed, asked = run.topology, topology
        found.append(Difference(
            f"topology: the study measured {probed.nnodes} node(s) x {probed.gpus_per_node} "
            f"GPU(s) but the export is for {asked.nnodes} x {asked.gpus_per_node} (from "
            "--nnodes/--gpus-per-node or your base config): each GPU would take another share "
            f"of every batch: {RERUN} (--nnodes {asked.nnodes} --gpus-per-node "
            f"{asked.gpus_per_node}), {FORCE}",
            f"topology {asked.nnodes} x {asked.gpus_per_node}: the study measured "
            f"{probed.nnodes} x {probed.gpus_per_node}, so the per-GPU shares and memory "
            "differ from what was measured"))
    engine = knobs.get("rollout_engine")
    if engine is not None and engine not in adapter.engines:
        found.append(Difference(
            f"rollout engine: the study probed the {engine} engine, but {adapter.name} "
            f"generates with vLLM, which the {adapter.engines[0]} engine stands for: {RERUN} "
            f"with --engine {adapter.engines[0]} (on a CPU with --gpu-memory-limit), {FORCE}",
            f"rollout engine: the study probed the {engine} engine; {adapter.name}'s vLLM "
            "reserves its own gpu_memory_utilization, which no probe measured"))
    if run.base_model is not None and run.same_model is not True and not run.command:
        what = "another model" if run.same_model is False else \
            "a model autotune cannot compare (not in `autotune models`, not a local checkpoint)"
        found.append(Difference(
            f"{adapter.model_key}={run.base_model} in your base config is {what}, but the "
            f"study measured {run.model}: {RERUN} with that model (--model, or --model-path "
            f"to a local copy of it), {FORCE}",
            f"model {run.base_model}: the study measured {run.model}"))
    critic = adapter.critic_model_key
    if ProbeConfig.from_knobs(knobs).has_critic and critic and run.base_critic_model is not None \
            and run.same_critic_model is not True and not run.command:
        what = "another model" if run.same_critic_model is False else \
            "a model autotune cannot compare (not in `autotune models`, not a local checkpoint)"
        found.append(Difference(
            f"{critic}={run.base_critic_model} in your base config is {what}, but the study's "
            f"critic was {run.model} (the actor's model with a value head): set {critic} to "
            f"the actor's model there, {RERUN} with that critic, {FORCE}",
            f"critic model {run.base_critic_model}: the study's critic was {run.model}"))
    return found


def model_lines(adapter: Adapter, run: MeasuredRun, on_base: bool) -> tuple[TrainerKeys,
                                                                          list[str]]:
    """The model key a file without a base config writes, and the header's line on the
    model (what it names, or what to set when the study's model has no checkpoint)."""
    if on_base or run.command:
        return {}, []
    if adapter.model_key is None or not adapter.writes_model:  # TRL: the script loads it
        named = f" ({run.model_id})" if run.model_id else ""
        return {}, [f"model: load {run.model}{named} in your script, as measured"]
    if run.model_id is None:
        return {}, [f"model: the study measured {run.model}, built with random weights: set "
                    f"{adapter.model_key} to a checkpoint of its shapes"]
    return {adapter.model_key: run.model_id}, []
