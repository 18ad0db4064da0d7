"""How close the memory model comes to measured peaks, per phase, before and after calibration.

The grids are real probes with no memory cap, so every phase's peak is measured
(benchmarks/landscape.py records them; `--record` re-runs whatever rows are missing):

    tiny-qwen2.5     benchmarks/spaces/memory-grid.yaml     64 configs (lengths vary too)
    tiny-qwen2.5-vl  benchmarks/spaces/memory-grid-vl.yaml  32 configs (one image per prompt)

These grids generate with HF generation's memory (rollout_engine=hf). The vllm-like engine's
grid is run live each time (engine_grid below: its reservation depends on the cap).

Before calibration, memory.py's prior constants are used. After calibration, the model is fitted
(calibration.py) on k probes drawn at random and scored on the others (out of sample), 200 draws;
k = feasibility.MIN_CALIBRATION_PROBES, the point from which the sweep's pre-screen trusts it.
The pre-screen skips a config when its calibrated peak exceeds capacity x (1 + margin); a
feasible config (measured peak <= capacity) can only be skipped if the estimate overstates its
peak by more than the margin, so the largest out-of-sample overstatement is what the margin
must cover. On the demo grid (545 MiB cap, 44 OOM configs) the benchmark also counts feasible
configs the pre-screen would skip, and OOM configs it would catch.

    python benchmarks/memory_accuracy.py [--record] [--draws 200]

Targets: median absolute error <= 15% before and <= 5% after calibration; no feasible config
predicted infeasible. Writes benchmarks/results/memory_accuracy.{txt,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from landscape import record  # noqa: E402

from autotune.hardware import Device
from autotune.memory.calibration import fit_calibration  # noqa: E402
from autotune.memory.model import estimate_memory  # noqa: E402
from autotune.memory.shape import model_shape  # noqa: E402
from autotune.probe.measure.result import ProbeRequest  # noqa: E402
from autotune.sweep.feasibility.prescreen import MIN_CALIBRATION_PROBES, PRESCREEN_MARGIN  # noqa: E402
from autotune.sweep.space.search_space import load_search_space  # noqa: E402

HERE = Path(__file__).parent
GRIDS = [("tiny-qwen2.5", HERE / "spaces" / "memory-grid.yaml",
          HERE / "data" / "memory_grid_tiny.csv"),
         ("tiny-qwen2.5-vl", HERE / "spaces" / "memory-grid-vl.yaml",
          HERE / "data" / "memory_grid_tiny_vl.csv")]
DEMO = ("tiny-qwen2.5", "cpu-demo", HERE / "data" / "cpu_demo_grid.csv")
OUT = HERE / "results"
PHASES = ("rollout", "experience", "update")


def load_points(model: str, space_path, csv_path: Path) -> list[dict]:
    """One point per recorded config: its estimate, measured phase peaks and status."""
    space, shape = load_search_space(str(space_path)), model_shape(model)
    points = []
    with open(csv_path, newline="") as handle:
        for row in csv.DictReader(handle):
            params = {name: spec.values()[[str(v) for v in spec.values()].index(row[name])]
                      for name, spec in space.params.items()}
            measured = {p: int(row[f"peak_mem_{p}_bytes"]) for p in PHASES
                        if row["status"] == "ok"}
            points.append({"params": params, "status": row["status"], "measured": measured,
                           "estimate": estimate_memory(shape, space.config_for(params),
                                                       on_gpu=False),
                           "limit_bytes": int(row["device_limit_bytes"] or 0) or None})
    return points


def errors(points: list[dict], calibration=None) -> dict[str, list[float]]:
    """Relative error (estimate - measured) / measured per phase, and of each config's peak."""
    out = {p: [] for p in (*PHASES, "peak")}
    for point in points:
        if not point["measured"]:
            continue
        est = calibration.phase_bytes(point["estimate"]) if calibration else \
            {p: e.total_bytes for p, e in point["estimate"].phases.items()}
        for phase, measured in point["measured"].items():
            out[phase].append((est[phase] - measured) / measured)
        measured_peak = max(point["measured"].values())
        out["peak"].append((max(est[p] for p in PHASES) - measured_peak) / measured_peak)
    return out


def out_of_sample(points: list[dict], k: int, draws: int) -> dict[str, list[float]]:
    ok = [p for p in points if p["measured"]]
    pooled = {p: [] for p in (*PHASES, "peak")}
    for seed in range(draws):
        train = random.Random(seed).sample(range(len(ok)), k)
        calibration = fit_calibration([(ok[i]["estimate"], ok[i]["measured"]) for i in train])
        test = [p for i, p in enumerate(ok) if i not in train]
        for phase, values in errors(test, calibration).items():
            pooled[phase].extend(values)
    return pooled


def summary(errs: dict[str, list[float]]) -> dict[str, float]:
    phases = [abs(e) for p in PHASES for e in errs[p]]
    peak = sorted(errs["peak"])
    return {"median_abs": statistics.median(phases),
            **{f"median_abs_{p}": statistics.median(abs(e) for e in errs[p]) for p in PHASES},
            "p99_over": peak[int(0.99 * (len(peak) - 1))], "max_over": peak[-1],
            "max_under": -peak[0]}


def demo_prescreen(points: list[dict], k: int, draws: int, margin: float) -> dict[str, float]:
    """On the capped demo grid: feasible configs skipped and OOM configs caught, per draw."""
    ok = [p for p in points if p["measured"]]
    skipped_feasible, caught = [], []
    for seed in range(draws):
        train = random.Random(seed).sample(range(len(ok)), k)
        calibration = fit_calibration([(ok[i]["estimate"], ok[i]["measured"]) for i in train])
        skips = [calibration.peak_bytes(p["estimate"]) > p["limit_bytes"] * (1 + margin)
                 for p in points]
        skipped_feasible.append(sum(s for s, p in zip(skips, points, strict=True)
                                    if p["status"] == "ok"))
        caught.append(sum(s for s, p in zip(skips, points, strict=True)
                          if p["status"] == "gpu_oom"))
    return {"feasible_skipped_total": sum(skipped_feasible),
            "oom_caught_median": statistics.median(caught),
            "oom_configs": sum(p["status"] == "gpu_oom" for p in points)}


ENGINE_CAP_BYTES = 1 << 30
ENGINE_SHAPES = {"tiny-qwen2.5": {"max_prompt_length": 64},
                 "tiny-qwen2.5-vl": {"max_prompt_length": 200, "image_size_px": 112}}


def engine_grid() -> list[dict]:
    """The vllm-like engine, live: 2 models x gpu_memory_utilization 0.3/0.4/0.5 x sleep on
    and off, real CPU probes under a 1 GiB device cap. Each row: the measured peak per phase
    against the memory model (prior constants, no calibration), and the rollout peak against
    the trainer's states at wake-up plus the reservation, as the engine reported them."""
    from autotune.config import ProbeConfig
    from autotune.runners.local import SubprocessRunner

    rows, runner = [], SubprocessRunner()
    for model, shapes in ENGINE_SHAPES.items():
        for util in (0.3, 0.4, 0.5):
            for sleep in (True, False):
                config = ProbeConfig(
                    rollout_engine="vllm-like", gpu_memory_utilization=util,
                    enable_sleep=sleep, rollout_batch_size=4, rollout_n=4,
                    global_batch_size=2, micro_batch_size_update=4,
                    micro_batch_size_experience=8, max_response_length=32, max_num_seqs=8,
                    max_num_batched_tokens=512, **shapes)
                result = runner.run(ProbeRequest(
                    model=model, config=config, device=Device("cpu", None, ENGINE_CAP_BYTES),
                    cpu_threads=2, warmup_steps=1, timed_steps=1, timeout_s=300))
                row = {"model": model, "util": util, "sleep": sleep,
                       "status": result.status.value}
                if result.ok:
                    estimate = estimate_memory(model_shape(model), config, on_gpu=False,
                                               engine_capacity_bytes=ENGINE_CAP_BYTES)
                    engine = result.engine
                    row.update(
                        measured={p: result.phase_peak_mem_bytes[p] for p in PHASES},
                        estimate={p: estimate.phases[p].total_bytes for p in PHASES},
                        states_plus_reservation=engine["wake_used_bytes"]
                        + engine["reserved_bytes"], concurrency=engine["concurrency"],
                        kv_pool_bytes=engine["kv_pool_bytes"])
                rows.append(row)
                print(f"engine grid: {model} util={util} sleep={sleep}: {row['status']}",
                      file=sys.stderr)
    return rows


def engine_lines(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok"]
    lines = ["", f"vllm-like engine grid: {len(ok)} of {len(rows)} probes ok, 1 GiB device "
                 "cap, peaks in MiB; error = (estimate - measured) / measured",
             f"{'model':<17}{'util':>5}{'sleep':>6}{'rollout':>9}{'st+res':>8}{'err':>7}"
             f"{'model':>8}{'err':>7}{'exper.':>8}{'model':>8}{'err':>7}{'update':>8}"
             f"{'model':>8}{'err':>7}"]
    for r in ok:
        m, e = r["measured"], r["estimate"]

        def err(a: int, b: int) -> str:
            return f"{(a - b) / b:>7.1%}"

        lines.append(f"{r['model']:<17}{r['util']:>5}{'on' if r['sleep'] else 'off':>6}"
                     f"{m['rollout'] >> 20:>9}{r['states_plus_reservation'] >> 20:>8}"
                     f"{err(r['states_plus_reservation'], m['rollout'])}"
                     f"{e['rollout'] >> 20:>8}{err(e['rollout'], m['rollout'])}"
                     f"{m['experience'] >> 20:>8}{e['experience'] >> 20:>8}"
                     f"{err(e['experience'], m['experience'])}{m['update'] >> 20:>8}"
                     f"{e['update'] >> 20:>8}{err(e['update'], m['update'])}")
    if ok:
        within = [abs(r["states_plus_reservation"] - r["measured"]["rollout"])
                  / r["measured"]["rollout"] for r in ok]
        model = [abs(r["estimate"][p] - r["measured"][p]) / r["measured"][p]
                 for r in ok for p in PHASES]
        lines.append("rollout peak vs states + reservation: median "
                     f"{statistics.median(within):.1%}, max {max(within):.1%} (target <= 5%); "
                     "memory model, all phases: "
                     f"median {statistics.median(model):.1%}, max {max(model):.1%}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true",
                        help="probe the grid rows not yet recorded (about 15 min on 2 cores)")
    parser.add_argument("--draws", type=int, default=200)
    parser.add_argument("--no-engine-grid", action="store_true",
                        help="skip the live vllm-like engine grid (12 probes, ~2 min)")
    parser.add_argument("--k", type=int, default=MIN_CALIBRATION_PROBES,
                        help="probes each calibration is fitted on")
    args = parser.parse_args()
    if args.record:
        for model, space_path, csv_path in GRIDS:
            request = ProbeRequest(model=model, device=Device("cpu"), cpu_threads=1,
                                   warmup_steps=1, timed_steps=1, timeout_s=300)
            record(load_search_space(str(space_path)), csv_path, request, parallel=2)
    lines = [f"memory model vs measured peak per phase: real CPU probes, no memory cap; "
             f"calibrated on {args.k} random probes, scored on the rest, {args.draws} draws",
             "", f"{'grid':<18}{'configs':>8}{'prior':>8}{'calibrated':>12}"
             f"{'rollout':>9}{'exper.':>8}{'update':>8}{'p99 over':>10}{'max over':>10}"]
    report = {"k": args.k, "draws": args.draws, "margin": PRESCREEN_MARGIN, "grids": {}}
    worst_over = 0.0
    for model, space_path, csv_path in [*GRIDS, DEMO]:
        points = load_points(model, space_path, csv_path)
        before = summary(errors(points))
        after = summary(out_of_sample(points, args.k, args.draws))
        worst_over = max(worst_over, after["max_over"])
        name = f"{model}{' (demo)' if csv_path == DEMO[2] else ''}"
        report["grids"][name] = {"before": before, "after": after,
                                 "configs": sum(bool(p["measured"]) for p in points)}
        lines.append(f"{name:<18}{report['grids'][name]['configs']:>8}"
                     f"{before['median_abs']:>8.1%}{after['median_abs']:>12.1%}"
                     f"{after['median_abs_rollout']:>9.1%}{after['median_abs_experience']:>8.1%}"
                     f"{after['median_abs_update']:>8.1%}{after['p99_over']:>10.1%}"
                     f"{after['max_over']:>10.1%}")
    grids = report["grids"].values()
    before_ok = all(g["before"]["median_abs"] <= 0.15 for g in grids)
    after_ok = all(g["after"]["median_abs"] <= 0.05 for g in grids)
    demo = demo_prescreen(load_points(*DEMO), args.k, args.draws, PRESCREEN_MARGIN)
    report["demo_prescreen"] = demo
    lines += ["", "columns: median absolute error over all phases, before (prior) and after "
                  "calibration; per phase after; the largest overstatements of a config's peak",
              f"median abs error <= 15% before: {'met' if before_ok else 'MISSED'}; "
              f"<= 5% after: {'met' if after_ok else 'MISSED'}",
              f"pre-screen margin {PRESCREEN_MARGIN:.0%} vs the largest out-of-sample "
              f"overstatement {worst_over:.1%}: "
              + ("no feasible config of these grids is skipped" if worst_over < PRESCREEN_MARGIN
                 else "feasible configs COULD be skipped"),
              f"demo grid (545 MiB cap), {args.draws} calibrations: feasible configs predicted "
              f"infeasible {demo['feasible_skipped_total']} (target 0); OOM configs caught by "
              f"the estimate alone, median {demo['oom_caught_median']:.0f} of "
              f"{demo['oom_configs']}"]
    if not args.no_engine_grid:
        report["engine_grid"] = engine_grid()
        lines += engine_lines(report["engine_grid"])
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "memory_accuracy.txt").write_text(text + "\n")
    (OUT / "memory_accuracy.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
