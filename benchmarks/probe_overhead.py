"""The fixed cost of a probe (process start, imports, model build) and its timed part.

Runs real probes of the tiny models through the local runner, several times each: started
(`python -m autotune.probe.worker`) and forked from a fork server (runners/forking.py: how
CPU probes run), alternating, the server made ready before the first forked probe. Prints
the medians with their range, the forked/started ratio of each alternating pair's wall time,
and the largest difference of a phase's device peak between the two; on a GPU it also times
building qwen2.5-7b with random weights on the device. Writes the table to
benchmarks/results/probe_overhead.txt (and JSON beside it).

    python benchmarks/probe_overhead.py [--repeats 5]

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
from autotune.probe.measure.result import ProbeRequest, ProbeResult
from autotune.runners.local import SubprocessRunner

OUT_DIR = Path(__file__).parent / "results"
CONFIG = ProbeConfig(rollout_batch_size=4, rollout_n=4, global_batch_size=2,
                     micro_batch_size_update=4, micro_batch_size_experience=8,
                     max_prompt_length=128, max_response_length=64, image_size_px=112)


def check(model: str, result: ProbeResult) -> ProbeResult:
    if not result.ok:
        raise SystemExit(f"{model}: {result.status.value}: {result.message}")
    return result


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
            "from autotune.probe.modeling.models import load_model_config, build_model; "
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
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    figures: dict[str, object] = {
        "python_start_s": time_command("pass", args.repeats),
        "import_torch_s": time_command("import torch", args.repeats),
        "import_torch_transformers_s": time_command(
            "import torch; from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl",
            args.repeats),
    }
    runners = {"started": SubprocessRunner(fork=False), "forked": SubprocessRunner()}
    rows = []
    for model in ("tiny-qwen2.5", "tiny-qwen2.5-vl"):
        request = ProbeRequest(model=model, config=CONFIG, device=Device("cpu"))
        check(model, runners["forked"].run(request))  # its fork server made ready
        results: dict[str, list[ProbeResult]] = {"started": [], "forked": []}
        for _ in range(args.repeats):
            for how, runner in runners.items():
                results[how].append(check(model, runner.run(request)))
        ratios = [f.probe_wall_s / s.probe_wall_s
                  for s, f in zip(results["started"], results["forked"], strict=True)]
        peak_gap = max(abs(f.phase_peak_mem_bytes[phase] - s.phase_peak_mem_bytes[phase])
                       for s, f in zip(results["started"], results["forked"], strict=True)
                       for phase in s.phase_peak_mem_bytes)
        for how, done in results.items():
            median = {key: statistics.median(getattr(r, key) for r in done)
                      for key in ("startup_s", "build_s", "fixed_cost_s", "step_s",
                                  "probe_wall_s")}
            walls = [r.probe_wall_s for r in done]
            rows.append({"model": model, "how": how, **median,
                         "timed_s": median["step_s"] * request.timed_steps,
                         "wall_min_s": min(walls), "wall_max_s": max(walls),
                         "device": done[0].device_name})
        rows[-1].update(forked_over_started_wall=sorted(ratios),
                        max_phase_peak_gap_bytes=peak_gap)
    figures["probes"] = rows
    figures["gpu_build_qwen2.5-7b_s"] = gpu_build_seconds()

    lines = [f"probe overhead, median of {args.repeats} (seconds), started and forked "
             "alternating",
             f"python start {figures['python_start_s']:.2f}   import torch "
             f"{figures['import_torch_s']:.2f}   import torch + transformers Qwen modeling "
             f"{figures['import_torch_transformers_s']:.2f}",
             f"{'model':<17}{'probe':<9}{'startup':>8}{'build':>7}{'fixed':>7}{'step':>7}"
             f"{'timed':>7}{'wall':>7}{'range':>13}  device"]
    for row in rows:
        lines.append(f"{row['model']:<17}{row['how']:<9}{row['startup_s']:>8.2f}"
                     f"{row['build_s']:>7.2f}{row['fixed_cost_s']:>7.2f}{row['step_s']:>7.2f}"
                     f"{row['timed_s']:>7.2f}{row['probe_wall_s']:>7.2f}"
                     f"{row['wall_min_s']:>6.2f}-{row['wall_max_s']:<6.2f}  {row['device']}")
    for row in rows[1::2]:
        ratios = row["forked_over_started_wall"]
        lines.append(f"{row['model']}: forked/started wall, each alternating pair: "
                     + " ".join(f"{r:.2f}" for r in ratios)
                     + f" (median {statistics.median(ratios):.2f}); largest phase-peak gap "
                     f"{row['max_phase_peak_gap_bytes'] / 2**20:.1f} MiB")
    gpu = figures["gpu_build_qwen2.5-7b_s"]
    lines.append("qwen2.5-7b random-weight build on GPU: "
                 + (f"{gpu:.2f} s" if gpu is not None else "not measured (no GPU)"))
    lines.append("fixed = startup (process start, torch + transformers imports; forked: the "
                 "fork) + build (the model's modeling import, started only; actor, ref, engine, "
                 "optimizer); timed = the 3 timed steps (after 1 untimed); wall: the runner's, "
                 "start to reaped")
    text = "\n".join(lines)
    print(text)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "probe_overhead.txt").write_text(text + "\n")
    (OUT_DIR / "probe_overhead.json").write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
