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

The traced pre-screen (sweep/feasibility/traced.py) is replayed too: every grid config was
traced once (probe/trace.py, cached in benchmarks/data/cpu_demo_grid_traced.csv) and the
sweep's tracer answers from that table, as its trace process would.

Targets: autotune's median <= 25% of the grid; at least 1.5x fewer probes than random; with
the traced pre-screen, at least 90% of the OOM probes that no pruning would run avoided,
with every run still reaching the target.
Writes benchmarks/results/search_efficiency.{txt,json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from landscape import ReplayRunner, load_landscape, params_key, trace_grid  # noqa: E402

from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest  # noqa: E402
from autotune.sweep.feasibility.dominance import at_least_as_demanding  # noqa: E402
from autotune.sweep.feasibility.traced import SubprocessTracer  # noqa: E402
from autotune.sweep.space.search_space import load_search_space  # noqa: E402
from autotune.sweep.study.objective import scalar, score  # noqa: E402
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.tuner import Sweep  # noqa: E402

GRID = Path(__file__).parent / "data" / "cpu_demo_grid.csv"
TRACED = Path(__file__).parent / "data" / "cpu_demo_grid_traced.csv"
CAP_BYTES = 545 << 20
OUT = Path(__file__).parent / "results"
HEADROOM = 0.10
WITHIN = 0.02


# sweep/feasibility/screen.py's parts: (dominance over measured OOMs, the calibrated estimate
# pre-screen, the traced pre-screen)
MODES = {"traced": (True, True, True), "full": (True, True, False),
         "dominance": (True, False, False), "off": (False, False, False)}
MODE_LABELS = {"traced": "dominance + trace", "full": "dominance + estimate",
               "dominance": "dominance only", "off": "off"}
# name, Optuna sampler, feasibility mode
BUDGET_PROBES = 20  # the GPU landscapes' fixed budget
GIVE_UP = 200  # probes after which a GPU landscape's run counts as not reaching the target
STRATEGIES = [("autotune", "tpe", "traced"), ("tpe, estimate", "tpe", "full"),
              ("tpe, dominance", "tpe", "dominance"), ("tpe, no pruning", "tpe", "off"),
              ("random", "random", "off")]


LANDSCAPE_PRIOR_BYTES = 1 << 30  # the GPU landscapes' fixed term before a probe (issue 35)


class TableTracer(SubprocessTracer):
    """The sweep's tracer, answering from the grid's recorded traces instead of a process.

    A landscape records traced tensors, not allocation streams, so on a GPU landscape this
    tracer keeps the pre-screen as it was before the allocator replay (issue 48): a fixed
    term per phase, the least each probe held beyond its trace, 1 GiB before one."""

    def __init__(self, space, traced: dict[str, dict[str, int]], on_gpu: bool = False) -> None:
        super().__init__(lambda candidate, device: candidate.params, on_gpu=False)
        self.space, self.table = space, traced
        if on_gpu:
            self.prior_context_bytes = LANDSCAPE_PRIOR_BYTES

    def outside_prior(self, request):
        return self.prior_context_bytes

    def _run(self, params, key=None):
        traced = self.table[params_key(params)]
        if isinstance(traced, str):  # its engine could not start in the trace (cache_oom)
            return traced, f"the recorded trace: {traced}"
        return dict(traced)


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
           budget=None, traced=None, request=None, give_up=None, min_probes=0,
           tracer_class=None, study=None):
    """Probes until a target config is probed (or the space is exhausted, or `give_up`
    probes ran); with a budget, exactly `budget` probes whatever they find. `request`: the
    landscape's model and device (the CPU demo's by default)."""
    request = request or ProbeRequest(model="tiny-qwen2.5",
                                      device=Device("cpu", limit_bytes=CAP_BYTES))
    runner = ReplayRunner(space, table)

    def check(study):
        if budget is None and len(runner.calls) >= min_probes and any(
                params_key(c) in targets for c in runner.calls):
            raise Reached

    name = study or f"{sampler}-{mode}-{seed}-{budget}"
    settings = SweepSettings(
        study_name=name, study_dir=Path(workdir) / name,
        space=space, request=request, objective=objective, headroom=HEADROOM,
        max_trials=budget or give_up or len(table), seed=seed,
        sampler=sampler, n_startup_trials=n_startup_trials, prune_dominated=MODES[mode][0],
        prescreen=MODES[mode][1], trace=False)
    tracer = (tracer_class or TableTracer)(space, traced, request.device.on_gpu) \
        if MODES[mode][2] else None
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
    from autotune.sweep.feasibility.traced import TRACE_MARGIN_CPU as TRACE_MARGIN

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


def deepspeed_like(space, table, objective, defaults):
    """DeepSpeed's autotuner in its fast mode, on this space: memory stages from the fastest
    to the most frugal (ZeRO 0 to 3 here: no checkpointing or offload, checkpointing, then
    the optimizer's and the params' offload), in each a binary search for the largest
    micro-batch that fits (the log-prob micro-batch at twice it, EasyR1's ratio), then the
    fitting micro-batches below it; the next stage only while a stage found something and
    beat the one before. Every other knob stays at `defaults`. Returns the configs probed."""
    stages = [dict(gradient_checkpointing=False, offload_optimizer=False, offload_params=False),
              dict(gradient_checkpointing=True, offload_optimizer=False, offload_params=False),
              dict(gradient_checkpointing=True, offload_optimizer=True, offload_params=False),
              dict(gradient_checkpointing=True, offload_optimizer=True, offload_params=True)]
    micros = space.params["micro_batch_size_update"].values()
    experience = space.params["micro_batch_size_experience"].values()
    calls, previous_best = [], None

    def probe(stage, micro):
        params = {**defaults, **stage, "micro_batch_size_update": micro,
                  "micro_batch_size_experience": min(
                      experience, key=lambda v: abs(v - 2 * micro))}
        calls.append(params)
        verdict = score(table[params_key(params)], objective, HEADROOM)
        return scalar(verdict.values, objective) if verdict.feasible else None

    for stage in stages:
        found, low, high = {}, 0, len(micros) - 1
        while low <= high:  # the largest fitting micro-batch
            mid = (low + high) // 2
            found[mid] = probe(stage, micros[mid])
            low, high = (mid + 1, high) if found[mid] is not None else (low, mid - 1)
        fits = [i for i in range(high + 1) if i not in found]
        for index in reversed(fits):
            found[index] = probe(stage, micros[index])
        best = max((v for v in found.values() if v is not None), default=None)
        if best is None:
            continue
        if previous_best is not None and best <= previous_best:
            break
        previous_best = best
    return calls


class BeforeTracer(TableTracer):
    """The tracer as it was before issue 35: a config probed untraced (the safe config)
    taught no fixed term, so the prior stood until a traced config was probed; a trace whose
    engine could not start turned tracing off for the sweep."""

    def learn(self, candidate, phase_peak_mem_bytes, device, phase_reserved_bytes=None):
        if candidate.key in self.traces:
            super().learn(candidate, phase_peak_mem_bytes, device)

    def _run(self, params, key=None):
        traced = super()._run(params)
        if isinstance(traced, tuple):
            self.unavailable = f"the trace cannot follow this model or config: {traced[1]}"
            return None
        return traced


@contextlib.contextmanager
def before_issue_35():
    """The sweep as it was before issue 35: dominance compared an OOM's phase on knobs that
    left out the log-prob switches (a config with fused_logprob was proven to OOM by one
    without it); with BeforeTracer, the tracer's two faults."""
    from autotune.memory import phases
    from autotune.sweep.feasibility import dominance

    switches = {"fused_logprob", "fused_logprob_kernel", "entropy_chunking", "entropy_metric",
                "entropy_coeff", "kv_cache_memory_bytes"}
    old = {phase: knobs - switches for phase, knobs in phases.PHASE_KNOBS.items()}
    saved = dominance.PHASE_KNOBS
    dominance.PHASE_KNOBS = old
    try:
        yield
    finally:
        dominance.PHASE_KNOBS = saved


def first_target(calls, targets):
    """Probes until the first target config (None: never)."""
    return next((i + 1 for i, c in enumerate(calls) if params_key(c) in targets), None)


def gpu_main(args) -> None:
    """The GPU-sized landscapes of benchmarks/gpu_landscape.py, each searched side by side:
    autotune's sweep now and before issue 35's fixes, random search (a seeded permutation of
    the grid: sampling without replacement), grid order and the DeepSpeed-like search."""
    import gpu_landscape

    space = gpu_landscape.space()
    traces = gpu_landscape.read_traces(space)
    defaults = {"micro_batch_size_update": 1, "micro_batch_size_experience": 2,
                "gradient_checkpointing": True, "offload_params": True,
                "offload_optimizer": True, "gpu_memory_utilization": 0.6,
                "rollout_tensor_parallel": 2, "fused_logprob": False}  # EasyR1's example
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    grid = list(space.grid())
    report, lines = {}, []
    for model, gpu in [(m, g) for m in args.models or gpu_landscape.MODELS
                       for g in gpu_landscape.GPUS]:
        started = time.monotonic()
        table = gpu_landscape.landscape(model, gpu, space, traces)
        composed = gpu_landscape.composed(traces, space, model, gpu)
        traced = {key: next((v for v in phases.values() if isinstance(v, str)), None)
                  or phases for key, phases in composed.items()}
        request = ProbeRequest(model=model, gpus_per_node=gpu_landscape.WORLD,
                               device=Device("cuda", capacity_bytes=gpu_landscape.GPUS[gpu]))
        values = objective_table(table, args.objective)
        best = max(v for v in values.values() if v is not None)
        targets = {k for k, v in values.items() if v is not None and v >= (1 - WITHIN) * best}
        runs = {"grid order": [grid], "deepspeed-like": [
            deepspeed_like(space, table, args.objective, defaults)]}
        runs["random"] = [random.Random(seed).sample(grid, len(grid)) for seed in seeds]
        with tempfile.TemporaryDirectory() as workdir:
            runs["autotune"] = [
                replay(space, table, targets, "tpe", "traced", seed, args.objective, workdir,
                       args.startup, traced=traced, request=request, give_up=GIVE_UP,
                       min_probes=BUDGET_PROBES) for seed in seeds]
            with before_issue_35():
                runs["autotune, before"] = [
                    replay(space, table, targets, "tpe", "traced", seed, args.objective,
                           workdir, args.startup, traced=traced, request=request,
                           give_up=GIVE_UP, min_probes=BUDGET_PROBES, tracer_class=BeforeTracer,
                           study=f"before-{seed}") for seed in seeds]
        stats = {name: run_stats(calls_runs, table, values, targets, best)
                 for name, calls_runs in runs.items()}
        statuses: dict[str, int] = {}
        for result in table.values():
            statuses[result.status.value] = statuses.get(result.status.value, 0) + 1
        default = table[params_key(defaults)]
        report[f"{model} {gpu}"] = {
            "configs": len(table), "statuses": statuses, "best": best,
            "targets": len(targets), "stats": stats,
            "default": {"objective": values[params_key(defaults)],
                        "tokens_per_s": default.tokens_per_s,
                        "peak_mem_bytes": default.peak_mem_bytes}}
        default_text = f"{values[params_key(defaults)]:.1f}" \
            if values[params_key(defaults)] is not None else default.status.value
        block = [f"{model} on {gpu}: {len(table)} configs ("
                 f"{', '.join(f'{v} {k}' for k, v in sorted(statuses.items()))}); best "
                 f"{best:.1f} (EasyR1's example config: {default_text}); {len(targets)} "
                 f"within {WITHIN:.0%}",
                 f"  {'search':<18}{'reached':>9}{'median':>8}{'p25':>7}{'p75':>7}"
                 f"{'OOM probes':>12}{f'best at {BUDGET_PROBES}':>12}{'worst run':>11}"
                 f"{f'OOM in {BUDGET_PROBES}':>10}"]
        for name, st in stats.items():
            block.append(f"  {name:<18}{st['reached']:>5}/{st['runs']:<3}"
                         f"{fmt(st['median_probes']):>8}{fmt(st['p25']):>7}{fmt(st['p75']):>7}"
                         f"{st['oom_probes_median']:>12.1f}{st['best_at_budget_median']:>12.1%}"
                         f"{st['best_at_budget_min']:>11.1%}"
                         f"{st['oom_probes_budget_median']:>10.1f}")
        ratio = ratio_text(stats)
        block += [f"  {ratio}; {time.monotonic() - started:.0f} s", ""]
        report[f"{model} {gpu}"]["summary"] = ratio
        lines += block
        print("\n".join(block), flush=True)
    from autotune.estimates.throughput import TimeModel

    text = "\n".join([
        "search efficiency on the GPU-sized landscapes (benchmarks/gpu_landscape.py: memory "
        "traced per rank, time modelled and fitted to EasyR1's baselines), objective "
        f"{args.objective}, seeds {seeds[0]} to {seeds[-1]}. Probes to reach a feasible config "
        f"within {WITHIN:.0%} of the best (a run gives up after {GIVE_UP}); OOM probes on the "
        f"way; the best found in the first {BUDGET_PROBES} probes, as a share of the best",
        "", TimeModel.calibrated().describe(), "", *lines])
    OUT.mkdir(exist_ok=True)
    suffix = "" if args.objective == "throughput_per_memory" else f"_{args.objective}"
    (OUT / f"search_efficiency_gpu{suffix}.txt").write_text(text + "\n")
    (OUT / f"search_efficiency_gpu{suffix}.json").write_text(json.dumps(
        {"objective": args.objective, "seeds": args.seeds, "budget": BUDGET_PROBES,
         "give_up": GIVE_UP, "landscapes": report}, indent=2) + "\n")


def fmt(value):
    return "-" if value is None else f"{value:.1f}"


def run_stats(calls_runs, table, values, targets, best):
    """Probes to the target, OOM probes on the way, the best of the first BUDGET_PROBES."""
    reached = [first_target(calls, targets) for calls in calls_runs]
    hits = [r for r in reached if r is not None]
    quartiles = statistics.quantiles(hits, n=4) if len(hits) > 1 else hits * 3 or [None] * 3
    until = [calls[:r] if r else calls for calls, r in zip(calls_runs, reached, strict=True)]
    first = [calls[:BUDGET_PROBES] for calls in calls_runs]

    def ooms(calls):
        return sum(table[params_key(c)].status.is_oom for c in calls)

    return {"runs": len(calls_runs), "reached": len(hits),
            "median_probes": statistics.median(hits) if hits else None,
            "p25": quartiles[0], "p75": quartiles[2], "probes": reached,
            "oom_probes_median": statistics.median(ooms(c) for c in until),
            "oom_probes_total": sum(ooms(c) for c in until),
            "oom_probes_budget_median": statistics.median(ooms(c) for c in first),
            "best_at_budget_median": statistics.median(
                max((values[params_key(c)] or 0.0) for c in calls) / best for calls in first),
            "best_at_budget_min": min(
                max((values[params_key(c)] or 0.0) for c in calls) / best for calls in first)}


def ratio_text(stats):
    auto, rand, ds = (stats[n] for n in ("autotune", "random", "deepspeed-like"))
    if auto["median_probes"] and rand["median_probes"]:
        ratio = rand["median_probes"] / auto["median_probes"]
        parts = [f"random / autotune median probes: {ratio:.1f}x"]
    else:
        parts = ["random or autotune never reached the target"]
    reached = f"reached in {ds['probes'][0]} probes" if ds["probes"][0] else \
        "never reached the target"
    parts.append(f"deepspeed-like: {reached} (best {ds['best_at_budget_median']:.1%}, "
                 f"{ds['oom_probes_total']} OOM probes)")
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=40,
                        help="probes per run for the with/without pruning comparison")
    parser.add_argument("--objective", default="throughput_per_memory")
    parser.add_argument("--startup", type=int, default=SweepSettings.n_startup_trials,
                        help="TPE's random startup trials (autotune's default)")
    parser.add_argument("--landscape", choices=("cpu-demo", "gpu"), default="cpu-demo")
    parser.add_argument("--models", nargs="*", help="gpu: these models' landscapes only")
    args = parser.parse_args()
    if args.landscape == "gpu":
        gpu_main(args)
        return
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
                  "feasibility pruning (sweep/feasibility/screen.py):",
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
