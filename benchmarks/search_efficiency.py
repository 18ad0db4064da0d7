"""How many probes a search needs to find a near-best config, replayed on a recorded grid.

The grid of autotune/search_spaces/cpu-demo.yaml (128 configs) was probed once for real on a 2-core
CPU with the 545 MiB device cap of the demo (benchmarks/landscape.py wrote
benchmarks/data/cpu_demo_grid.csv). Here the real sweep (tuner.Sweep, SQLite storage, the
same ask/tell, dedupe and safe first trial) runs against a runner that answers from that
table, for autotune's TPE and for random search, over many seeds; grid order is scanned once.
A search "reaches" the target at the first probe whose config is feasible (10% headroom) and
within 2% of the grid's best feasible objective. Also counted: the share of probe seconds
spent on configs that ran out of memory.

    python benchmarks/search_efficiency.py [--seeds 30] [--objective throughput_per_memory]

The traced pre-screen (sweep/traced.py) is replayed too: every grid config was traced once
(probe/trace.py, cached in benchmarks/data/cpu_demo_grid_traced.csv) and the sweep's tracer
answers from that table, as its trace process would.

Targets: autotune's median <= 25% of the grid; at least 1.5x fewer probes than random; with
the traced pre-screen, at least 90% of the OOM probes that no pruning would run avoided,
with every run still reaching the target.
Writes benchmarks/results/search_efficiency.{txt,json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from landscape import ReplayRunner, load_landscape, params_key, trace_grid  # noqa: E402

from autotune.hardware import Device
from autotune.probe.result import ProbeRequest  # noqa: E402
from autotune.sweep.feasibility import at_least_as_demanding  # noqa: E402
from autotune.sweep.objective import scalar, score  # noqa: E402
from autotune.sweep.search_space import load_search_space  # noqa: E402
from autotune.sweep.settings import SweepSettings
from autotune.sweep.traced import SubprocessTracer  # noqa: E402
from autotune.sweep.tuner import Sweep  # noqa: E402

GRID = Path(__file__).parent / "data" / "cpu_demo_grid.csv"
TRACED = Path(__file__).parent / "data" / "cpu_demo_grid_traced.csv"
CAP_BYTES = 545 << 20
OUT = Path(__file__).parent / "results"
HEADROOM = 0.10
WITHIN = 0.02


# feasibility.py's parts: (dominance over measured OOMs, the calibrated estimate pre-screen,
# the traced pre-screen)
MODES = {"traced": (True, True, True), "full": (True, True, False),
         "dominance": (True, False, False), "off": (False, False, False)}
MODE_LABELS = {"traced": "dominance + trace", "full": "dominance + estimate",
               "dominance": "dominance only", "off": "off"}
# name, Optuna sampler, feasibility mode
STRATEGIES = [("autotune", "tpe", "traced"), ("tpe, estimate", "tpe", "full"),
              ("tpe, dominance", "tpe", "dominance"), ("tpe, no pruning", "tpe", "off"),
              ("random", "random", "off")]


class TableTracer(SubprocessTracer):
    """The sweep's tracer, answering from the grid's recorded traces instead of a process."""

    def __init__(self, space, traced: dict[str, dict[str, int]]) -> None:
        super().__init__(lambda params, device: params, on_gpu=False)
        self.space, self.table = space, traced

    def _run(self, params):
        return dict(self.table[params_key(params)])


class Reached(Exception):
    """Raised from the sweep's per-trial callback once the target is probed."""


def objective_table(table, objective):
    """Each config's scalar objective when feasible, else None."""
    values = {}
    for key, result in table.items():
        verdict = score(result, objective, HEADROOM)
        values[key] = scalar(verdict.values, objective) if verdict.feasible else None
    return values


def replay(space, table, targets, sampler, mode, seed, objective, workdir, n_startup_trials,
           budget=None, traced=None):
    """Probes until a target config is probed (or the space is exhausted); with a budget,
    exactly `budget` probes whatever they find."""
    runner = ReplayRunner(space, table)

    def check(study):
        if budget is None and runner.calls and params_key(runner.calls[-1]) in targets:
            raise Reached

    settings = SweepSettings(
        study_name=f"{sampler}-{mode}-{seed}-{budget}",
        study_dir=Path(workdir) / f"{sampler}-{mode}-{seed}-{budget}",
        space=space, request=ProbeRequest(model="tiny-qwen2.5",
                                          device=Device("cpu", limit_bytes=CAP_BYTES)),
        objective=objective, headroom=HEADROOM, max_trials=budget or len(table), seed=seed,
        sampler=sampler, n_startup_trials=n_startup_trials, prune_dominated=MODES[mode][0],
        prescreen=MODES[mode][1], trace=False)
    tracer = TableTracer(space, traced) if MODES[mode][2] else None
    sweep = Sweep(settings, runner, on_trial=check, tracer=tracer)
    try:
        sweep.run()
    except Reached:
        pass
    return runner.calls


def skipped_by_trace(table, traced, space, status="ok"):
    """Grid configs of `status` whose trace, with the prior fixed term (cold: no probe yet),
    is past the cap by the margin: what the traced pre-screen would skip from the first
    trial on."""
    from autotune.sweep.traced import TRACE_MARGIN

    context = TableTracer(space, traced).prior_context_bytes
    return [key for key in traced if table[key].status.value == status
            and max(traced[key].values()) + context > CAP_BYTES * (1 + TRACE_MARGIN)]


def dominance_check(table):
    """Pairs (measured GPU OOM A in phase P, config B at least as demanding on P's knobs)
    and how many B did fit."""
    configs = {key: json.loads(key) for key in table}
    pairs = broken = 0
    for key_a, result_a in table.items():
        if result_a.status.value != "gpu_oom":
            continue
        for key_b, params_b in configs.items():
            if key_b != key_a and at_least_as_demanding(params_b, configs[key_a],
                                                        phase=result_a.failed_phase):
                pairs += 1
                broken += table[key_b].status.value != "gpu_oom"
    return pairs, broken


def summarize(calls_runs, table, grid_size):
    probes = [len(calls) for calls in calls_runs]
    oom_shares = []
    for calls in calls_runs:
        results = [table[params_key(c)] for c in calls]
        total = sum(r.probe_wall_s or 0 for r in results)
        oom = sum(r.probe_wall_s or 0 for r in results if r.status.is_oom)
        oom_shares.append(oom / total if total else 0.0)
    quartiles = statistics.quantiles(probes, n=4) if len(probes) > 1 else probes * 3
    return {"median_probes": statistics.median(probes), "p25": quartiles[0],
            "p75": quartiles[2], "max": max(probes),
            "median_share_of_grid": statistics.median(probes) / grid_size,
            "median_oom_time_share": statistics.median(oom_shares),
            "oom_probes_median": statistics.median(
                sum(table[params_key(c)].status.is_oom for c in calls) for calls in calls_runs),
            "probes": probes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=40,
                        help="probes per run for the with/without pruning comparison")
    parser.add_argument("--objective", default="throughput_per_memory")
    parser.add_argument("--startup", type=int, default=SweepSettings.n_startup_trials,
                        help="TPE's random startup trials (autotune's default)")
    args = parser.parse_args()
    space = load_search_space("cpu-demo")
    table = load_landscape(GRID, space)
    traced = trace_grid(space, TRACED, ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                        CAP_BYTES)
    values = objective_table(table, args.objective)
    best = max(v for v in values.values() if v is not None)
    targets = {k for k, v in values.items() if v is not None and v >= (1 - WITHIN) * best}
    grid_order = []
    for params in space.grid():
        grid_order.append(params)
        if params_key(params) in targets:
            break
    runs = {"grid order": [grid_order]}
    with tempfile.TemporaryDirectory() as workdir:
        for name, sampler, mode in STRATEGIES:
            runs[name] = [replay(space, table, targets, sampler, mode, seed, args.objective,
                                 workdir, args.startup, traced=traced)
                          for seed in range(args.first_seed, args.first_seed + args.seeds)]
        budget_runs = {mode: [replay(space, table, targets, "tpe", mode, seed, args.objective,
                                     workdir, args.startup, args.budget, traced)
                              for seed in range(args.first_seed, args.first_seed + args.seeds)]
                       for mode in MODES}
    stats = {name: summarize(calls, table, len(table)) for name, calls in runs.items()}
    budget_stats = {}
    for mode, calls_runs in budget_runs.items():
        found = [max((values[params_key(c)] or 0.0) for c in calls) for calls in calls_runs]
        budget_stats[mode] = {
            "oom_probes_median": statistics.median(
                sum(table[params_key(c)].status.is_oom for c in calls) for calls in calls_runs),
            "oom_probes_total": sum(sum(table[params_key(c)].status.is_oom for c in calls)
                                    for calls in calls_runs),
            "runs_reaching_target": sum(f >= (1 - WITHIN) * best for f in found),
            "median_best_share": statistics.median(f / best for f in found)}
    ratio = stats["random"]["median_probes"] / stats["autotune"]["median_probes"]
    unpruned = stats["tpe, no pruning"]
    avoided = 1 - stats["autotune"]["oom_probes_median"] / unpruned["oom_probes_median"] \
        if unpruned["oom_probes_median"] else 0.0
    oom_configs = sum(r.status.is_oom for r in table.values())
    lines = [
        f"search efficiency on the recorded cpu-demo grid ({len(table)} configs, "
        f"{oom_configs} OOM, {sum(v is not None for v in values.values())} feasible at "
        f"{HEADROOM:.0%} headroom; recorded on a 2-core CPU, tiny-qwen2.5, 545 MiB cap)",
        f"objective {args.objective}; target: feasible and within {WITHIN:.0%} of the best "
        f"({best:.1f}); {len(targets)} configs qualify; seeds {args.first_seed} to "
        f"{args.first_seed + args.seeds - 1}",
        "",
        f"{'search':<16}{'median':>8}{'p25':>7}{'p75':>7}{'max':>6}{'% of grid':>11}"
        f"{'OOM probes':>12}{'OOM time':>10}",
    ]
    for name, s in stats.items():
        lines.append(f"{name:<16}{s['median_probes']:>8.1f}{s['p25']:>7.1f}{s['p75']:>7.1f}"
                     f"{s['max']:>6}{s['median_share_of_grid']:>10.0%}"
                     f"{s['oom_probes_median']:>12.1f}{s['median_oom_time_share']:>10.0%}")
    met_grid = stats["autotune"]["median_share_of_grid"] <= 0.25
    lines += ["", f"random / autotune median probes: {ratio:.2f}x (target >= 1.5x: "
                  f"{'met' if ratio >= 1.5 else 'MISSED'})",
              f"autotune median share of grid: {stats['autotune']['median_share_of_grid']:.0%} "
              f"(target <= 25%: {'met' if met_grid else 'MISSED'})",
              f"OOM probes avoided by feasibility pruning (medians, TPE with vs without): "
              f"{avoided:.0%}; probes to target {stats['autotune']['median_probes']:.1f} vs "
              f"{unpruned['median_probes']:.1f}"]
    off = budget_stats["off"]
    saved = {mode: 1 - s["oom_probes_total"] / off["oom_probes_total"]
             if off["oom_probes_total"] else 0.0 for mode, s in budget_stats.items()}
    lines += ["", f"a fixed budget of {args.budget} probes per run, TPE with each part of "
                  "feasibility pruning (feasibility.py):",
              f"{'pruning':<22}{'OOM probes (median)':>21}{'OOM probes (all runs)':>23}"
              f"{'avoided':>9}{'runs within 2%':>16}{'best found (median)':>21}"]
    for mode, s in budget_stats.items():
        lines.append(f"{MODE_LABELS[mode]:<22}{s['oom_probes_median']:>21.1f}"
                     f"{s['oom_probes_total']:>23}{saved[mode]:>9.0%}"
                     f"{s['runs_reaching_target']:>13}/{args.seeds:<2}"
                     f"{s['median_best_share']:>21.1%}")
    for mode, target in (("full", 0.5), ("traced", 0.9)):
        lossless = budget_stats[mode]["runs_reaching_target"] >= off["runs_reaching_target"]
        lines.append(f"OOM probes avoided by {MODE_LABELS[mode]}: {saved[mode]:.0%} (target >= "
                     f"{target:.0%} with no loss: "
                     f"{'met' if saved[mode] >= target and lossless else 'MISSED'})")
    skipped = [key for key in traced if table[key].status.value == "ok" and max(
        traced[key].values()) + TableTracer(space, traced).prior_context_bytes > CAP_BYTES * 1.0]
    lines.append(f"feasible configs the traced pre-screen would skip (traced past the cap "
                 f"by its margin): {len(skipped_by_trace(table, traced, space))} (target 0); "
                 f"traced past the cap at all: {len(skipped)}; OOM configs it would skip "
                 f"before any probe: {len(skipped_by_trace(table, traced, space, 'gpu_oom'))} "
                 f"of {oom_configs}")
    pairs, broken = dominance_check(table)
    lines.append(f"monotone memory on the grid: {pairs} (GPU OOM in a phase, at least as "
                 f"demanding on that phase's knobs) pairs, {broken} of which did not OOM")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    suffix = "" if args.objective == "throughput_per_memory" else f"_{args.objective}"
    if args.first_seed:
        suffix += f"_seeds{args.first_seed}"
    (OUT / f"search_efficiency{suffix}.txt").write_text(text + "\n")
    (OUT / f"search_efficiency{suffix}.json").write_text(json.dumps(
        {"objective": args.objective, "seeds": args.seeds, "targets": len(targets),
         "best": best, "ratio_random_over_autotune": ratio, "oom_probes_avoided": avoided,
         "stats": stats, "budget": args.budget,
         "budget_stats": budget_stats, "oom_probes_avoided_with_budget": saved},
        indent=2) + "\n")


if __name__ == "__main__":
    main()
