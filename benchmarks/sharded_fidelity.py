"""Emulated against real ranks: does one emulated rank hold what a real rank of W holds?

For each config of a grid (tiny-qwen2.5: update micro-batch x checkpointing x param offload,
12 configs; tiny-qwen2.5-vl: 2 more), the same probe runs twice side by side in one run, W = 2:
as two real gloo ranks (two processes, one core each) and as one emulated rank over the fake
process group (one process, both cores). Per phase it prints the real per-rank peak (max over
ranks), the emulated peak and their ratio, the memory model's prior estimate against both,
each rank's model states against memory.py's states term (which must be exact), and tokens/s
of both modes (emulated time leaves communication out).

    python benchmarks/sharded_fidelity.py [--out DIR] [--quick]

Targets: emulated peak within 10% of real in every phase of every config; memory.py's states
term equal to the measured per-rank states. Writes sharded_fidelity.{txt,json} to
benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from autotune.config import ProbeConfig, format_bytes
from autotune.hardware import Device
from autotune.memory.model import estimate_memory
from autotune.memory.shape import model_shape
from autotune.memory.states import model_state_bytes
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.local import SubprocessRunner

PHASES = ("rollout", "experience", "update")
WORLD = 2
BASE = {"rollout_batch_size": 8, "rollout_n": 4, "global_batch_size": 4,
        "micro_batch_size_experience": 8, "max_prompt_length": 64, "max_response_length": 64}


def grid(quick: bool) -> list[tuple[str, ProbeConfig]]:
    configs = [("tiny-qwen2.5", ProbeConfig(**BASE, micro_batch_size_update=mbu,
                                            gradient_checkpointing=gc, offload_params=off))
               for mbu, gc, off in itertools.product((1, 2, 4), (False, True), (False, True))]
    vl = {**BASE, "max_prompt_length": 96, "image_size_px": 168}
    configs += [("tiny-qwen2.5-vl", ProbeConfig(**vl, micro_batch_size_update=mbu))
                for mbu in (1, 4)]
    return configs[:3] if quick else configs


def probe(model: str, config: ProbeConfig, emulated: bool, where: Path) -> dict:
    request = ProbeRequest(model=model, config=config, device=Device("cpu"), cpu_threads=2,
                           warmup_steps=1, timed_steps=1, timeout_s=600.0, nnodes=1,
                           gpus_per_node=WORLD, emulated=emulated)
    result = SubprocessRunner().run(request, where / f"{'emu' if emulated else 'real'}.log")
    if not result.ok:
        raise SystemExit(f"{model} {config}: {result.status.value}: {result.message}")
    return {"phase_peak_mem_bytes": result.phase_peak_mem_bytes,
            "tokens_per_s": result.tokens_per_s, "states": result.model_state_bytes,
            "rank_peak_mem_bytes": result.rank_peak_mem_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--quick", action="store_true", help="3 configs (a smoke run)")
    args = parser.parse_args()
    started = time.monotonic()
    rows = []
    for model, config in grid(args.quick):
        with tempfile.TemporaryDirectory() as scratch:
            real = probe(model, config, False, Path(scratch))
            emulated = probe(model, config, True, Path(scratch))
        shape = model_shape(model)
        estimate = estimate_memory(shape, config, num_gpus=WORLD, on_gpu=False)
        states_model = model_state_bytes(shape.num_params, WORLD).update_bytes
        row = {"model": model, "config": {k: v for k, v in config.as_dict().items()
                                          if k in ("micro_batch_size_update",
                                                   "gradient_checkpointing", "offload_params")},
               "real": real, "emulated": emulated,
               "estimate": {p: estimate.phases[p].total_bytes for p in PHASES},
               "states_measured": sum(real["states"].values()),
               "states_emulated": sum(emulated["states"].values()),
               "states_model": states_model}
        row["ratio"] = {p: emulated["phase_peak_mem_bytes"][p] / real["phase_peak_mem_bytes"][p]
                        for p in PHASES}
        rows.append(row)
        print(describe(row), flush=True)
    write(rows, args.out, time.monotonic() - started)


def describe(row: dict) -> str:
    config = " ".join(f"{k}={v}" for k, v in row["config"].items())
    phases = "  ".join(
        f"{p} {format_bytes(row['real']['phase_peak_mem_bytes'][p])}/"
        f"{format_bytes(row['emulated']['phase_peak_mem_bytes'][p])} ({row['ratio'][p]:.3f})"
        for p in PHASES)
    return (f"{row['model']:<16}{config:<70} real/emulated {phases}  tok/s "
            f"{row['real']['tokens_per_s']:.0f}/{row['emulated']['tokens_per_s']:.0f}")


def write(rows: list[dict], out: Path, wall_s: float) -> None:
    lines = [f"sharded_fidelity: emulated vs real ranks, W = {WORLD}, CPU (gloo), "
             f"{time.strftime('%Y-%m-%d')}, {len(rows)} configs, {wall_s / 60:.1f} min",
             f"machine: {platform.platform()}, {platform.processor() or 'cpu'}",
             "benchmark: python benchmarks/sharded_fidelity.py", "",
             "per phase: real per-rank peak (max over the 2 ranks) / emulated peak (ratio)"]
    lines += [describe(row) for row in rows]
    lines.append("")
    worst = {p: max(abs(r["ratio"][p] - 1) for r in rows) for p in PHASES}
    median = {p: statistics.median(abs(r["ratio"][p] - 1) for r in rows) for p in PHASES}
    for p in PHASES:
        est_real = statistics.median(
            abs(r["estimate"][p] / r["real"]["phase_peak_mem_bytes"][p] - 1) for r in rows)
        est_emu = statistics.median(
            abs(r["estimate"][p] / r["emulated"]["phase_peak_mem_bytes"][p] - 1) for r in rows)
        lines.append(f"{p:<11} emulated vs real: median {median[p]:.1%}, worst {worst[p]:.1%}"
                     f" (target <= 10%); memory.py prior vs real {est_real:.1%}, "
                     f"vs emulated {est_emu:.1%} (median)")
    exact = sum(r["states_measured"] == r["states_model"] for r in rows)
    exact_emu = sum(r["states_emulated"] == r["states_model"] for r in rows)
    lines.append(f"model states per rank: memory.py exact for {exact}/{len(rows)} real and "
                 f"{exact_emu}/{len(rows)} emulated probes")
    speed = statistics.median(r["emulated"]["tokens_per_s"] / r["real"]["tokens_per_s"]
                              for r in rows)
    lines.append(f"tokens/s emulated / real: median {speed:.2f}x (the emulated rank has both "
                 "cores and no communication; real ranks one core each and gloo)")
    met = all(v <= 0.10 for v in worst.values())
    lines.append(f"verdict: {'target met' if met else 'TARGET MISSED'}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sharded_fidelity.txt").write_text("\n".join(lines) + "\n")
    (out / "sharded_fidelity.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n".join(lines[-6:]))


if __name__ == "__main__":
    main()
