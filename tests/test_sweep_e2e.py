"""End to end: `autotune run` as a user runs it, with real probes of the tiny model on CPU.

A 600 MiB cap on the probe's device RSS makes the configs with micro_batch_size_experience=16
run out of memory for real (about 655 MiB in that phase; micro-batch 2 peaks near 490 MiB).
The sweeps run with --no-trace: these tests are about measured OOMs (the traced pre-screen's
run is in test_trace.py).
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import optuna
import pytest
import yaml
from sweep_driver import kill_after_trials

pytestmark = pytest.mark.slow

SPACE = """
params:
  micro_batch_size_experience: {type: categorical, choices: [2, 16]}
  gradient_checkpointing: {type: bool}
fixed: {rollout_batch_size: 4, rollout_n: 4, global_batch_size: 2, max_prompt_length: 64,
        max_response_length: 128, micro_batch_size_update: 1}
"""


def run_command(tmp_path, space_text=SPACE, *extra):
    space = tmp_path / "space.yaml"
    space.write_text(space_text)
    return [sys.executable, "-m", "autotune", "run", "--finalists", "0", "--model", "tiny-qwen2.5",
            "--space", str(space), "--study", "e2e", "--results-dir", str(tmp_path / "results"),
            "--device", "cpu", "--threads", "2", "--gpu-memory-limit", "600MiB",
            "--warmup-steps", "0", "--timed-steps", "1", "--no-trace", *extra]


def load(tmp_path):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    db = tmp_path / "results" / "e2e" / "study.db"
    return optuna.load_study(study_name="e2e", storage=f"sqlite:///{db}")


def test_real_sweep_finds_a_feasible_best_and_records_the_ooms(tmp_path):
    out = subprocess.run(run_command(tmp_path), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    study_dir = tmp_path / "results" / "e2e"
    rows = list(csv.DictReader(open(study_dir / "trials.csv")))
    probed = [r for r in rows if r["reused_from"] == "" and r["predicted"] != "True"
              and r["state"] in ("complete", "fail")]
    statuses = sorted(r["status"] for r in probed)
    assert statuses == ["gpu_oom", "ok", "ok"], out.stderr[-3000:]
    assert all(r["failed_phase"] == "experience" for r in probed if r["status"] == "gpu_oom")
    # the log-prob forward OOMed at micro-batch 16; checkpointing does not move that phase,
    # so the other micro-batch-16 config is predicted from it, never run: as a trial when the
    # sampler asks for it, or by the stop when it is all that is left
    oom = next(r for r in probed if r["status"] == "gpu_oom")
    predicted = [r for r in rows if r["predicted"] == "True" and r["reused_from"] == ""]
    if predicted:
        assert len(predicted) == 1 and predicted[0]["micro_batch_size_experience"] == "16"
        assert f"trial {oom['number']} (gpu_oom in experience)" in predicted[0]["reason"]
        assert "space exhausted" in out.stderr
    else:
        assert "nothing left that could fit: the one config not yet tried" in out.stderr
    calibration = load(tmp_path).user_attrs["memory_calibration"]
    assert calibration["probes"] == 2 and calibration["device"].startswith("cpu: ")
    assert set(calibration["phases"]) == {"rollout", "experience", "update"}
    best = yaml.safe_load((study_dir / "best.yaml").read_text())
    row = rows[best["trial"]]
    assert float(row["tokens_per_s"]) == best["measured"]["tokens_per_s"]
    assert int(row["peak_mem_bytes"]) == best["measured"]["peak_mem_bytes"]
    for phase, peak in best["measured"]["phase_peak_mem_bytes"].items():
        assert peak <= best["measured"]["budget_bytes"] == int(0.9 * 600 * 2**20)
        assert int(row[f"peak_mem_{phase}_bytes"]) == peak
    assert best["config"]["micro_batch_size_experience"] == 2
    # the two configs that ran differ only in the update's checkpointing: the best's rollout
    # and experience are pooled over both probes (over the quiet one, where the other was
    # timed while other processes took cores), its update is its own
    ran = [t.user_attrs["result"] for t in load(tmp_path).trials
           if (t.user_attrs.get("result") or {}).get("status") == "ok"]
    own = next(r for r in ran if r["step_s"] == best["measured"]["step_s"])
    shared = [r for r in ran if not r["contention"]] or ran
    used = 1 + any(r is not own for r in shared)
    assert len(ran) == 2 and best["pooled"]["own_probes"] == 1
    assert best["pooled"]["probes"] == used
    assert best["pooled"]["step_s"] == pytest.approx(own["phase_s"]["update"] + sum(
        sum(r["phase_s"][phase] for r in shared) / len(shared)
        for phase in ("rollout", "experience")), abs=1e-3)
    assert ("# pooled over the 2 probes that ran its phases" in
            (study_dir / "best.yaml").read_text()) == (used == 2)
    assert best["provenance"]["model"] == "tiny-qwen2.5"
    assert set(best["provenance"]["versions"]) >= {"autotune", "torch", "transformers"}
    for r in probed:  # every probe keeps its log; a failed one says why
        log = (study_dir / r["log"]).read_text()
        assert r["status"] == "ok" or "device memory limit exceeded" in log
    show = subprocess.run([sys.executable, "-m", "autotune", "show", "--results-dir",
                           str(tmp_path / "results")], capture_output=True, text=True)
    assert show.returncode == 0 and f"best: trial {best['trial']}" in show.stdout
    assert ("  pooled over the 2 probes that ran its phases: " in show.stdout) == (used == 2)
    assert show.stdout.count("gpu_oom") == 1 + len(predicted)


def test_sigkill_mid_sweep_then_resume_loses_nothing_and_runs_nothing_twice(tmp_path):
    command = run_command(tmp_path)  # 4 configs: 2 finished, the third cut off mid-probe
    trials_csv = tmp_path / "results" / "e2e" / "trials.csv"
    alive = kill_after_trials(command, trials_csv, 2, settle_s=2)  # 2 s: into the next probe
    assert not alive, "a probe outlived its killed driver"

    before = {t.number: (t.state, t.params, t.values, t.user_attrs.get("status"))
              for t in load(tmp_path).trials if t.state.is_finished()}
    resumed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "space exhausted: all 4 valid configs tried" in resumed.stderr or \
        "nothing left that could fit" in resumed.stderr, resumed.stderr[-2000:]
    study = load(tmp_path)
    for number, kept in before.items():  # every trial finished before the kill is kept as is
        trial = study.trials[number]
        assert (trial.state, trial.params, trial.values, trial.user_attrs.get("status")) == kept
    probed = [json.dumps(t.params, sort_keys=True) for t in study.trials
              if t.user_attrs.get("probed")]
    predicted = [json.dumps(t.params, sort_keys=True) for t in study.trials
                 if t.user_attrs.get("predicted") and t.user_attrs.get("reused_from") is None]
    assert len(probed) == len(set(probed))  # none probed twice
    # every config settled at most once: probed, or predicted from a measured OOM (once one
    # micro-batch-16 config has OOMed in the log-prob phase, the other is predicted, as a
    # trial or, when it is all that is left, by the stop itself)
    assert not set(probed) & set(predicted) and len(predicted) <= 1
    unsettled = [c for c in ({"micro_batch_size_experience": mbe, "gradient_checkpointing": gc}
                             for mbe in (2, 16) for gc in (False, True))
                 if json.dumps(c, sort_keys=True) not in set(probed) | set(predicted)]
    assert all(c["micro_batch_size_experience"] == 16 for c in unsettled) and len(unsettled) <= 1
    assert any(t.user_attrs.get("status") == "gpu_oom" and t.user_attrs.get("probed")
               for t in study.trials)
    assert not [t for t in study.trials if t.state.name in ("RUNNING", "WAITING")]


VERL_BASE = """\
# my verl launch config (comments and other keys must survive the export)
data:
  train_batch_size: 4  # prompts per step
  max_prompt_length: 64
  max_response_length: 128
actor_rollout_ref:
  actor:
    ppo_mini_batch_size: 2
    ppo_micro_batch_size_per_gpu: 1
    use_dynamic_bsz: false
    fsdp_config:
      param_offload: false
      optimizer_offload: false
  model:
    path: Qwen/Qwen2.5-7B-Instruct
    enable_gradient_checkpointing: false
  rollout:
    name: vllm
    n: 4
    log_prob_micro_batch_size_per_gpu: 16  # too big, as it turns out
    tensor_model_parallel_size: 1
trainer:
  nnodes: 1
  n_gpus_per_node: 1
"""


def test_run_with_a_trainer_starts_from_its_config_and_writes_its_yaml(tmp_path):
    base = tmp_path / "verl.yaml"
    base.write_text(VERL_BASE)
    space = SPACE.replace("max_response_length: 128, micro_batch_size_update: 1",
                          "max_response_length: 128")
    # two trials: the safe config (it fits: the best, exported), then the user's (it does not)
    out = subprocess.run(run_command(tmp_path, space, "--trainer", "verl", "--base-config",
                                     str(base), "--trials", "2"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    study = load(tmp_path)
    start = next(t for t in study.trials if t.user_attrs.get("origin") == "base")
    assert start.params == {"micro_batch_size_experience": 16, "gradient_checkpointing": False}
    assert start.user_attrs["status"] == "gpu_oom"  # the user's config does not fit: measured
    assert "the starting config (trial 1" in out.stdout and "gpu_oom" in out.stdout
    exported = (tmp_path / "results" / "e2e" / "best.verl.yaml").read_text()
    assert exported.startswith("# exported by autotune") and "study e2e, trial" in exported
    body = exported.split("#\n", 1)[1]
    assert body.splitlines()[0] == "# my verl launch config (comments and other keys must " \
        "survive the export)"
    tree = yaml.safe_load(body)
    assert tree["actor_rollout_ref"]["rollout"]["log_prob_micro_batch_size_per_gpu"] == 2
    assert tree["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen2.5-7B-Instruct"
    assert "# too big, as it turns out" in body
