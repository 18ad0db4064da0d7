"""A real trainer under autotune: TRL's GRPOTrainer on the CPU, launched the way a TRL user does.

The workspace (tests/trl_fixture.py) is a tiny Qwen2 saved to disk, a tokenizer built here, a
few prompts from `datasets.Dataset.from_dict`, a plain reward, and `train_grpo.py` that
parses GRPOConfig with TrlParser. Nothing is mocked: every probe is `python train_grpo.py
--config <the trial's YAML>` as a subprocess, measured from outside; the device is the CPU,
whose "device memory" is the run's anonymous RSS, capped with --gpu-memory-limit.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from trl_fixture import make_trl_workspace

from autotune.probe.launch.trainer_logs import StepLog

pytestmark = pytest.mark.slow
AUTOTUNE = [sys.executable, "-m", "autotune"]
MEASURED = ("ok", "gpu_oom", "host_oom", "cache_oom", "crash", "timeout")
SPACE = """\
params:
  micro_batch_size_update: {type: categorical, choices: [4, 16]}
  rollout_n: {type: categorical, choices: [4, 8]}
  gradient_checkpointing: {type: bool}
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    # the registry's tiny-qwen2.5 vocab (16384): host memory grows with the batch, so a cap
    # of 900 MiB on the run's anonymous RSS separates configs (its file-backed pages,
    # ~200 MiB, are not device memory: mbu 16 holds ~1,006 MiB, mbu 8 ~813); 16
    # generations of 64 tokens per step
    return make_trl_workspace(tmp_path_factory.mktemp("trl"), vocab_size=16384,
                              gradient_accumulation_steps=4, max_completion_length=64)


def trainer_processes(script: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if str(script) in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def read_trl_log(text: str) -> None:
    """The TRL log parser on a real run's output (a 2-step run of train_grpo.py)."""
    log = StepLog("trl")
    for i, line in enumerate(text.splitlines()):
        log.feed(line, float(i))
    assert log.steps_seen == 2  # one record per logged step; the train_runtime summary is not
    first, second = (r.values for r in log.records)
    assert second["num_tokens"] > first["num_tokens"] > 0  # printed as strings, read as numbers
    measured = log.throughput()
    assert measured is not None
    tokens = second["num_tokens"] - first["num_tokens"]
    assert measured.tokens_per_s == pytest.approx(tokens / second["step_time"])


def test_a_sweep_of_the_trl_launch_is_killed_resumed_and_exports_a_grpo_config(workspace,
                                                                                tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    results = tmp_path / "results"
    launch = f"{sys.executable} {workspace.script} --config {{config}}"
    command = [*AUTOTUNE, "run", "--finalists", "0",
               "--trainer", "trl", "--base-config", str(workspace.config),
               "--launch", launch, "--device", "cpu", "--space", str(space), "--trials", "4",
               "--timed-steps", "1",
               "--gpu-memory-limit", "900MiB", "--results-dir", str(results), "--study", "trl"]
    env = workspace.env()
    driver = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, cwd=tmp_path)
    deadline = time.monotonic() + 240  # SIGKILL the driver while trial 1's trainer runs
    while not [p for p in trainer_processes(workspace.script)
               if "trial-00001" in " ".join(p.cmdline())]:
        assert driver.poll() is None, driver.stdout.read().decode()
        assert time.monotonic() < deadline, "trial 1's trainer never started"
        time.sleep(0.2)
    time.sleep(1.0)
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 15
    while trainer_processes(workspace.script):  # the run dies with the driver, at once
        assert time.monotonic() < deadline, "a trainer process outlived the killed driver"
        time.sleep(0.2)

    resumed = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path,
                             timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert not trainer_processes(workspace.script)
    study = results / "trl"
    with open(study / "trials.csv") as handle:
        rows = list(csv.DictReader(handle))
    probed = [r for r in rows if r["status"] in MEASURED and not r["reused_from"]
              and r["predicted"] != "True"]  # an OOM predicted from a measured one: no run
    assert len(probed) >= 4
    statuses = {r["status"] for r in probed}
    assert "ok" in statuses and "gpu_oom" in statuses  # the cap made at least one OOM
    finished = [json.loads((study / "logs" / f"trial-{int(r['number']):05d}.result.json")
                           .read_text()) for r in probed]
    assert all(r["probe_kind"] == "command" for r in finished)
    ok = [r for r in finished if r["status"] == "ok"]
    assert all(r["tokens_per_s"] > 0 and r["steps_logged"] == 2 for r in ok)
    assert all(r["peak_mem_bytes"] <= 900 << 20 for r in ok)
    oom = [r for r in finished if r["status"] == "gpu_oom"]
    assert all("device memory limit exceeded" in r["message"] for r in oom)
    # the log parser on a real 2-step run's output: an ok trial's log is the trainer's stdout
    # (what a separate `python train_grpo.py` of max_steps 2 printed, 10 s more, before)
    first_ok = next(r for r in probed if r["status"] == "ok")
    read_trl_log((study / "logs" / f"trial-{int(first_ok['number']):05d}.log").read_text())
    # no config was probed twice, the one killed mid-probe included
    configs = [(r["micro_batch_size_update"], r["rollout_n"], r["gradient_checkpointing"])
               for r in probed]
    assert len(configs) == len(set(configs))

    from trl import GRPOConfig

    exported = yaml.safe_load((study / "best.trl.yaml").read_text())
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert set(exported) - fields == {"model_name_or_path", "num_prompts"}  # the script's own
    grpo = GRPOConfig(**{k: v for k, v in exported.items() if k in fields})
    best = yaml.safe_load((study / "best.yaml").read_text())
    assert grpo.per_device_train_batch_size == best["config"]["micro_batch_size_update"]
    assert grpo.num_generations == best["config"]["rollout_n"]
    assert grpo.max_steps == 3  # the user's own value, not the probe's short-run settings'
    assert best["provenance"]["probe"].startswith("command:trl:")
    shown = subprocess.run([*AUTOTUNE, "show", "--results-dir", str(results), "--study", "trl"],
                           capture_output=True, text=True, timeout=120)
    assert "2-step run of your trl launch line" in shown.stdout


def test_a_launch_line_without_a_placeholder_is_one_line(workspace, tmp_path):
    proc = subprocess.run(
        [*AUTOTUNE, "run", "--finalists", "0",
         "--trainer", "trl", "--base-config", str(workspace.config),
         "--launch", f"{sys.executable} train.py", "--device", "cpu", "--trials", "1",
         "--results-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "no placeholder for the trial's config" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written
