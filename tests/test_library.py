"""autotune as a library: a notebook plans and runs a sweep, estimates a run and exports the
best through `import autotune` alone, without the CLI (click is never imported)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

NOTEBOOK = """
import json, sys, time
import autotune
start = time.monotonic()

options = autotune.RunOptions(
    probe=autotune.ProbeOptions(model="tiny-qwen2.5", device="cpu", warmup_steps=0,
                                timed_steps=1, gpu_memory_limit_bytes=545 << 20),
    space="cpu-demo", trials=2, finalists=0, confirm=0, trace=False, prescreen=False,
    results_dir=sys.argv[1], study="notebook")
plan = autotune.plan_sweep(options)
outcome = autotune.run_sweep(plan)
print(f"sweep {time.monotonic() - start:.0f} s", file=sys.stderr)
answer = autotune.estimate(autotune.ProbeOptions(model="qwen2.5-7b", gpus_per_node=8))
# the CPU demo's device is no GPU a trainer runs on: force writes it, its header says so
exported = autotune.export_study("verl", "notebook", results_dir=sys.argv[1], force=True)
try:
    autotune.estimate(autotune.ProbeOptions())
except autotune.ConfigError as err:
    refused = str(err)
print(json.dumps({
    "exit_code": outcome.exit_code, "best_path": str(outcome.best_path),
    "trials": len(outcome.study.trials),
    "estimate": answer.as_dict(), "estimate_text": answer.text(),
    "export": exported.text, "refused": refused,
    "modules": sorted(m for m in sys.modules if m.split(".")[0] in ("click", "torch")),
}))
"""


def test_the_library_face_lists_what_a_notebook_needs():
    import autotune

    for name in ("plan_sweep", "run_sweep", "RunOptions", "ProbeOptions", "estimate",
                 "Estimate", "export_study", "SweepOutcome", "ProbeResult", "ProbeStatus",
                 "ConfigError", "AutotuneError"):
        assert name in autotune.__all__
        assert getattr(autotune, name) is not None
    assert callable(autotune.estimate) and callable(autotune.export_study)


def test_a_sweep_an_estimate_and_an_export_through_the_library_alone(tmp_path):
    """A real two-trial CPU sweep of the tiny model, the memory model's answer for a 7B run on
    8 GPUs, and the sweep's best as verl YAML, each through one call of the face; the CLI's
    click is never imported (torch only in the probes' own processes)."""
    done = subprocess.run([sys.executable, "-c", NOTEBOOK, str(tmp_path)], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["modules"] == []  # neither click nor torch in the notebook's process
    assert out["exit_code"] == 0 and out["trials"] >= 2
    assert Path(out["best_path"]).is_file()
    assert out["estimate"]["world_size"] == 8 and out["estimate"]["model"] == "qwen2.5-7b"
    assert set(out["estimate"]["phase_bytes"]) >= {"rollout", "experience", "update"}
    assert "binding phase" in out["estimate_text"]
    written = yaml.safe_load(out["export"])  # the sweep's best micro-batch, in verl's key
    best = yaml.safe_load(Path(out["best_path"]).read_text())
    assert written["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] == \
        best["config"]["micro_batch_size_update"]
    assert "give --model NAME" in out["refused"]
