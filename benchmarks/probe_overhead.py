"""The fixed cost of a probe (process start, imports, model build) and its timed part.

Runs real probes of the tiny models through the local runner, several times each, and prints
the medians; on a GPU it also times building qwen2.5-7b with random weights on the device.
Writes the table to benchmarks/results/probe_overhead.txt (and JSON beside it).

    python benchmarks/probe_overhead.py [--repeats 3]

Targets: fixed cost <= 5 s on a 2-core CPU; qwen2.5-7b built on a GPU in <= 30 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.result import ProbeRequest
from autotune.runners.local import SubprocessRunner

OUT_DIR = Path(__file__).parent / "results"
CONFIG = ProbeConfig(rollout_batch_size=4, rollout_n=4, global_batch_size=2,
                     micro_batch_size_update=4, micro_batch_size_experience=8,
                     max_prompt_length=128, max_response_length=64, image_size_px=112)


def time_command(code: str, repeats: int) -> float:
    """Median wall seconds of `python -c code` in a fresh process."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def gpu_build_seconds() -> float | None:
    code = ("import time, torch; "
            "from autotune.probe.models import load_model_config, build_model; "
            "c = load_model_config('qwen2.5-7b'); t = time.perf_counter(); "
            "m = build_model(c, torch.device('cuda'), torch.float32); torch.cuda.synchronize(); "
            "print(time.perf_counter() - t)")
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except ImportError:
        return None
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    figures: dict[str, object] = {
        "python_start_s": time_command("pass", args.repeats),
        "import_torch_s": time_command("import torch", args.repeats),
        "import_torch_transformers_s": time_command(
            "import torch; from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl",
            args.repeats),
    }
    runner = SubprocessRunner()
    rows = []
    for model in ("tiny-qwen2.5", "tiny-qwen2.5-vl"):
        results = []
        for _ in range(args.repeats):
            request = ProbeRequest(model=model, config=CONFIG, device=Device("cpu"))
            result = runner.run(request)
            if not result.ok:
                raise SystemExit(f"{model}: {result.status.value}: {result.message}")
            results.append(result)
        median = {key: statistics.median(getattr(r, key) for r in results)
                  for key in ("startup_s", "build_s", "fixed_cost_s", "step_s", "probe_wall_s")}
        timed_s = median["step_s"] * 2
        rows.append({"model": model, **median, "timed_s": timed_s,
                     "device": results[0].device_name})
    figures["probes"] = rows
    figures["gpu_build_qwen2.5-7b_s"] = gpu_build_seconds()

    lines = [f"probe overhead, median of {args.repeats} (seconds)",
             f"python start {figures['python_start_s']:.2f}   import torch "
             f"{figures['import_torch_s']:.2f}   import torch + transformers Qwen modeling "
             f"{figures['import_torch_transformers_s']:.2f}",
             f"{'model':<18}{'startup':>9}{'build':>8}{'fixed':>8}{'step':>8}{'timed':>8}"
             f"{'wall':>8}  device"]
    for row in rows:
        lines.append(f"{row['model']:<18}{row['startup_s']:>9.2f}{row['build_s']:>8.2f}"
                     f"{row['fixed_cost_s']:>8.2f}{row['step_s']:>8.2f}{row['timed_s']:>8.2f}"
                     f"{row['probe_wall_s']:>8.2f}  {row['device']}")
    gpu = figures["gpu_build_qwen2.5-7b_s"]
    lines.append("qwen2.5-7b random-weight build on GPU: "
                 + (f"{gpu:.2f} s" if gpu is not None else "not measured (no GPU)"))
    lines.append("fixed = startup (process start, torch + transformers imports) + build (the "
                 "model's modeling import, actor, ref, engine, optimizer); timed = 2 steps")
    text = "\n".join(lines)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "probe_overhead.txt").write_text(text + "\n")
    (OUT_DIR / "probe_overhead.json").write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
