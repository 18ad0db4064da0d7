"""Separate placement against colocated on the GPU-sized landscapes (issue 68): which split of
8 GPUs between the engine and the trainer is fastest, does the sweep find it, and from which
response length does a separate placement beat the best colocated one?

Landscapes, for qwen2.5-7b and qwen2.5-vl-7b on 8 x 80 GB and 8 x 40 GB, at the shapes of
EasyR1's baseline run (gpu-landscape.yaml's fixed knobs):

- separate (benchmarks/spaces/placement-landscape.yaml, 32,256 configs of which 9,216 pass the
  rules: the trainer's GPUs must divide the batches): each role's peak per GPU from the
  memory model (memory/roles.py: the engine's reservation and sync buffers; the trainer's
  states on 8 - rollout_gpus ranks; the prior, as `autotune estimate` prints it: no trace of
  a trainer on 1, 2 or 4 ranks is cached), a config out of memory when either passes the GPU;
  its step from gpu_time_model.py (each side's phases on its own GPUs, the weight sync, the
  composition of config/pipeline.py);
- colocated: gpu-landscape.yaml's 2,304 configs with the same time model; memory from the
  same memory model (memory/model.py), so that both arms are judged alike, and at 2,048-token
  responses also from the traced landscape (gpu_landscape.py) beside it.

The objective is the run's tokens/s over all 8 GPUs. Printed for each landscape: the best
config of each placement and the best of each split, and the best of each placement as the
response length grows (512 to 8,192 tokens); then the real sweep (tuner.Sweep over SQLite,
TPE, no pre-screen: it replays the landscape) searching the separate landscape for 40 probes
on 20 seeds, its 3 finalists probed again (`autotune run`'s default), noise-free and at 5%
lognormal noise, one factor a probe: how often its pick is within 2% of the landscape's
best.

    python benchmarks/placement.py [--seeds 20] [--budget 40] [--models ...] [--gpus ...]

Target (issue 68): the sweep within 2% in at least 18 of 20 seeds. Writes
benchmarks/results/placement.{txt,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import gpu_landscape  # noqa: E402
from landscape import ReplayRunner  # noqa: E402

from autotune.config import SYNC_PHASE, ProbeConfig  # noqa: E402
from autotune.config.pipeline import pipeline_step  # noqa: E402
from autotune.estimates.throughput import Hardware, TimeModel  # noqa: E402
from autotune.hardware import Device  # noqa: E402
from autotune.memory.model import estimate_memory  # noqa: E402
from autotune.memory.roles import estimate_placement  # noqa: E402
from autotune.memory.shape import model_shape  # noqa: E402
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus  # noqa: E402
from autotune.sweep.pick.artifacts import best_trial  # noqa: E402
from autotune.sweep.pick.finalists import remeasure  # noqa: E402
from autotune.sweep.space.params import params_key  # noqa: E402
from autotune.sweep.space.search_space import SearchSpace, load_search_space  # noqa: E402
from autotune.sweep.study.settings import SweepSettings  # noqa: E402
from autotune.sweep.tuner import Sweep  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE / "results"
SPACE_FILE = HERE / "spaces" / "placement-landscape.yaml"
WORLD = gpu_landscape.WORLD
LENGTHS = (512, 1024, 2048, 4096, 8192)
OBJECTIVE = "throughput"  # the run's tokens/s over all its GPUs
WITHIN = 0.02
NOISES = (0.0, 0.05)
FINALISTS = 3  # autotune run --finalists's default
SEPARATE_ORDER = ("rollout", "experience", "update", SYNC_PHASE)
COLOCATED_ORDER = ("rollout", "experience", "update")


def separate_space() -> SearchSpace:
    return load_search_space(str(SPACE_FILE)).for_world(WORLD)


def at_length(space: SearchSpace, length: int) -> SearchSpace:
    return space.with_fixed({"max_response_length": length})


def probe_row(config: ProbeConfig, model: str, capacity: int, peaks: dict[str, int],
              order: tuple[str, ...], times: TimeModel) -> ProbeResult:
    """What a probe of `config` reports: out of memory in the first phase past the GPU (each
    phase's time before it run), else its step and tokens/s over all WORLD GPUs."""
    shape, hardware = model_shape(model), Hardware.of(capacity, WORLD)
    phase_s = times.phase_seconds(config, shape, hardware)
    if config.separate:
        phase_s[SYNC_PHASE] = times.sync_s(config, shape)
    ran_s = times.PROBE_START_S
    for phase in order:
        if peaks[phase] > capacity:
            return gpu_landscape.failed(ProbeStatus.GPU_OOM, phase,
                                        {p: peaks[p] for p in order[:order.index(phase) + 1]},
                                        ran_s, capacity)
        ran_s += phase_s.get(phase, 0.0)
    step_s = times.step_s(config, shape, hardware)
    tokens = times.step_tokens(config)
    return ProbeResult(
        status=ProbeStatus.OK, tokens_per_s=tokens / step_s / WORLD,
        samples_per_s=config.rollout_batch_size * config.rollout_n / step_s, step_s=step_s,
        phase_s=phase_s, peak_mem_bytes=max(peaks.values()), phase_peak_mem_bytes=peaks,
        device_limit_bytes=capacity, device_capacity_bytes=capacity,
        probe_wall_s=times.probe_wall_s(step_s), device_name="landscape")


def separate_table(space: SearchSpace, model: str, capacity: int, times: TimeModel
                   ) -> dict[str, ProbeResult]:
    """params_key -> a probe's report, for every valid config of the separate space."""
    shape, table, memo = model_shape(model), {}, {}
    for params in space.grid():
        if space.problems_for(params):
            continue
        config = space.config_for(params)
        sides = (config.rollout_gpus, config.gpu_memory_utilization,
                 config.rollout_tensor_parallel, config.micro_batch_size_update,
                 config.micro_batch_size_experience, config.gradient_checkpointing,
                 config.offload_params, config.offload_optimizer, config.fused_logprob)
        if sides not in memo:  # staleness moves no memory
            placed = estimate_placement(shape, config, WORLD, config.rollout_gpus, capacity)
            memo[sides] = {"rollout": placed.engine.peak_bytes,
                           **{p: e.total_bytes for p, e in placed.trainer.phases.items()}}
        table[params_key(params)] = probe_row(config, model, capacity, memo[sides],
                                              SEPARATE_ORDER, times)
    return table


def colocated_table(space: SearchSpace, model: str, capacity: int, times: TimeModel
                    ) -> dict[str, ProbeResult]:
    """The same for the colocated space, memory from the memory model."""
    shape, table = model_shape(model), {}
    for params in space.grid():
        if space.problems_for(params):
            continue
        config = space.config_for(params)
        memory = estimate_memory(shape, config, WORLD, on_gpu=True,
                                 engine_capacity_bytes=capacity)
        peaks = {p: e.total_bytes for p, e in memory.phases.items()}
        table[params_key(params)] = probe_row(config, model, capacity, peaks,
                                              COLOCATED_ORDER, times)
    return table


def best_of(table: dict[str, ProbeResult], space: SearchSpace,
            where=lambda params: True) -> tuple[dict, ProbeResult] | None:
    """The fastest config that ran (tokens/s), among those `where` keeps."""
    best = None
    for params in space.grid():
        result = table.get(params_key(params))
        if result is None or result.status is not ProbeStatus.OK or not where(params):
            continue
        if best is None or result.tokens_per_s > best[1].tokens_per_s:
            best = (params, result)
    return best


def describe(params: dict, result: ProbeResult, config: ProbeConfig | None = None) -> str:
    shown = {k: v for k, v in params.items() if k not in ("rollout_gpus", "staleness")}
    text = (f"{result.tokens_per_s:>6,.0f} tokens/s/GPU, step {result.step_s:6.1f} s; "
            + " ".join(f"{k}={v}" for k, v in shown.items()))
    if config is not None and config.separate:
        step = pipeline_step(result.phase_s, config.staleness)
        text += (f" [engine {step.engine_s:.0f} s, trainer {step.trainer_s:.0f} s, sync "
                 f"{step.sync_s:.2f} s: "
                 + (f"the {step.waiting_side} waits {step.idle_s:.0f} s]" if step.overlapped
                    else "taking turns]"))
    return text


class NoisyReplay(ReplayRunner):
    """The landscape's answer with its time scaled by one lognormal factor a probe (its
    step and every phase: the pick pools phase times, sweep/pick/pooled.py)."""

    def __init__(self, space, table, sigma: float, seed: int) -> None:
        super().__init__(space, table)
        self.sigma, self.rng = sigma, random.Random(seed)

    def run(self, request, log_path=None):
        result = super().run(request, log_path)
        if self.sigma == 0 or result.status is not ProbeStatus.OK:
            return result
        factor = self.rng.lognormvariate(-self.sigma ** 2 / 2, self.sigma)
        return dataclasses.replace(result, tokens_per_s=result.tokens_per_s / factor,
                                   samples_per_s=result.samples_per_s / factor,
                                   step_s=result.step_s * factor,
                                   phase_s={p: s * factor for p, s in result.phase_s.items()})


def sweep_pick(space, table, request, sigma, seed, budget, workdir) -> dict | None:
    """The real sweep's pick after `budget` probes of the separate landscape and its
    finalists probed again (`autotune run`'s default FINALISTS)."""
    name = f"placement-{sigma}-{seed}"
    settings = SweepSettings(
        study_name=name, study_dir=Path(workdir) / name, space=space, request=request,
        objective=OBJECTIVE, max_trials=budget, seed=seed, prune_dominated=True,
        prescreen=False, trace=False, finalists=FINALISTS)
    runner = NoisyReplay(space, table, sigma, seed + 1000)
    sweep = Sweep(settings, runner)
    study = sweep.run()
    remeasure(study, settings, runner, FINALISTS, sweep.feasibility.capacity_bytes)
    best = best_trial(study)
    return best.params if best is not None else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--budget", type=int, default=40)
    parser.add_argument("--models", nargs="*", default=list(gpu_landscape.MODELS))
    parser.add_argument("--gpus", nargs="*", default=list(gpu_landscape.GPUS))
    parser.add_argument("--noises", nargs="*", type=float, default=list(NOISES))
    parser.add_argument("--lengths", nargs="*", type=int, default=list(LENGTHS),
                        help="response lengths tried (the sweep runs at 2,048 only); others "
                             "than the default write placement_lengths<...>.{txt,json}")
    args = parser.parse_args()
    lengths = tuple(args.lengths)
    suffix = "" if lengths == LENGTHS else "_lengths" + "-".join(map(str, lengths))
    times = TimeModel.calibrated()
    separate, colocated = separate_space(), gpu_landscape.space()
    traces = gpu_landscape.read_traces(colocated)
    lines, entries = [times.describe(), ""], []

    def say(line: str = "") -> None:
        lines.append(line)
        print(line, flush=True)

    for model in args.models:
        for gpu in args.gpus:
            started, capacity = time.monotonic(), gpu_landscape.GPUS[gpu]
            name = f"{model} {gpu}"
            entry: dict = {"landscape": name, "lengths": {}}
            say(f"== {name}")
            for length in lengths:
                sep_space, col_space = at_length(separate, length), at_length(colocated, length)
                sep = separate_table(sep_space, model, capacity, times)
                col = colocated_table(col_space, model, capacity, times)
                best_sep, best_col = best_of(sep, sep_space), best_of(col, col_space)
                ratio = (best_sep[1].tokens_per_s / best_col[1].tokens_per_s
                         if best_sep and best_col else None)
                figures = {"separate_tokens_per_s_per_gpu":
                           best_sep[1].tokens_per_s if best_sep else None,
                           "colocated_tokens_per_s_per_gpu":
                           best_col[1].tokens_per_s if best_col else None,
                           "separate_over_colocated": ratio,
                           "best_separate": best_sep[0] if best_sep else None,
                           "best_colocated": best_col[0] if best_col else None}
                entry["lengths"][length] = figures
                say(f"  responses {length:>5}: separate/colocated "
                    + (f"{ratio:.3f}" if ratio else "n/a")
                    + (f"; best separate {best_sep[0]['rollout_gpus']} engine GPUs, "
                       f"staleness {best_sep[0]['staleness']}" if best_sep else ""))
                for arm, best, space in (("colocated", best_col, col_space),
                                         ("separate", best_sep, sep_space)):
                    if best:
                        config = space.config_for(best[0])
                        say(f"    {arm:<9} {describe(best[0], best[1], config)}")
                if length != 2048:
                    continue
                traced = best_of(gpu_landscape.landscape(model, gpu, colocated, traces),
                                 colocated)
                if traced:
                    figures["colocated_traced_tokens_per_s_per_gpu"] = traced[1].tokens_per_s
                    say(f"    colocated, traced memory: {describe(*traced)}")
                splits = {}
                for gpus in separate.params["rollout_gpus"].values():
                    for staleness in (0, 1):
                        best = best_of(sep, sep_space, lambda p, g=gpus, s=staleness:
                                       p["rollout_gpus"] == g and p["staleness"] == s)
                        if best:
                            splits[f"{gpus}/{staleness}"] = best[1].tokens_per_s
                            config = sep_space.config_for(best[0])
                            say(f"    split {gpus} engine + {WORLD - gpus} trainer GPUs, "
                                f"staleness {staleness}: {describe(best[0], best[1], config)}")
                entry["splits_tokens_per_s_per_gpu"] = splits
                entry["sweep"] = {}
                if best_sep is None:
                    say("    no separate config fits: no sweep")
                    continue
                request = ProbeRequest(model=model, gpus_per_node=WORLD,
                                       device=Device("cuda", capacity_bytes=capacity))
                top = best_sep[1].tokens_per_s
                for sigma in args.noises:
                    hits, qualities, right_split = 0, [], 0
                    with tempfile.TemporaryDirectory() as workdir:
                        for seed in range(args.seeds):
                            pick = sweep_pick(sep_space, sep, request, sigma, seed,
                                              args.budget, workdir)
                            quality = sep[params_key(pick)].tokens_per_s / top if pick else 0.0
                            qualities.append(quality)
                            hits += quality >= 1 - WITHIN
                            right_split += bool(pick) and \
                                pick["rollout_gpus"] == best_sep[0]["rollout_gpus"]
                    entry["sweep"][str(sigma)] = {
                        "seeds": args.seeds, "budget": args.budget, "within_2pct": hits,
                        "best_split_picked": right_split,
                        "quality_median": statistics.median(qualities),
                        "quality_min": min(qualities)}
                    say(f"    sweep, {args.budget} probes, noise {sigma:.0%}: within 2% in "
                        f"{hits}/{args.seeds}, the best split in {right_split}/{args.seeds}; "
                        f"quality median {statistics.median(qualities):.1%}, worst "
                        f"{min(qualities):.1%}")
            crossing = next((length for length in lengths
                             if (entry["lengths"][length]["separate_over_colocated"] or 0) > 1),
                            None)
            entry["separate_wins_from_length"] = crossing
            say("  separate placement wins from: "
                + (f"{crossing}-token responses" if crossing else "no length tried")
                + f" ({time.monotonic() - started:.0f} s)")
            entries.append(entry)
    header = (f"separate vs colocated placement on 8 GPUs (objective {OBJECTIVE}: the run's "
              f"tokens/s over its GPUs); sweep seeds 0 to {args.seeds - 1}; written "
              f"{time.strftime('%Y-%m-%d')}")
    OUT.mkdir(exist_ok=True)
    (OUT / f"placement{suffix}.txt").write_text("\n".join([header, "", *lines]) + "\n")
    (OUT / f"placement{suffix}.json").write_text(json.dumps(
        {"objective": OBJECTIVE, "lengths": lengths, "landscapes": entries}, indent=2) + "\n")


if __name__ == "__main__":
    main()
