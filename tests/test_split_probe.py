"""The split probe (placement=separate, issue 68): the engine's side and the trainer's as two
real processes of the tiny model on the CPU, each on its own core, joined by a loopback link
that carries the barriers and the weights; the step they run held to the one config/pipeline.py
composes from their phase times, and a sweep over splits run end to end.
"""

from __future__ import annotations

import subprocess
import sys

import optuna
import pytest
import yaml

from autotune.cli.text import format_probe_result
from autotune.config import ProbeConfig
from autotune.config.pipeline import step_seconds
from autotune.hardware import Device
from autotune.probe.launch.split_sides import merge_sides, side_requests
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus

SPLIT = dict(placement="separate", rollout_engine="vllm-like", kv_cache_memory_bytes=64 << 20,
             rollout_batch_size=12, rollout_n=2, global_batch_size=6, micro_batch_size_update=2,
             micro_batch_size_experience=2, max_prompt_length=32, max_response_length=32)


def probe(tmp_path, limit_bytes=None, **knobs) -> ProbeResult:
    """One split probe of a run of 4 GPUs, through the worker as a runner starts it."""
    config = ProbeConfig(**{**SPLIT, **knobs})
    request = ProbeRequest(model="tiny-qwen2.5", config=config, nnodes=1, gpus_per_node=4,
                           warmup_steps=1, timed_steps=3, timeout_s=300,
                           device=Device("cpu", limit_bytes=limit_bytes))
    path = tmp_path / "request.json"
    path.write_text(request.to_json())
    done = subprocess.run([sys.executable, "-m", "autotune.probe.worker", str(path),
                           str(tmp_path / "result.json")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return ProbeResult.from_json((tmp_path / "result.json").read_text())


@pytest.mark.slow
def test_a_split_probe_runs_both_sides_and_its_step_composes(tmp_path):
    """Both sides ran their phases on their own GPUs' shares (12 prompts x 2 over the
    trainer's 3 GPUs), the trainer sent the engine its weights each step, and the step as it
    ran (sync to sync) is within 10% of the composition of its own phase times: the sum at
    staleness 0 (the sweep below holds staleness 1, the slower side plus the sync, on 1 and 2
    engine GPUs)."""
    staleness, engine_gpus = 0, 1
    result = probe(tmp_path, rollout_gpus=engine_gpus, staleness=staleness)
    assert result.status is ProbeStatus.OK, result.message
    assert set(result.phase_s) == {"rollout", "experience", "update", "weight_sync"}
    assert result.phase_s["weight_sync"] > 0 and len(result.step_times_s) == 3
    trainers = 4 - engine_gpus
    assert result.share["world_size"] == trainers
    assert result.share["responses_per_step"] == 24 // trainers
    assert result.world_size == 4
    composed = step_seconds(result.phase_s, True, staleness)
    assert result.composed_step_s == pytest.approx(composed)
    assert abs(composed - result.step_s) <= 0.10 * result.step_s, (composed, result.step_s)
    tokens = 12 * 2 * (32 + 32)  # the whole run's step: every prompt, every response
    assert result.tokens_per_s == pytest.approx(tokens / result.step_s)
    assert set(result.side_peak_mem_bytes) == {"engine", "trainer"}
    assert result.peak_mem_bytes == max(result.phase_peak_mem_bytes.values())


def test_a_split_that_breaks_a_rule_starts_no_side(tmp_path):
    """The rules read the whole run: rollout_gpus=4 of 4 leaves no GPU to train. INVALID,
    saying so, and no side started."""
    result = probe(tmp_path, rollout_gpus=4, staleness=1)
    assert result.status is ProbeStatus.INVALID
    assert "placement=separate with rollout_gpus=4" in result.message
    assert not list(tmp_path.glob("*.engine.*")) and not list(tmp_path.glob("*.trainer.*"))


@pytest.mark.slow
def test_a_side_that_fails_ends_the_probe_and_is_named(tmp_path):
    """Under a 470 MiB cap the trainer's update runs out of memory (its side holds the AdamW
    states) while the engine's side waits for it at their barrier: the launcher ends the
    engine's side at once and the probe is the trainer's OOM, named, in that phase."""
    result = probe(tmp_path, limit_bytes=470 << 20, rollout_gpus=2, staleness=1)
    assert result.status is ProbeStatus.GPU_OOM, result.message
    assert result.message.startswith("trainer's side: ") and result.failed_phase == "update"


def test_each_side_runs_its_gpus_share_on_cores_of_its_own():
    request = ProbeRequest(model="tiny-qwen2.5", config=ProbeConfig(**SPLIT, rollout_gpus=2,
                                                                    staleness=1),
                           nnodes=2, gpus_per_node=2, cpu_ids=(0, 1, 2, 3), timed_min_s=5.0)
    sides = side_requests(request, 1234)
    assert sides is not None
    engine, trainer = sides["engine"], sides["trainer"]
    assert (engine.nnodes, engine.gpus_per_node, trainer.nnodes, trainer.gpus_per_node) \
        == (1, 2, 1, 2)
    assert (engine.cpu_ids, trainer.cpu_ids) == ((0, 1), (2, 3))
    assert engine.split_side == "engine" and trainer.split_side == "trainer"
    assert not engine.config.separate and engine.config.staleness == 1
    assert engine.full_steps and engine.timed_min_s == 0 and engine.split_port == 1234
    assert side_requests(ProbeRequest(model="m", config=ProbeConfig(**SPLIT, rollout_gpus=1),
                                      nnodes=2, gpus_per_node=2), 1) is None  # half a node


def test_the_pipeline_takes_each_phase_from_the_side_that_ran_it():
    engine = ProbeResult(status=ProbeStatus.OK, phase_s={"rollout": 2.0, "weight_sync": 0.5},
                         phase_peak_mem_bytes={"rollout": 100, "weight_sync": 300},
                         peak_mem_bytes=300, engine={"kv_pool_bytes": 64})
    trainer = ProbeResult(status=ProbeStatus.OK, step_s=3.6, tokens_per_s=10.0,
                          phase_s={"experience": 1.0, "update": 2.0},
                          phase_peak_mem_bytes={"experience": 200, "update": 250,
                                                "weight_sync": 220}, peak_mem_bytes=250)
    merged = merge_sides(ProbeConfig(**SPLIT, rollout_gpus=1, staleness=1), engine, trainer, 4)
    assert merged.composed_step_s == pytest.approx(3.0 + 0.5)  # max(2, 3) + the sync
    assert merged.phase_peak_mem_bytes == {"rollout": 300, "experience": 200, "update": 250,
                                           "weight_sync": 220}
    assert merged.peak_mem_bytes == 300 and merged.engine == {"kv_pool_bytes": 64}
    assert merged.side_peak_mem_bytes == {"engine": 300, "trainer": 250}
    assert (merged.step_s, merged.world_size) == (3.6, 4)
    text = format_probe_result(merged.replace(samples_per_s=1.0, probe_wall_s=9.0),  # probe
                               "m")
    assert "4 GPUs split: the engine's side and the trainer's" in text
    assert "3.50 s composed from its phases" in text and "  weight_sync " in text


def test_every_view_of_a_study_says_how_each_placement_was_probed():
    """One wording for how probes ran, per placement a study probed: a sweep over splits and
    colocated configs names both; one GPU is one device."""
    from autotune.probe.measure.result import study_probes_text

    assert study_probes_text(8, True, ["colocated"] * 3) == \
        "rank 0 of 8 emulated (memory per rank; time without communication)"
    mixed = study_probes_text(4, True, ["separate", "colocated", "separate"])
    assert mixed.startswith("colocated: rank 0 of 4 emulated") and \
        "; separate: 4 GPUs split: the engine's side and the trainer's" in mixed
    assert study_probes_text(2, False, []) == "2 real ranks"
    assert study_probes_text(1, False, ["colocated"]) == "one device"


SPACE = """
params:
  rollout_gpus: {type: categorical, choices: [1, 2]}
fixed: {placement: separate, staleness: 1, rollout_engine: vllm-like,
        kv_cache_memory_bytes: 64MiB, rollout_batch_size: 12, rollout_n: 2,
        global_batch_size: 6, micro_batch_size_update: 2, micro_batch_size_experience: 2,
        max_prompt_length: 32, max_response_length: 32}
"""


@pytest.mark.slow
def test_a_sweep_over_splits_runs_end_to_end_and_its_pick_composes(tmp_path):
    """`autotune run` over the split of 4 emulated GPUs: every split probed as two real
    processes, the pick read from the pooled phase times composed as a pipeline, and that
    composition within 10% of the step its probe measured."""
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    out = subprocess.run(
        [sys.executable, "-m", "autotune", "run", "--model", "tiny-qwen2.5", "--device", "cpu",
         "--space", str(space), "--study", "s", "--results-dir", str(tmp_path / "results"),
         "--gpus-per-node", "4", "--ranks", "emulated", "--warmup-steps", "1",
         "--timed-steps", "3", "--trials", "2", "--no-trace", "--no-stop-slow",
         "--finalists", "0"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    study_dir = tmp_path / "results" / "s"
    text = (study_dir / "best.yaml").read_text()
    best = yaml.safe_load(text)
    assert best["config"]["placement"] == "separate"
    split = "4 GPUs split: the engine's side and the trainer's, each one process over " \
        "emulated ranks"
    assert split in text.splitlines()[0]  # best.yaml, `show` and the report say it alike
    shown = subprocess.run([sys.executable, "-m", "autotune", "show", "--study", "s",
                            "--results-dir", str(tmp_path / "results")],
                           capture_output=True, text=True, timeout=120)
    assert f"(a probe: {split}" in shown.stdout, shown.stdout[:2000]
    assert split.replace("'", "&#x27;") in (study_dir / "report.html").read_text()
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{study_dir / 'study.db'}")
    probed = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("probed")]
    assert {t.params["rollout_gpus"] for t in probed} == {1, 2}
    chosen = next(t for t in probed if t.number == best["trial"])
    result = chosen.user_attrs["result"]
    assert result["status"] == "ok" and result["side_peak_mem_bytes"]
    composed = step_seconds(result["phase_s"], True, 1)
    assert abs(composed - result["step_s"]) <= 0.10 * result["step_s"]
    # the engine generated beside the update: the step is under the sum of its phases
    assert result["step_s"] < sum(result["phase_s"].values())
    pooled = best["measured"]["tokens_per_s"]  # the pick's composed figure
    assert abs(pooled - result["tokens_per_s"]) <= 0.10 * result["tokens_per_s"]
