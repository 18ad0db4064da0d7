"""The short probe held to full steps: its predicted step against the measured mean of full
steps of the same config, its phase peaks against theirs, its wall time against theirs.

Each case is measured two ways:

- interleaved steps, one process (in a probe's environment, its heap setting included): the
  probe is built once, warmed up with a short step and a
  full one (on a GPU with a short step alone), then runs `--pairs` pairs of a short step
  (of each loop its first unit, a middle one and its last, the step predicted from them;
  probe/measure/unit_loops.py) and a full one (every unit), so the prediction is held to
  full steps of the same built probe, on the same memory and threads,
  seconds apart: predicted_step_s against full_step_s;
- whole probes, through the local runner as a sweep runs them (forked CPU probes, the sweep's
  step counts: 2 short steps at least, 3 full ones at least, more while under 2 s or, short,
  while the predicted step's standard error is over 1%), short and full alternating,
  `--repeats` of each: their phase peaks and wall times, and their step figures (between
  whole probes, so with the noise between processes: probe_step_ratio).

The grid covers GRPO and PPO, offload, checkpointing, the fused log-prob, LoRA, Ulysses SP and
emulated ranks, one generation wave and several, fixed micro-batches and token budgets, the tiny
text and VL models (`--large` adds qwen2.5-0.5b at small shapes).

    python benchmarks/short_probe.py [--pairs 3] [--repeats 2] [--large] [--only CASE]
    python benchmarks/short_probe.py --peaks-again CASE [CASE ...] --repeats 3

Per case: predicted_step_s and full_step_s (the interleaved steps' means) and their ratio,
peak_ratio (the phase whose short/full peak ratio over the whole probes is farthest from 1),
short_wall_s and full_wall_s (the runner's wall, medians). Targets (issue 64): every predicted
step within 5% of the full steps' mean; every phase peak within 1%; median full/short wall at
least 2 over the grid, at least 4 over the rows with several waves or micro-batches.
Writes benchmarks/results/short_probe.{txt,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult
from autotune.runners.local import SubprocessRunner, probe_env

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_evidence  # noqa: E402  (the GPU cases, as the GPU scripts declare them)
import gpu_holdout  # noqa: E402

OUT_DIR = Path(__file__).parent / "results"
MIN_TIMED_S = 2.0  # the sweep's (sweep/plan.py)
BASE = dict(rollout_batch_size=8, rollout_n=4, global_batch_size=4, max_prompt_length=64,
            max_response_length=64, micro_batch_size_update=2, micro_batch_size_experience=4)
# name -> (model, config changes, request changes, several units: waves or micro-batches)
CASES: dict[str, tuple[str, dict, dict, bool]] = {
    "grpo mbu2 mbe4": ("tiny-qwen2.5", {}, {}, True),
    "grpo mbu8 mbe16 (one unit)": ("tiny-qwen2.5", {"micro_batch_size_update": 8,
                                                   "micro_batch_size_experience": 16}, {},
                                   False),
    "grpo mbu1 mbe2": ("tiny-qwen2.5", {"micro_batch_size_update": 1,
                                       "micro_batch_size_experience": 2}, {}, True),
    "grpo gc + offload": ("tiny-qwen2.5", {"gradient_checkpointing": True,
                                          "offload_params": True, "offload_optimizer": True},
                          {}, True),
    "grpo fused log-prob": ("tiny-qwen2.5", {"fused_logprob": True}, {}, True),
    "grpo 8 waves (hf, 4 seqs)": ("tiny-qwen2.5", {"rollout_engine": "hf", "max_num_seqs": 4},
                                  {}, True),
    "grpo token budgets": ("tiny-qwen2.5", {"dynamic_batching": True,
                                           "max_token_len_update": 256,
                                           "max_token_len_experience": 512}, {}, True),
    "ppo mbu2": ("tiny-qwen2.5", {"algorithm": "ppo", "critic_micro_batch_size_update": 2},
                 {}, True),
    "grpo lora r8": ("tiny-qwen2.5", {"lora_rank": 8, "lora_alpha": 16}, {}, True),
    "grpo W4 emulated": ("tiny-qwen2.5", {"rollout_batch_size": 16, "global_batch_size": 8,
                                         "micro_batch_size_update": 1,
                                         "micro_batch_size_experience": 2},
                         {"gpus_per_node": 4, "emulated": True}, True),
    "grpo SP2 W2 emulated": ("tiny-qwen2.5", {"ulysses_sequence_parallel_size": 2},
                             {"gpus_per_node": 2, "emulated": True}, True),
    "vl grpo mbu2": ("tiny-qwen2.5-vl", {"image_size_px": 112}, {}, True),
    "grpo 1 wave, 2 micro-batches": ("tiny-qwen2.5", {"rollout_batch_size": 4,
                                                     "global_batch_size": 4,
                                                     "micro_batch_size_update": 8,
                                                     "micro_batch_size_experience": 8}, {},
                                     False),
    # loops of a real rank's length (EasyR1's default rank of 8 trains 320 responses a step:
    # 20-80 micro-batches a loop), where a short probe runs 4 units of 16 or 32
    "grpo 32 micro-batches a loop": ("tiny-qwen2.5", {"rollout_batch_size": 16,
                                                     "global_batch_size": 8,
                                                     "micro_batch_size_update": 1,
                                                     "micro_batch_size_experience": 2}, {},
                                     True),
    "grpo 16 waves, 16 micro-batches": ("tiny-qwen2.5", {"rollout_batch_size": 16,
                                                        "global_batch_size": 8,
                                                        "rollout_engine": "hf",
                                                        "max_num_seqs": 4,
                                                        "micro_batch_size_update": 2,
                                                        "micro_batch_size_experience": 4}, {},
                                        True),
}
LARGE = {"0.5b grpo mbu1": ("qwen2.5-0.5b", {"rollout_batch_size": 2, "rollout_n": 4,
                                             "global_batch_size": 2, "max_prompt_length": 32,
                                             "max_response_length": 32,
                                             "micro_batch_size_update": 1,
                                             "micro_batch_size_experience": 2}, {}, True)}


# issue 64 item 7, on a GPU when one is lent (`--device cuda`): README command 1's first
# probe (its default GPU config) and gpu_evidence.py's 7B rank of 8 (emulated), each as
# those scripts declare it; interleaved steps in one built probe only (a whole full probe of
# the README row took 205 s on the H200)
GPU_CASES: dict[str, tuple[str, dict, dict, bool]] = {
    "readme 0.5b w1": (gpu_holdout.README_ROW["model"], gpu_holdout.README_ROW["knobs"], {},
                       True),
    "7b rank0/8 ckpt mbu2": ("qwen2.5-7b", {**gpu_evidence.SHAPES, **gpu_evidence.BIG,
                                            "micro_batch_size_update": 2},
                             {"gpus_per_node": 8, "emulated": True}, True),
}
# pairs per GPU case, sized by measured step times so that both fit one device call: the
# README row's full step took 43-52 s on the H200 (its short one is mostly the rollout's one
# wave, 14 s); the 7B rank's steps take seconds
GPU_PAIRS = {"readme 0.5b w1": 2, "7b rank0/8 ckpt mbu2": 3}


def request_for(model: str, config: dict, request: dict, full: bool,
                device: str = "cpu") -> ProbeRequest:
    return ProbeRequest(model=model, config=ProbeConfig(**{**BASE, **config}),
                        device=Device(device), timeout_s=1800.0, warmup_steps=1,
                        timed_steps=3 if full else 2, timed_min_s=MIN_TIMED_S, full_steps=full,
                        **request)


def checked(name: str, result: ProbeResult) -> ProbeResult:
    if not result.ok:
        raise SystemExit(f"{name}: {result.status.value}: {result.message}\n"
                         f"{result.stderr_tail}")
    return result


def peak_ratios(short: list[ProbeResult], full: list[ProbeResult]) -> dict[str, float]:
    """Each phase's peak ratio short/full (medians over the probes)."""
    return {phase: statistics.median(r.phase_peak_mem_bytes[phase] for r in short)
            / statistics.median(r.phase_peak_mem_bytes[phase] for r in full)
            for phase in full[0].phase_peak_mem_bytes}


def farthest_ratio(short: list[ProbeResult], full: list[ProbeResult]) -> tuple[str, float]:
    """The phase whose peak ratio short/full (medians over the probes) is farthest from 1,
    and that ratio."""
    return max(peak_ratios(short, full).items(), key=lambda item: abs(item[1] - 1))


def interleaved_steps(name: str, pairs: int, device: str = "cpu") -> dict[str, list]:
    """In this process: the case's probe built once, a short and a full warm-up step (on a GPU
    a short one alone), then
    `pairs` of a short step (its predicted seconds) and a full one (its seconds); with each
    step's wall seconds and, per phase, its peak device bytes (the meter's, read per step)."""
    import torch

    from autotune.probe.measure.meter import MemoryMeter
    from autotune.probe.modeling.sharding import leave_group
    from autotune.probe.step.training import TrainingProbe, training_s

    model, config, request, _ = {**CASES, **LARGE, **GPU_CASES}[name]
    probe_request = request_for(model, config, request, full=False, device=device)
    meter = MemoryMeter(torch.device(device), short=True)
    if device == "cuda":
        capacity = torch.cuda.get_device_properties(meter.device).total_memory
        probe_request = dataclasses.replace(
            probe_request, device=probe_request.device.with_capacity(capacity))
        meter.start(nvml_index=0)
    else:
        meter.start()
    probe = TrainingProbe(probe_request, meter)
    probe.build()
    steps: dict[str, list] = {"short": [], "full": [], "short_wall": [], "full_wall": [],
                              "short_peaks": [], "full_peaks": []}
    for index in range(pairs + 1):
        # the first pair warms up; on a GPU its short step alone (a full step there costs a
        # device-minute, and the short one has run every shape the full one runs)
        for mode in ("short",) if index == 0 and device == "cuda" else ("short", "full"):
            meter.clock.short = mode == "short"
            meter.phase_peak_mem_bytes.clear()
            began = time.perf_counter()
            seconds = training_s(probe.step())
            wall = time.perf_counter() - began
            if index:  # the first pair warms up
                steps[mode].append(seconds)
                steps[f"{mode}_wall"].append(wall)
                steps[f"{mode}_peaks"].append(dict(meter.phase_peak_mem_bytes))
            if device == "cuda":
                print(f"  {name} {mode} step {index}: {seconds:.2f} s (wall {wall:.2f} s)",
                      file=sys.stderr, flush=True)
    meter.stop()
    leave_group()
    return steps


def gpu_rows(out: Path, device_kind: str = "cuda") -> None:
    """Issue 64 item 7: GPU_CASES' interleaved steps on this GPU (GPU_PAIRS of each), each
    case in a fresh interpreter; writes short_probe_gpu.{txt,json} under `out` after every
    case."""
    import torch

    if device_kind == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing to run (--device cuda is for a GPU)")
        return
    device = torch.cuda.get_device_name(0) if device_kind == "cuda" else "this CPU"
    rows = []
    for name in GPU_CASES:
        pairs = GPU_PAIRS[name]
        began = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--interleave", name, "--pairs",
                               str(pairs), "--device", device_kind], capture_output=True,
                              text=True, check=False)
        if done.returncode != 0:
            rows.append({"case": name, "error": done.stderr[-1500:]})
        else:
            steps = json.loads(done.stdout.strip().splitlines()[-1])
            ratios = {phase: statistics.median(p[phase] for p in steps["short_peaks"])
                      / statistics.median(p[phase] for p in steps["full_peaks"])
                      for phase in steps["full_peaks"][0]}
            rows.append({"case": name, "pairs": pairs, **steps,
                         "predicted_step_s": statistics.fmean(steps["short"]),
                         "full_step_s": statistics.fmean(steps["full"]),
                         "step_ratio": statistics.fmean(steps["short"])
                         / statistics.fmean(steps["full"]),
                         "peak_ratios": ratios,
                         "step_wall_ratio": statistics.fmean(steps["full_wall"])
                         / statistics.fmean(steps["short_wall"]),
                         "case_wall_s": time.perf_counter() - began})
        lines = [f"short probe vs full steps on {device} ({time.strftime('%Y-%m-%d')}): per "
                 "case, pairs of a short and a full step interleaved in one built probe, "
                 f"after a short warm-up step (python benchmarks/short_probe.py --device "
                 f"{device_kind})"]
        for row in rows:
            if "error" in row:
                lines.append(f"{row['case']}: failed: {row['error'].splitlines()[-1:]}")
                continue
            peaks = "  ".join(f"{phase} {ratio:.4f}"
                              for phase, ratio in sorted(row["peak_ratios"].items()))
            lines.append(
                f"{row['case']}: predicted {row['predicted_step_s']:.2f} s (each "
                + ", ".join(f"{s:.2f}" for s in row["short"]) + f"), full "
                f"{row['full_step_s']:.2f} s (each " + ", ".join(f"{s:.2f}" for s in row["full"])
                + f"), ratio {row['step_ratio']:.3f}; step wall full/short "
                f"{row['step_wall_ratio']:.2f}; phase peaks short/full {peaks}; case "
                f"{row['case_wall_s']:.0f} s")
        text = "\n".join(lines)
        out.mkdir(parents=True, exist_ok=True)
        (out / "short_probe_gpu.txt").write_text(text + "\n")
        (out / "short_probe_gpu.json").write_text(json.dumps({"device": device, "rows": rows},
                                                             indent=2) + "\n")
        print(text, flush=True)


def interleaved_in_subprocess(name: str, pairs: int) -> dict[str, list[float]]:
    """`interleaved_steps` in a fresh interpreter (no state left from other cases), in the
    environment a probe of the case runs in (runners/local.py `probe_env`: its heap setting
    above all; without it glibc's moving mmap threshold sped each loop's units up over its
    first few, and the short step, whose sampled units are each loop's first few run in a
    row, read 1.08 of full steps on 32 micro-batches a loop where under the probe's heap it
    reads 1.02)."""
    model, config, request, _ = {**CASES, **LARGE}[name]
    env = probe_env(request_for(model, config, request, full=False))
    done = subprocess.run([sys.executable, __file__, "--interleave", name, "--pairs",
                           str(pairs)], capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name}: interleaved steps failed:\n{done.stderr[-2000:]}")
    steps: dict[str, list[float]] = json.loads(done.stdout.strip().splitlines()[-1])
    return steps


def run_case(runner: SubprocessRunner, name: str, case: tuple[str, dict, dict, bool],
             repeats: int, pairs: int) -> dict:
    model, config, request, several = case
    steps = interleaved_in_subprocess(name, pairs)
    checked(name, runner.run(request_for(model, config, request, full=False)))  # warm server
    done: dict[str, list[ProbeResult]] = {"short": [], "full": []}
    for _ in range(repeats):
        for mode in ("short", "full"):
            result = runner.run(request_for(model, config, request, full=mode == "full"))
            done[mode].append(checked(name, result))
    short, full = done["short"], done["full"]
    predicted = statistics.fmean(steps["short"])
    measured = statistics.fmean(steps["full"])
    probe_predicted = statistics.fmean(r.step_s or 0.0 for r in short)
    probe_measured = statistics.fmean(s for r in full for s in r.step_times_s)
    pair_ratios = [a / b for a, b in zip(steps["short"], steps["full"], strict=True)]
    peak_phase, peak_ratio = farthest_ratio(short, full)
    units = {phase: {unit: f"{u['ran']:.0f}/{u['count']:.0f}x{u['loops']:.0f}"
                     for unit, u in kinds.items()} for phase, kinds in short[0].units.items()}
    return {"case": name, "model": model, "several_units": several,
            "predicted_step_s": predicted, "full_step_s": measured,
            "step_ratio": predicted / measured,
            "pair_ratio_min": min(pair_ratios), "pair_ratio_max": max(pair_ratios),
            "interleaved_short_s": steps["short"], "interleaved_full_s": steps["full"],
            "probe_predicted_step_s": probe_predicted, "probe_full_step_s": probe_measured,
            "probe_step_ratio": probe_predicted / probe_measured,
            "predicted_each_s": [r.step_s for r in short],
            "full_each_s": [statistics.fmean(r.step_times_s) for r in full],
            "short_se_s": [r.step_se_s for r in short],
            "short_steps": [len(r.step_times_s) for r in short],
            "full_steps": [len(r.step_times_s) for r in full],
            "peak_ratio": peak_ratio, "peak_phase": peak_phase,
            "phase_peak_ratios": peak_ratios(short, full),
            "short_wall_s": statistics.median(r.probe_wall_s or 0.0 for r in short),
            "full_wall_s": statistics.median(r.probe_wall_s or 0.0 for r in full),
            "short_timed_wall_s": statistics.median(r.timed_wall_s or 0.0 for r in short),
            "full_timed_wall_s": statistics.median(r.timed_wall_s or 0.0 for r in full),
            "contended": sum(1 for r in short + full if r.contention),
            "units": units}


def peaks_again(runner: SubprocessRunner, names: list[str], repeats: int) -> str:
    """Each case's phase peaks, whole short and full probes alternating `repeats` times: the
    per-phase ratio of the medians, for the rows whose single probes missed 1%."""
    lines = [f"phase peaks again, {repeats} whole probes of each alternating "
             f"({time.strftime('%Y-%m-%d')}); MiB per probe, then short/full of the medians"]
    for name in names:
        model, config, request, _ = {**CASES, **LARGE}[name]
        checked(name, runner.run(request_for(model, config, request, full=False)))
        done: dict[str, list[ProbeResult]] = {"short": [], "full": []}
        for _ in range(repeats):
            for mode in ("short", "full"):
                result = runner.run(request_for(model, config, request, full=mode == "full"))
                done[mode].append(checked(name, result))
        lines.append(name)
        for mode, results in done.items():
            for r in results:
                lines.append(f"  {mode:<6}" + "  ".join(
                    f"{phase} {value / 2**20:.1f}"
                    for phase, value in sorted(r.phase_peak_mem_bytes.items())))
        ratios = peak_ratios(done["short"], done["full"])
        lines.append("  short/full " + "  ".join(f"{phase} {ratio:.4f}"
                                                 for phase, ratio in sorted(ratios.items())))
        print(lines[-1], flush=True)
    return "\n".join(lines)


def report(rows: list[dict], repeats: int, pairs: int) -> str:
    lines = [f"short probe vs full steps, CPU ({time.strftime('%Y-%m-%d')}): per case {pairs} "
             f"pairs of a short and a full step interleaved in one built probe, and "
             f"{repeats} whole probes of each alternating",
             f"{'case':<31}{'predicted':>10}{'full':>8}{'ratio':>7}{'pairs':>12}{'probes':>7}"
             f"{'peak':>8}{'short':>7}{'full':>7}{'speed':>6}  units run/count x loops"]
    for row in rows:
        units = "; ".join(f"{phase}: " + ", ".join(f"{u} {v}" for u, v in kinds.items())
                          for phase, kinds in row["units"].items())
        spread = f"{row['pair_ratio_min']:.2f}-{row['pair_ratio_max']:.2f}"
        lines.append(f"{row['case']:<31}{row['predicted_step_s']:>10.3f}"
                     f"{row['full_step_s']:>8.3f}{row['step_ratio']:>7.3f}{spread:>12}"
                     f"{row['probe_step_ratio']:>7.3f}"
                     f"{row['peak_ratio']:>8.4f}{row['short_wall_s']:>7.1f}"
                     f"{row['full_wall_s']:>7.1f}"
                     f"{row['full_wall_s'] / row['short_wall_s']:>6.2f}  {units}")
    speed = [r["full_wall_s"] / r["short_wall_s"] for r in rows]
    several = [r["full_wall_s"] / r["short_wall_s"] for r in rows if r["several_units"]]
    timed = [r["full_timed_wall_s"] / r["short_timed_wall_s"] for r in rows]
    worst_step = max(rows, key=lambda r: abs(r["step_ratio"] - 1))
    worst_peak = max(rows, key=lambda r: abs(r["peak_ratio"] - 1))
    lines += [
        "columns: predicted = the interleaved short steps' mean predicted step (s); full = "
        "the interleaved full steps' mean (s); ratio = predicted/full; pairs = the range of "
        "each pair's ratio; probes = the whole short probes' mean step over the whole full "
        "probes' (between processes); peak = the phase peak ratio short/full farthest from 1; "
        "short, full = median probe wall (s, the runner's); speed = full/short wall",
        f"predicted step within 5% of full steps: "
        f"{sum(abs(r['step_ratio'] - 1) <= 0.05 for r in rows)} of {len(rows)} "
        f"(worst {worst_step['case']}: {worst_step['step_ratio']:.3f})",
        f"phase peaks within 1%: {sum(abs(r['peak_ratio'] - 1) <= 0.01 for r in rows)} of "
        f"{len(rows)} (worst {worst_peak['case']}: {worst_peak['peak_ratio']:.4f}"
        f"{', ' + worst_peak['peak_phase'] if worst_peak.get('peak_phase') else ''}); "
        f"below 0.99: " + (", ".join(f"{r['case']} {r.get('peak_phase', '?')} "
                                     f"{r['peak_ratio']:.4f}" for r in rows
                                     if r['peak_ratio'] < 0.99) or "none"),
        f"wall full/short: median {statistics.median(speed):.2f} over the grid (target >= 2), "
        f"{statistics.median(several):.2f} over rows with several units (target >= 4); "
        f"timed steps alone: median {statistics.median(timed):.2f}",
        f"whole probes' steps within 5% of each other: "
        f"{sum(abs(r['probe_step_ratio'] - 1) <= 0.05 for r in rows)} of {len(rows)}",
        f"probes flagged as contended: {sum(r['contended'] for r in rows)}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="whole probes of each mode")
    parser.add_argument("--pairs", type=int, default=3, help="interleaved step pairs")
    parser.add_argument("--interleave", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peaks-again", nargs="+", default=None, metavar="CASE",
                        help="only the phase peaks of these cases, --repeats of each mode "
                             "(writes short_probe_peaks.txt)")
    parser.add_argument("--large", action="store_true", help="add qwen2.5-0.5b")
    parser.add_argument("--only", default=None, help="one case, by name")
    parser.add_argument("--merge", nargs="+", default=None, metavar="CASE",
                        help="run these cases and put their rows into the recorded "
                             "short_probe.json (replacing theirs), then rewrite the report")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: GPU_CASES' interleaved steps only (short_probe_gpu.*)")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "gpu",
                        help="where --device cuda writes")
    args = parser.parse_args()
    if args.interleave:  # the subprocess of interleaved_in_subprocess
        print(json.dumps(interleaved_steps(args.interleave, args.pairs, args.device)))
        return
    if args.device == "cuda":
        gpu_rows(args.out)
        return
    if args.peaks_again:
        text = peaks_again(SubprocessRunner(), args.peaks_again, args.repeats)
        print(text)
        (OUT_DIR / "short_probe_peaks.txt").write_text(text + "\n")
        return
    cases = {**CASES, **(LARGE if args.large else {})}
    if args.only:
        cases = {args.only: cases[args.only]}
    recorded: list[dict] = []
    if args.merge:  # the other rows as recorded, these run now
        cases = {name: cases[name] for name in args.merge}
        recorded = [row for row in json.loads((OUT_DIR / "short_probe.json").read_text())[
            "rows"] if row["case"] not in cases]
    runner = SubprocessRunner()
    rows = []
    for name, case in cases.items():
        row = run_case(runner, name, case, args.repeats, args.pairs)
        print(f"{name}: predicted {row['predicted_step_s']:.3f} s, full {row['full_step_s']:.3f}"
              f" s (whole probes {row['probe_step_ratio']:.3f}), peak ratio "
              f"{row['peak_ratio']:.4f}, wall {row['short_wall_s']:.1f} vs "
              f"{row['full_wall_s']:.1f} s", flush=True)
        rows.append(row)
    order = list(CASES) + list(LARGE)
    rows = sorted(recorded + rows, key=lambda row: order.index(row["case"]))
    text = report(rows, args.repeats, args.pairs)
    if args.merge:
        text += (f"\nrows {', '.join(args.merge)} run {time.strftime('%Y-%m-%d')} and merged "
                 "into the recorded grid")
    print(text)
    if args.only is None:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / "short_probe.txt").write_text(text + "\n")
        (OUT_DIR / "short_probe.json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
