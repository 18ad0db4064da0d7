"""One-step short probes, as a sweep's later probes run (timed_steps 1 with the study's
measured step spread, ProbeRequest.step_cv_prior; sweep/tally.py), against full probes of the
same config, 3 of each alternating: the predicted step against full steps' mean, the phase
peaks, the probe's wall.

    python benchmarks/one_step_probe.py
    python benchmarks/one_step_probe.py --grid [--repeats 2]

Writes benchmarks/results/one_step_probe.{txt,json}. `--grid` runs instead the rows of
short_probe.py's grid with several waves or micro-batches (issue 64's rows whose full/short
wall it asks to be at least 4), a one-step probe and a full one alternating, `--repeats` of
each, into one_step_probe_grid.{txt,json}: the sweep's later probes' wall against a full
probe's, beside short_probe.py's two-step short probes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
from pathlib import Path

from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.local import SubprocessRunner
from autotune.sweep.space.search_space import load_search_space

STUDY_CV = 0.012  # the demo study's measured step spread (README command 1's sweeps)
OFFLOAD = {"offload_params": True, "offload_optimizer": True}
CASES = {
    "demo mbu8 mbe8 gc off": {"micro_batch_size_update": 8, "micro_batch_size_experience": 8,
                              "gradient_checkpointing": True, **OFFLOAD},
    "demo mbu2 mbe4 no-gc": {"micro_batch_size_update": 2, "micro_batch_size_experience": 4,
                             "gradient_checkpointing": False, **OFFLOAD},
}


def probe(runner: SubprocessRunner, config, mode: str) -> dict:
    short = mode == "short"
    result = runner.run(ProbeRequest(
        model="tiny-qwen2.5", config=config, device=Device("cpu"), cpu_threads=2,
        timed_steps=1 if short else 3, timed_min_s=2.0, full_steps=not short,
        step_cv_prior=STUDY_CV if short else None))
    assert result.ok, result.message
    return {"step_s": result.step_s, "steps": len(result.step_times_s), "se": result.step_se_s,
            "peaks": result.phase_peak_mem_bytes, "wall": result.probe_wall_s,
            "contention": result.contention}


def main() -> None:
    space = load_search_space("cpu-demo")
    runner = SubprocessRunner()
    out = {}
    for name, params in CASES.items():
        config = space.config_for(params)
        rows: dict[str, list[dict]] = {"short": [], "full": []}
        for round_ in range(3):
            for mode in ("short", "full") if round_ % 2 == 0 else ("full", "short"):
                rows[mode].append(probe(runner, config, mode))
        short_s = statistics.fmean(x["step_s"] for x in rows["short"])
        full_s = statistics.fmean(x["step_s"] for x in rows["full"])
        peak = {p: statistics.median(x["peaks"][p] for x in rows["short"])
                / statistics.median(x["peaks"][p] for x in rows["full"])
                for p in rows["full"][0]["peaks"]}
        contended = sum(bool(x["contention"]) for v in rows.values() for x in v)
        line = (f"{name}: one-step short step {short_s:.3f} s (steps "
                f"{[x['steps'] for x in rows['short']]}, each "
                f"{[round(x['step_s'], 3) for x in rows['short']]}) vs full {full_s:.3f} s "
                f"(each {[round(x['step_s'], 3) for x in rows['full']]}): ratio "
                f"{short_s / full_s:.3f}; peaks short/full "
                + ", ".join(f"{p} {v:.4f}" for p, v in peak.items())
                + f"; wall {statistics.median(x['wall'] for x in rows['short']):.1f} vs "
                f"{statistics.median(x['wall'] for x in rows['full']):.1f} s; "
                f"contended {contended}")
        print(line, flush=True)
        out[name] = {"rows": rows, "line": line}
    results = Path(__file__).parent / "results"
    header = (f"one-step short probes (step_cv_prior {STUDY_CV}, the demo study's measured "
              f"spread) against full probes, 3 each alternating, CPU ({datetime.date.today()})")
    (results / "one_step_probe.txt").write_text(
        "\n".join([header, *(v["line"] for v in out.values())]) + "\n")
    (results / "one_step_probe.json").write_text(json.dumps(out, indent=1, default=str) + "\n")


def grid(repeats: int) -> None:
    """The several-unit rows of short_probe.py's grid: one-step probes against full ones."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import short_probe

    runner = SubprocessRunner()
    rows, lines = [], []
    for name, (model, config, request, several) in short_probe.CASES.items():
        if not several:
            continue
        one = dataclasses.replace(short_probe.request_for(model, config, request, full=False),
                                  timed_steps=1, step_cv_prior=STUDY_CV)
        full = short_probe.request_for(model, config, request, full=True)
        short_probe.checked(name, runner.run(one))  # the fork server warm for this case
        done: dict[str, list] = {"one": [], "full": []}
        for round_ in range(repeats):
            for mode in ("one", "full") if round_ % 2 == 0 else ("full", "one"):
                done[mode].append(short_probe.checked(name, runner.run(
                    one if mode == "one" else full)))
        walls = {mode: [r.probe_wall_s or 0.0 for r in results]
                 for mode, results in done.items()}
        predicted = statistics.fmean(r.step_s or 0.0 for r in done["one"])
        measured = statistics.fmean(s for r in done["full"] for s in r.step_times_s)
        speed = statistics.median(walls["full"]) / statistics.median(walls["one"])
        row = {"case": name, "one_wall_s": walls["one"], "full_wall_s": walls["full"],
               "speed": speed, "step_ratio": predicted / measured,
               "one_steps": [len(r.step_times_s) for r in done["one"]],
               "peak_ratio": short_probe.farthest_ratio(done["one"], done["full"])[1],
               "contended": sum(bool(r.contention) for v in done.values() for r in v)}
        rows.append(row)
        lines.append(f"{name:<32} one-step {statistics.median(walls['one']):5.1f} s "
                     f"{[round(w, 1) for w in walls['one']]}  full "
                     f"{statistics.median(walls['full']):5.1f} s "
                     f"{[round(w, 1) for w in walls['full']]}  full/one {speed:5.2f}  "
                     f"step {row['step_ratio']:.3f}  peak {row['peak_ratio']:.4f}  "
                     f"timed steps {row['one_steps']}  contended {row['contended']}")
        print(lines[-1], flush=True)
    speeds = [row["speed"] for row in rows]
    summary = (f"wall full/one-step: median {statistics.median(speeds):.2f} (range "
               f"{min(speeds):.2f}-{max(speeds):.2f}, n={len(speeds)} rows; target >= 4 on "
               "these rows); short_probe.py's two-step short probes on the same rows: "
               "results/short_probe.txt")
    header = (f"one-step probes (timed_steps 1, step_cv_prior {STUDY_CV}: a sweep's probes "
              f"after its first three) against full probes on short_probe.py's rows with "
              f"several units, {repeats} of each alternating, CPU ({datetime.date.today()})")
    text = "\n".join([header, *lines, summary])
    print(summary)
    results = Path(__file__).parent / "results"
    (results / "one_step_probe_grid.txt").write_text(text + "\n")
    (results / "one_step_probe_grid.json").write_text(
        json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", action="store_true")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.grid:
        grid(args.repeats)
    else:
        main()
