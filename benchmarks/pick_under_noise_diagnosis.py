"""Where a noisy sweep's pick is lost: the search, the ranking, or the finalists' decision.

The short arm of benchmarks/pick_under_noise.py (the real sweep over a GPU-sized landscape,
lognormal noise on each phase of every probe, short probes charged their device seconds),
run with a fixed device budget (`--device-h`, the full arm's median in
results/pick_under_noise_rule_*.json) less the finalists' reserve, for one or more cells of
finalists K and probes per finalist at most (MAX_PROBES). For each seed it records which of
the configs within 2% of the landscape's best the search probed at all, their ranks by the
pooled figure before the finalists' repeats, and the pick; a seed whose pick misses is then
lost to the search (none probed), to the ranking (probed, none among the K finalists) or to
the finalists' decision (one among them, another picked).

    python benchmarks/pick_under_noise_diagnosis.py [--model qwen2.5-vl-7b] [--noise 0.1]
        [--cells 3:3 3:6 5:3] [--seeds 20]

Writes benchmarks/results/pick_under_noise_diagnosis.{txt,json}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import gpu_landscape  # noqa: E402
import pick_under_noise  # noqa: E402
from landscape import params_key  # noqa: E402
from search_efficiency import HEADROOM, WITHIN, TableTracer, objective_table  # noqa: E402

from autotune.hardware import Device  # noqa: E402
from autotune.probe.measure.result import ProbeRequest  # noqa: E402
from autotune.sweep.pick import finalists  # noqa: E402
from autotune.sweep.pick.artifacts import best_trial  # noqa: E402
from autotune.sweep.pick.measurements import by_config, ranked  # noqa: E402
from autotune.sweep.study.settings import SweepSettings  # noqa: E402
from autotune.sweep.tuner import Sweep  # noqa: E402

OUT = Path(__file__).parent / "results"
GPU = "8x80GB"
OBJECTIVE = "throughput_per_memory"


def diagnose(model: str, sigma: float, k: int, max_probes: int, seeds: int,
             device_s: float) -> list[dict]:
    """One cell: each seed's pick quality, the within-2% configs it probed and their ranks
    before the repeats, and where a miss was lost."""
    capacity = gpu_landscape.GPUS[GPU]
    space = gpu_landscape.space()
    traces = gpu_landscape.read_traces(space)
    table = gpu_landscape.landscape(model, GPU, space, traces)
    composed = gpu_landscape.composed(traces, space, model, GPU)
    traced = {key: next((v for v in phases.values() if isinstance(v, str)), None) or phases
              for key, phases in composed.items()}
    request = ProbeRequest(model=model, gpus_per_node=gpu_landscape.WORLD,
                           device=Device("cuda", capacity_bytes=capacity))
    values = objective_table(table, OBJECTIVE)
    best = max(v for v in values.values() if v is not None)

    def quality(params) -> float:
        return (values.get(params_key(params)) or 0.0) / best if params else 0.0

    costly = pick_under_noise.NoisyRunner(space, table, 0.0, 0, True, model, capacity,
                                          pick_under_noise.DeviceClock())
    dearest_s = max(costly.device_s(space.config_for(p), table[params_key(p)])
                    for p in space.grid())
    finalists.MAX_PROBES = max_probes  # the cell's cap, read by remeasure at each round
    reserve_s = (1 + k * (max_probes - 1)) * dearest_s
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for seed in range(seeds):
            clock = pick_under_noise.DeviceClock()
            runner = pick_under_noise.NoisyRunner(space, table, sigma, seed + 1000, True,
                                                  model, capacity, clock)
            name = f"k{k}-m{max_probes}-{seed}"
            settings = SweepSettings(
                study_name=name, study_dir=Path(workdir) / name, space=space,
                request=request, objective=OBJECTIVE, headroom=HEADROOM, max_trials=None,
                timeout_s=device_s - reserve_s, seed=seed, prune_dominated=True,
                prescreen=True, trace=False, finalists=k)
            sweep = Sweep(settings, runner, tracer=TableTracer(space, traced, True),
                          clock=clock)
            study = sweep.run()
            searched = len(runner.calls)
            probed = sorted({round(quality(c), 4) for c in runner.calls
                             if quality(c) >= 1 - WITHIN})
            ranks = [i for i, m in enumerate(ranked(study, by_config(study)))
                     if quality(m.trial.params) >= 1 - WITHIN]
            finalists.remeasure(study, settings, runner, k, sweep.feasibility.capacity_bytes)
            pick = best_trial(study)
            picked = quality(pick.params) if pick is not None else 0.0
            lost = "" if picked >= 1 - WITHIN else "search" if not probed else \
                "ranking" if not ranks or ranks[0] >= k else "decision"
            rows.append({"seed": seed, "pick_quality": round(picked, 4),
                         "targets_probed": probed, "target_ranks": ranks[:5],
                         "searched": searched, "repeats": len(runner.calls) - searched,
                         "device_s": round(clock.device_s), "lost_to": lost})
            print(f"K {k} max {max_probes} seed {seed}: pick {picked:.3f}, within-2% configs "
                  f"probed {probed}, their ranks {ranks[:5]}, {searched} probes + "
                  f"{rows[-1]['repeats']} repeats{', lost to ' + lost if lost else ''}",
                  flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-vl-7b")
    parser.add_argument("--noise", type=float, default=0.10)
    parser.add_argument("--cells", nargs="+", default=["3:3", "3:6", "5:3"],
                        help="K:MAX_PROBES, finalists and probes per finalist at most")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--device-h", type=float, default=7.29,
                        help="the sweep's device budget in hours (the full arm's median)")
    args = parser.parse_args()
    cells, lines = [], []
    for cell in args.cells:
        k, max_probes = (int(x) for x in cell.split(":"))
        rows = diagnose(args.model, args.noise, k, max_probes, args.seeds,
                        args.device_h * 3600)
        lost = {why: sum(r["lost_to"] == why for r in rows)
                for why in ("search", "ranking", "decision")}
        within = sum(not r["lost_to"] for r in rows)
        lines.append(f"{args.model} {GPU} noise {args.noise:.0%} K {k} max {max_probes}: "
                     f"pick within 2% {within}/{args.seeds}; missed: {lost['search']} by the "
                     f"search (no within-2% config probed), {lost['ranking']} by the ranking "
                     f"(probed, none among the {k} finalists), {lost['decision']} by the "
                     f"finalists' decision; probes median "
                     f"{statistics.median(r['searched'] for r in rows):.0f} + "
                     f"{statistics.median(r['repeats'] for r in rows):.0f} repeats")
        print(lines[-1], flush=True)
        cells.append({"k": k, "max_probes": max_probes, "within_2pct": within,
                      "lost_to": lost, "rows": rows})
    header = (f"where the noisy sweep's pick is lost (short probes, {args.device_h} device hours "
              f"less the finalists' reserve, objective {OBJECTIVE}); seeds 0 to "
              f"{args.seeds - 1}; written {datetime.date.today()}")
    OUT.mkdir(exist_ok=True)
    (OUT / "pick_under_noise_diagnosis.txt").write_text("\n".join([header, "", *lines]) + "\n")
    (OUT / "pick_under_noise_diagnosis.json").write_text(json.dumps(
        {"model": args.model, "gpus": GPU, "noise": args.noise, "device_h": args.device_h,
         "cells": cells}, indent=1) + "\n")


if __name__ == "__main__":
    main()
