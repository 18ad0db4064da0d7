"""Length headroom against real probes (issue 29): does a config fit at the response length
autotune says it fits up to, and run out of memory one step above it?

For each config of tiny-qwen2.5 on the CPU: a real probe at a short length (no cap) gives the
measured peaks; the memory model, anchored on them as the sweep anchors a probed config
(sweep/feasibility/study_model.py), predicts the peak at 4x the length, and that becomes the
memory cap. The length headroom under that cap is then bisected, and two real probes run under
the cap: at the predicted length (should fit) and one step (a quarter of it) above (should run
out).

    python benchmarks/length_headroom.py

Writes benchmarks/results/length_headroom.txt and .json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from autotune.config import ProbeConfig, format_bytes
from autotune.hardware import Device
from autotune.memory.length import at_length, length_headroom
from autotune.memory.model import estimate_memory
from autotune.memory.shape import model_shape
from autotune.memory.verdict import phase_totals
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.local import SubprocessRunner
from autotune.sweep.feasibility.prescreen import memory_model_args

OUT_DIR = Path(__file__).parent / "results"
SHORT = 64
BASE = ProbeConfig(rollout_batch_size=4, rollout_n=4, global_batch_size=4,
                   max_prompt_length=64, max_response_length=SHORT, max_num_seqs=16)
CONFIGS = {
    "mbu=4 mbe=8": dataclasses.replace(BASE, micro_batch_size_update=4,
                                       micro_batch_size_experience=8),
    "mbu=8 mbe=16 gc": dataclasses.replace(BASE, micro_batch_size_update=8,
                                           micro_batch_size_experience=16,
                                           gradient_checkpointing=True),
    "mbu=16 mbe=16": dataclasses.replace(BASE, micro_batch_size_update=16,
                                         micro_batch_size_experience=16),
}


def probe(config: ProbeConfig, limit_bytes: int | None) -> dict:
    request = ProbeRequest(model="tiny-qwen2.5", config=config,
                           device=Device("cpu", None, limit_bytes), cpu_threads=2,
                           warmup_steps=0, timed_steps=1, timeout_s=900.0)
    result = SubprocessRunner().run(request)
    return {"status": result.status.value, "peak_mem_bytes": result.peak_mem_bytes,
            "phase_peak_mem_bytes": result.phase_peak_mem_bytes}


def main() -> None:
    started = time.perf_counter()
    shape = model_shape("tiny-qwen2.5")
    rows, lines = [], [f"length headroom against real probes, tiny-qwen2.5 on the CPU, "
                       f"{time.strftime('%Y-%m-%d')}: measured at {SHORT}-token responses, "
                       "capped at the anchored model's peak at 4x that length", ""]
    for name, config in CONFIGS.items():
        request = ProbeRequest(model="tiny-qwen2.5", config=config, device=Device("cpu"))
        args = memory_model_args(request)
        short = probe(config, None)
        measured = short["phase_peak_mem_bytes"]
        model_here = phase_totals(estimate_memory(shape, config, **args), None)
        gap = {phase: measured[phase] - model_here[phase] for phase in measured}

        def peaks(other: ProbeConfig, gap: dict = gap, args: dict = args) -> dict[str, int]:
            return {phase: value + gap.get(phase, 0) for phase, value in
                    phase_totals(estimate_memory(shape, other, **args), None).items()}

        cap = max(peaks(at_length(config, 4 * SHORT)).values())
        reach = length_headroom(config, peaks, cap, shape.context_tokens)
        step = max(1, reach.fits_up_to // 4)
        at = probe(at_length(config, reach.fits_up_to), cap)
        above = probe(at_length(config, reach.fits_up_to + step), cap)
        agree = at["status"] == "ok" and above["status"] == "gpu_oom"
        rows.append({"config": name, "cap_bytes": cap, "fits_up_to": reach.fits_up_to,
                     "step": step, "short": short, "at": at, "above": above, "agree": agree})
        line = (f"{name:<18} cap {format_bytes(cap):>9}: predicted to fit up to "
                f"{reach.fits_up_to} tokens; probe at {reach.fits_up_to}: {at['status']} "
                f"({format_bytes(at['peak_mem_bytes'])}), at {reach.fits_up_to + step}: "
                f"{above['status']} -> {'as predicted' if agree else 'NOT as predicted'}")
        lines.append(line)
        print(line, flush=True)
    lines += ["", f"{sum(r['agree'] for r in rows)} of {len(rows)} as predicted "
                  f"({time.perf_counter() - started:.0f} s)"]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "length_headroom.txt").write_text(text)
    (OUT_DIR / "length_headroom.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
