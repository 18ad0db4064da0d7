"""One-step short probes, as a sweep's later probes run (timed_steps 1 with the study's
measured step spread, ProbeRequest.step_cv_prior; sweep/tally.py), against full probes of the
same config, 3 of each alternating: the predicted step against full steps' mean, the phase
peaks, the probe's wall.

    python benchmarks/one_step_probe.py

Writes benchmarks/results/one_step_probe.{txt,json}.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    main()
