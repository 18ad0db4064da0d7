"""A finalist's focused repeat held to whole probes: the phases it times, timed alone after a
whole warm-up step, against the same phases timed in whole steps, and what it costs.

The finalists re-measure only the phases that separate them (sweep/pick/focused.py): the
timed steps of a focused probe run those phases alone, each on what the last whole step left.
If timing a phase without the others before it moved its time (caches, the allocator's state,
the engine's memory), a focused repeat would move its config against the others; this holds
it. Per case, `--rounds` rounds of a whole probe and a focused one of the same config,
alternating, through the local runner as the sweep runs them (short probes, the sweep's step
counts): the timed phases' seconds, focused over whole, per round; the completed step's
tokens/s over the whole probe's; the timed phases' peaks; each probe's wall.

    python benchmarks/focused_repeat.py [--rounds 3]

Cases: README command 1's demo space (tiny-qwen2.5 at its shapes, under no cap) at the configs
its finalists were (update timed; experience and update), PPO (both updates), LoRA, and a rank
of 4 emulated. Targets: the timed phases within 5% of the whole probes' (their round-to-round
spread given), peaks within 1%. Writes benchmarks/results/focused_repeat.{txt,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult
from autotune.runners.local import SubprocessRunner
from autotune.sweep.pick.focused import completed

OUT_DIR = Path(__file__).parent / "results"
MIN_TIMED_S = 2.0  # the sweep's (sweep/plan.py)
DEMO = dict(rollout_batch_size=4, rollout_n=4, global_batch_size=2, max_prompt_length=64,
            max_response_length=64, offload_optimizer=True)
# name -> (model, config, request changes, timed phases)
CASES: dict[str, tuple[str, dict, dict, tuple[str, ...]]] = {
    "demo mbu2 mbe8 (the pick)": ("tiny-qwen2.5", {**DEMO, "micro_batch_size_update": 2,
                                                   "micro_batch_size_experience": 8}, {},
                                  ("update",)),
    "demo mbu8 mbe8 gc off_p": ("tiny-qwen2.5", {**DEMO, "micro_batch_size_update": 8,
                                                 "micro_batch_size_experience": 8,
                                                 "gradient_checkpointing": True,
                                                 "offload_params": True}, {}, ("update",)),
    "demo mbu4 mbe4, exp+update": ("tiny-qwen2.5", {**DEMO, "micro_batch_size_update": 4,
                                                    "micro_batch_size_experience": 4}, {},
                                   ("experience", "update")),
    "ppo mbu2, both updates": ("tiny-qwen2.5", {**DEMO, "algorithm": "ppo",
                                                "micro_batch_size_update": 2,
                                                "micro_batch_size_experience": 8,
                                                "critic_micro_batch_size_update": 2}, {},
                               ("critic_update", "update")),
    "lora r8 mbu2": ("tiny-qwen2.5", {**DEMO, "lora_rank": 8, "lora_alpha": 16,
                                      "micro_batch_size_update": 2,
                                      "micro_batch_size_experience": 8}, {}, ("update",)),
    "W4 emulated mbu1": ("tiny-qwen2.5", {**DEMO, "rollout_batch_size": 16,
                                          "global_batch_size": 8,
                                          "micro_batch_size_update": 1,
                                          "micro_batch_size_experience": 2},
                         {"gpus_per_node": 4, "emulated": True}, ("update",)),
}


def checked(name: str, result: ProbeResult) -> ProbeResult:
    if not result.ok:
        raise SystemExit(f"{name}: {result.status.value}: {result.message}")
    return result


def run_case(runner: SubprocessRunner, name: str, rounds: int) -> dict:
    model, config, changes, phases = CASES[name]
    request = ProbeRequest(model=model, config=ProbeConfig(**config), device=Device("cpu"),
                           timed_min_s=MIN_TIMED_S, **changes)
    focused_request = dataclasses.replace(request, timed_phases=phases)
    checked(name, runner.run(request))  # the fork server warm for this model
    whole: list[ProbeResult] = []
    focused: list[ProbeResult] = []
    for _ in range(rounds):
        whole.append(checked(name, runner.run(request)))
        focused.append(checked(name, runner.run(focused_request)))

    def timed_s(result: ProbeResult) -> float:
        return sum(result.phase_s[p] for p in phases)

    ratios = [timed_s(f) / timed_s(w) for w, f in zip(whole, focused, strict=True)]
    tokens = [completed(f, w).tokens_per_s / w.tokens_per_s  # type: ignore[operator]
              for w, f in zip(whole, focused, strict=True)]
    peaks = {p: statistics.median(f.phase_peak_mem_bytes[p] for f in focused)
             / statistics.median(w.phase_peak_mem_bytes[p] for w in whole) for p in phases}
    whole_cv = statistics.stdev(timed_s(w) for w in whole) / statistics.fmean(
        timed_s(w) for w in whole) if rounds > 1 else 0.0
    return {"case": name, "timed_phases": list(phases),
            "whole_timed_s": [timed_s(w) for w in whole],
            "focused_timed_s": [timed_s(f) for f in focused],
            "ratio_mean": statistics.fmean(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "whole_cv": whole_cv,
            "tokens_ratio_mean": statistics.fmean(tokens),
            "peak_ratio": peaks,
            "whole_wall_s": statistics.median(w.probe_wall_s or 0.0 for w in whole),
            "focused_wall_s": statistics.median(f.probe_wall_s or 0.0 for f in focused),
            "share_timed": statistics.fmean(timed_s(w) / (w.step_s or 1.0) for w in whole),
            "contended": sum(1 for r in whole + focused if r.contention)}


def report(rows: list[dict], rounds: int) -> str:
    lines = [f"focused repeats vs whole probes, CPU ({time.strftime('%Y-%m-%d')}): {rounds} "
             "rounds of a whole probe and a focused one alternating, per case",
             f"{'case':<28}{'timed':<22}{'share':>6}{'focused/whole':>14}{'range':>12}"
             f"{'whole cv':>9}{'tok/s':>7}{'peak':>8}{'wall':>12}"]
    for row in rows:
        peak = min(row["peak_ratio"].values(), key=lambda r: -abs(r - 1))
        lines.append(
            f"{row['case']:<28}{'+'.join(row['timed_phases']):<22}{row['share_timed']:>6.2f}"
            f"{row['ratio_mean']:>14.3f}{row['ratio_min']:>6.2f}-{row['ratio_max']:<5.2f}"
            f"{row['whole_cv']:>9.3f}{row['tokens_ratio_mean']:>7.3f}{peak:>8.4f}"
            f"{row['whole_wall_s']:>6.1f}/{row['focused_wall_s']:<5.1f}")
    within = sum(abs(r["ratio_mean"] - 1) <= 0.05 for r in rows)
    peaks = sum(all(abs(v - 1) <= 0.01 for v in r["peak_ratio"].values()) for r in rows)
    walls = [r["whole_wall_s"] / r["focused_wall_s"] for r in rows]
    lines += [
        "columns: timed = the phases the focused probe times; share = their share of a whole "
        "step; focused/whole = their seconds in the focused probe over the whole one's (mean "
        "over rounds, each round's pair; range: min-max); whole cv = the whole probes' spread "
        "of those seconds between rounds; tok/s = the completed repeat's tokens/s over the "
        "whole probe's; peak = the timed phases' peak ratio farthest from 1; wall = median "
        "probe wall s, whole/focused",
        f"timed phases within 5% of the whole probes': {within} of {len(rows)}; peaks within "
        f"1%: {peaks} of {len(rows)}; wall whole/focused: median {statistics.median(walls):.2f} "
        f"(range {min(walls):.2f}-{max(walls):.2f})",
        f"probes flagged as contended: {sum(r['contended'] for r in rows)}"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default=None, help="one case, by name")
    args = parser.parse_args()
    names = [args.only] if args.only else list(CASES)
    runner = SubprocessRunner()
    rows = []
    for name in names:
        row = run_case(runner, name, args.rounds)
        print(f"{name}: focused/whole {row['ratio_mean']:.3f} "
              f"({row['ratio_min']:.3f}-{row['ratio_max']:.3f}), wall "
              f"{row['whole_wall_s']:.1f}/{row['focused_wall_s']:.1f} s", flush=True)
        rows.append(row)
    text = report(rows, args.rounds)
    print(text)
    if args.only is None:
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        (OUT_DIR / "focused_repeat.txt").write_text(text + "\n")
        (OUT_DIR / "focused_repeat.json").write_text(json.dumps({"rows": rows}, indent=2)
                                                     + "\n")


if __name__ == "__main__":
    main()
