"""Tuned against the trainer's own default, with the real trainer, side by side (issue 35).

TRL's GRPOTrainer on the CPU, set up as a TRL user sets it up (tests/trl_fixture.py: the
registry's tiny-qwen2.5 numbers with random weights and a 16,384-token vocabulary, a tokenizer
built here, a length reward, `python train_grpo.py --config grpo.yaml`). The run the user
fixes: 8 generations of 64 tokens per prompt, 32 completions per optimizer step, no reference
model (beta 0, TRL's default). The default is GRPOConfig's own for what autotune tunes:
per_device_train_batch_size 8 (with gradient accumulation 4 for the 32 completions) and
gradient_checkpointing on.

1. `autotune run --trainer trl --launch "python train_grpo.py --config {config}"
   --base-config default.yaml` under a device cap (the run's RSS on a CPU), the space below,
   once for each objective (throughput_per_memory, the default, and throughput): every probe
   is a short run of TRL itself; each run exports its best.trl.yaml. And once with the
   built-in probe (`--model-path`, no launch line: the probe's own GRPO step at the base
   config's shapes), whose export TRL runs like the others.
2. The default and the exported configs each train STEPS steps, round robin, REPEATS times:
   tokens/s is TRL's own (num_tokens over train_runtime in its log), peak memory the run's
   process tree RSS, sampled every 20 ms.

    python benchmarks/vs_default.py [--repeats 5] [--steps 6] [--trials 8] [--out DIR]

Each ratio to the default is the ratio of the means over the repeats, with its 95% bootstrap
interval and the two-sided permutation p-value of the difference (benchmarks/spread.py): the
claim is the interval, never the best recording. Writes vs_default.{txt,json} to
benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from trl_fixture import make_trl_workspace, parse_log_dicts  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from spread import permutation_p, ratio_interval  # noqa: E402

CAP = "1GiB"
SPACE = {"params": {
    "micro_batch_size_update": {"type": "categorical", "choices": [2, 4, 8, 16, 32]},
    "gradient_checkpointing": {"type": "bool"}}}
RUN = {"num_generations": 8, "max_completion_length": 64, "beta": 0.0,
       "per_device_train_batch_size": 8, "gradient_accumulation_steps": 4,
       "gradient_checkpointing": True}  # GRPOConfig's defaults for what is tuned


def tree_rss_bytes(root: psutil.Process) -> int:
    total = 0
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:  # the run has ended
        return 0
    for proc in tree:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            pass
    return total


def train(workspace, config: Path, env: dict[str, str]) -> dict:
    """One training run of `config`: TRL's tokens/s and the tree's peak RSS."""
    proc = subprocess.Popen(workspace.command(config), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    root = psutil.Process(proc.pid)  # before it can exit: a zombie until communicate()
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss_bytes(root))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    out, err = proc.communicate(timeout=1800)
    done.set()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"{config.name} failed:\n{err[-3000:]}")
    logs = parse_log_dicts(out)
    tokens = max(float(log["num_tokens"]) for log in logs if "num_tokens" in log)
    runtime = next(float(log["train_runtime"]) for log in logs if "train_runtime" in log)
    return {"tokens_per_s": tokens / runtime, "peak_rss_bytes": peak[0],
            "train_runtime_s": runtime}


OBJECTIVES = ("throughput_per_memory", "throughput")  # the run's default first
BUILT_IN = "built-in"  # the built-in probe's sweep, its export run by TRL like the others
SWEEPS = (*OBJECTIVES, BUILT_IN)


def sweep(workspace, default: Path, root: Path, name: str, trials: int,
          env: dict[str, str]) -> dict:
    """`autotune run --trainer trl` for the row `name`: an objective with the TRL launch line
    (each probe a short run of TRL), or `built-in` (the built-in probe of the base config's
    shapes, the default objective); its exported config and what the sweep cost."""
    space = root / "space.yaml"
    space.write_text(yaml.safe_dump(SPACE))
    if name == BUILT_IN:
        how = ["--model-path", str(workspace.model_dir)]
    else:
        how = ["--launch", f"{sys.executable} {workspace.script} --config {{config}}",
               "--objective", name]
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "autotune", "run", "--trainer", "trl", "--base-config",
         str(default), *how, "--device", "cpu", "--gpu-memory-limit", CAP,
         "--space", str(space), "--trials", str(trials),
         "--results-dir", str(root / "results"), "--study", name],
        env=env, capture_output=True, text=True, timeout=3600, cwd=root)
    if done.returncode:
        raise SystemExit(f"the {name} sweep failed:\n{done.stderr[-3000:]}")
    study = root / "results" / name
    with open(study / "trials.csv") as handle:
        probes = sum(1 for row in csv.DictReader(handle)
                     if row["status"] and not row["reused_from"] and row["predicted"] != "True")
    exported = study / "best.trl.yaml"
    keys = {k: v for k, v in yaml.safe_load(exported.read_text()).items()
            if k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                     "gradient_checkpointing")}
    return {"config": exported, "sweep_s": time.perf_counter() - started, "probes": probes,
            "best_trial": yaml.safe_load((study / "best.yaml").read_text())["trial"],
            "tuned": keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        workspace = make_trl_workspace(root, vocab_size=16384, **RUN)
        env = workspace.env()
        default = workspace.write_config("default.yaml", **RUN, max_steps=args.steps)
        sweeps = {name: sweep(workspace, default, root, name, args.trials, env)
                  for name in SWEEPS}
        configs = {"default": default, **{name: sweeps[name].pop("config") for name in SWEEPS}}
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for repeat in range(args.repeats):  # round robin, the order rotated each repeat
            names = list(configs)
            for name in names[repeat % len(names):] + names[:repeat % len(names)]:
                runs[name].append(train(workspace, configs[name], env))
                print(f"repeat {repeat + 1}/{args.repeats} {name}: "
                      f"{runs[name][-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr,
                      flush=True)
    document = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
                "machine": platform.machine(), "cap": CAP, "run": RUN, "steps": args.steps,
                "repeats": args.repeats, "trials": args.trials, "sweeps": sweeps, "runs": runs}
    text = report(document)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vs_default.json").write_text(json.dumps(document, indent=2) + "\n")
    (args.out / "vs_default.txt").write_text(text + "\n")
    print(text)


def report(doc: dict) -> str:
    def median(name: str, key: str) -> float:
        return statistics.median(run[key] for run in doc["runs"][name])

    lines = [f"tuned vs TRL's default, TRL's GRPOTrainer on the CPU ({doc['cores']} cores, "
             f"{doc['machine']}), {doc['date']}: tiny-qwen2.5 numbers, random weights, "
             f"{doc['run']['num_generations']} generations x "
             f"{doc['run']['max_completion_length']} tokens, 32 completions per step, "
             f"{doc['steps']} steps per run, {doc['repeats']} repeats round robin",
             "default (GRPOConfig's): per_device_train_batch_size 8, gradient accumulation 4, "
             "gradient checkpointing on"]
    for name, found in doc["sweeps"].items():
        how = "built-in probe" if name == BUILT_IN else "TRL launch"
        lines.append(f"{name} ({how}): trial {found['best_trial']} of a {found['probes']}-probe "
                     f"sweep under a {doc['cap']} cap ({found['sweep_s'] / 60:.1f} min): "
                     + ", ".join(f"{k} {v}" for k, v in found["tuned"].items()))
    width = max(len(name) for name in doc["runs"])
    lines += ["", f"{'':>{width}} | {'tokens/s (each run)':>36} | {'mean':>5} | "
                  f"{'tokens/s / default [95%]':>24} | {'p':>5} | {'peak / default [95%]':>20}"]
    base = [run["tokens_per_s"] for run in doc["runs"]["default"]]
    base_peak = [run["peak_rss_bytes"] for run in doc["runs"]["default"]]
    for name in doc["runs"]:
        speed = [run["tokens_per_s"] for run in doc["runs"][name]]
        peak = [run["peak_rss_bytes"] for run in doc["runs"][name]]
        ratio, low, high = ratio_interval(speed, base)
        peak_ratio, peak_low, peak_high = ratio_interval(peak, base_peak)
        p = permutation_p(speed, base) if name != "default" else 1.0
        doc.setdefault("ratios", {})[name] = {
            "tokens_per_s": [ratio, low, high], "p": p,
            "peak_rss": [peak_ratio, peak_low, peak_high]}
        each = " ".join(f"{value:>5.0f}" for value in speed)
        lines.append(f"{name:>{width}} | {each:>36} | {statistics.fmean(speed):>5.0f} | "
                     f"{ratio:>5.2f}x [{low:.2f}, {high:.2f}]{'':>6} | {p:>5.2f} | "
                     f"{peak_ratio:>4.2f}x [{peak_low:.2f}, {peak_high:.2f}]")
    lines += ["", "tokens/s / default: the ratio of the means over the repeats, its 95% "
                  "bootstrap interval; p: two-sided permutation p-value of the difference; "
                  "peak: the run's process tree RSS"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
