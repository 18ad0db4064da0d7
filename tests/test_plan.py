"""The plan of a sweep, made and run without click: what `autotune run` resolves once (the
device and the memory a probe may use, the topology, the ranks, the engine, the space, the
trainer target, the runner) and the one export route. The probes are scripted (tests of the
real probe are in test_sweep_e2e.py): this holds the plan's decisions, not a probe's figures."""

from __future__ import annotations

import dataclasses

import pytest
from scripted_runner import ScriptedRunner

from autotune.errors import ConfigError
from autotune.hardware import Device, host_memory_bytes
from autotune.sweep.driver import run_sweep
from autotune.sweep.pick.best_export import export_best
from autotune.sweep.plan import (
    DEMO_CAP_BYTES,
    ProbeOptions,
    RunOptions,
    plan_probe,
    plan_sweep,
)
from autotune.sweep.study.storage import load_study

SPACE = """
params:
  micro_batch_size_update: {type: categorical, choices: [1, 2]}
  gradient_checkpointing: {type: bool}
fixed: {rollout_batch_size: 4, rollout_n: 2, global_batch_size: 2, max_prompt_length: 64,
        max_response_length: 32, micro_batch_size_experience: 2}
"""


def scripted(plan):
    """The plan with scripted probes in place of its subprocess runner."""
    plan.runner.close()
    return dataclasses.replace(plan, runner=ScriptedRunner())


def test_the_embedded_default_is_planned_once_without_click(tmp_path):
    """No --model on a machine without a GPU: the CPU demo, its device resolved once with its
    cap, and every figure the sweep reads taken from it."""
    plan = plan_sweep(RunOptions(results_dir=str(tmp_path)))
    settings = plan.settings
    assert settings.request.device == Device("cpu", host_memory_bytes(), DEMO_CAP_BYTES, 0)
    assert settings.request.device.usable_bytes == DEMO_CAP_BYTES
    assert (settings.request.model, settings.space.name, settings.max_trials) == \
        ("tiny-qwen2.5", "cpu-demo", 12)
    assert settings.request.timed_steps == 2 and settings.request.timed_min_s == 2.0
    assert not settings.request.full_steps  # a short probe (--full-steps: 3 whole steps)
    assert settings.trace and settings.finalists == 3
    assert settings.request.config.rollout_engine == "hf"  # auto on a CPU
    assert any(note.startswith("no --model: running the embedded default") for note in
               plan.notes)
    outcome = run_sweep(dataclasses.replace(scripted(plan), settings=dataclasses.replace(
        settings, max_trials=3)))
    assert outcome.exit_code == 0 and outcome.best_path is not None
    identity = load_study(str(tmp_path), settings.study_name).user_attrs["identity"]
    assert (identity["device"], identity["gpu_memory_limit_bytes"]) == ("cpu", DEMO_CAP_BYTES)


def test_a_trainer_sweep_writes_what_autotune_export_writes(tmp_path):
    """With --trainer the sweep keeps best.<trainer>.yaml beside best.yaml, by the one export
    route: the file is the text `autotune export` makes of the same study."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    plan = plan_sweep(RunOptions(probe=ProbeOptions(model="tiny-qwen2.5", device="cpu"),
                                 space=str(space), trials=4, trainer="verl",
                                 results_dir=str(tmp_path), study="verl"))
    assert plan.trainer is not None and plan.trainer.adapter.name == "verl"
    assert plan.settings.trainer == "verl on 1x1 GPUs"
    assert plan.settings.base_params == plan.settings.space.safe_params()  # its start
    outcome = run_sweep(scripted(plan))
    assert outcome.export_path is not None and outcome.export_path.name == "best.verl.yaml"
    study = load_study(str(tmp_path), "verl")
    # probed with the hf engine on the CPU: verl's vLLM was never measured, so `export`
    # refuses it; the sweep's own file is the --force export, saying so in its header
    with pytest.raises(ConfigError, match="rollout engine: the study probed the hf engine"):
        export_best(study, plan.trainer.adapter, None)
    exported = export_best(study, plan.trainer.adapter, None, force=True)
    assert outcome.export_path.read_text() == exported.text
    assert "#   rollout engine: the study probed the hf engine; verl's vLLM reserves its own " \
        "gpu_memory_utilization, which no probe measured" in exported.text
    assert exported.topology == plan.trainer.topology


def test_ranks_are_planned_from_the_topology_and_what_is_here(tmp_path):
    """A run of 64 GPUs cannot have its ranks here: emulated, nothing to confirm; a run of
    as many ranks as this machine's cores is emulated in the search and confirmed for real."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE.replace("rollout_batch_size: 4", "rollout_batch_size: 64")
                     .replace("global_batch_size: 2", "global_batch_size: 64"))
    wide = plan_sweep(RunOptions(probe=ProbeOptions(model="tiny-qwen2.5", device="cpu",
                                                    gpus_per_node=64),
                                 space=str(space), results_dir=str(tmp_path)))
    assert wide.settings.request.emulated and wide.settings.confirm == 0
    assert wide.settings.request.world_size == 64
    assert any("not all on this machine" in note for note in wide.notes)
    wide.runner.close()
    with pytest.raises(ConfigError, match="--ranks real: the run's 64 GPUs need 64 cores"):
        plan_probe(ProbeOptions(model="tiny-qwen2.5", device="cpu", gpus_per_node=64,
                                ranks="real", knobs={"rollout_batch_size": 64,
                                                     "global_batch_size": 64,
                                                     "micro_batch_size_experience": 4}))


def test_a_probe_is_planned_with_the_same_device_rule():
    request = plan_probe(ProbeOptions(model="tiny-qwen2.5", device="cpu",
                                      gpu_memory_limit_bytes=2**30,
                                      reserve_gpu_memory_bytes=2**29))
    # the cap is the lower of the limit and the device less the reserve
    assert request.device.cap_bytes == min(2**30, host_memory_bytes() - 2**29)
    assert request.device.usable_bytes == request.device.cap_bytes
    with pytest.raises(ConfigError, match="give --model NAME"):
        plan_probe(ProbeOptions())
