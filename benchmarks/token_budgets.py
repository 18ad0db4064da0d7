"""Fixed micro-batches against token budgets of the same worst-case peak (issue 29).

The same trainer step of tiny-qwen2.5 on the CPU, each run in a fresh process: responses end
at sampled lengths (EOS drawn uniformly in 1..2/3 of max_response_length: mean a third of the
max), so fixed micro-batches pad every sequence to the full length while token budgets pack
whole sequences, padding removed, up to `budget` tokens per micro-batch. The budgets are the
fixed micro-batches' own worst case (micro-batch x full sequence length), so with every
response at full length both cut the same micro-batches and hold the same peak; the second
pair of runs checks that. Reported: useful tokens (prompt + response up to its EOS) per second
of the experience and update phases, and those phases' peak device memory (anonymous RSS on
the CPU), side by side, in one run, repeats alternating.

    python benchmarks/token_budgets.py [--repeats 2]

Writes benchmarks/results/token_budgets.txt and .json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

OUT_DIR = Path(__file__).parent / "results"
PROMPT, RESPONSE = 64, 384
MICRO_UPDATE, MICRO_EXPERIENCE = 4, 8


def config(dynamic: bool):  # noqa: ANN201 (torch-free at import)
    from autotune.config import ProbeConfig

    base = ProbeConfig(rollout_batch_size=8, rollout_n=4, global_batch_size=8,
                       micro_batch_size_update=MICRO_UPDATE,
                       micro_batch_size_experience=MICRO_EXPERIENCE,
                       max_prompt_length=PROMPT, max_response_length=RESPONSE, use_kl=True,
                       max_num_seqs=32)
    return replace(base, dynamic_batching=True) if dynamic else base


def one(dynamic: bool, sampled: bool) -> dict[str, float]:
    """One probe process: build, a warm-up step, a timed step; the batched phases' figures."""
    import torch

    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.probe.step.training import TrainingProbe

    class Landscape(TrainingProbe):
        def _response_lengths(self, responses: int) -> torch.Tensor:
            if not sampled:
                return super()._response_lengths(responses)
            generator = torch.Generator().manual_seed(7)
            return torch.randint(1, 2 * RESPONSE // 3 + 1, (responses,), generator=generator)

    request = ProbeRequest(model="tiny-qwen2.5", config=config(dynamic), device=Device("cpu"),
                           cpu_threads=2, warmup_steps=1, timed_steps=1, timeout_s=900.0)
    probe = Landscape(request)
    probe.meter.start()
    probe.build()
    probe.step()
    seconds = probe.step()
    probe.meter.stop()
    useful = int((probe.response_lengths + PROMPT).sum())
    batched_s = seconds["experience"] + seconds["update"]
    peaks = probe.meter.phase_peak_mem_bytes
    return {"tokens_per_s": useful / batched_s, "batched_s": batched_s, "useful_tokens": useful,
            "update_peak_bytes": peaks["update"], "experience_peak_bytes": peaks["experience"],
            "update_rows": probe.ran["update_micro_batch_rows"],
            "experience_rows": probe.ran["experience_micro_batch_rows"]}


def run_child(dynamic: bool, sampled: bool) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--one", str(int(dynamic)),
                          str(int(sampled))], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", nargs=2, type=int)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(bool(args.one[0]), bool(args.one[1]))))
        return
    started = time.perf_counter()
    runs: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.repeats):  # alternating: the machine's drift hits both alike
        for sampled in (True, False):
            for dynamic in (False, True):
                key = f"{'sampled' if sampled else 'full'}-{'budget' if dynamic else 'fixed'}"
                runs.setdefault(key, []).append(run_child(dynamic, sampled))
                print(key, runs[key][-1], flush=True)

    def median(key: str, field: str) -> float:
        return statistics.median(r[field] for r in runs[key])

    lines = [f"token budgets vs fixed micro-batches, tiny-qwen2.5 on the CPU, "
             f"{time.strftime('%Y-%m-%d')}: rollout 8 prompts x 4, one mini-batch of 32, "
             f"prompt {PROMPT} + response {RESPONSE} tokens; fixed micro-batches of "
             f"{MICRO_UPDATE} (update) and {MICRO_EXPERIENCE} (log-prob), budgets of the same "
             f"worst case ({MICRO_UPDATE * (PROMPT + RESPONSE)} and "
             f"{MICRO_EXPERIENCE * (PROMPT + RESPONSE)} tokens); medians of {args.repeats}", ""]
    lines.append(f"{'landscape':<10}{'batching':<10}{'useful tok/s':>14}{'update peak':>14}"
                 f"{'log-prob peak':>15}{'rows u/e':>10}")
    for key in runs:
        landscape, batching = key.split("-")
        lines.append(f"{landscape:<10}{batching:<10}{median(key, 'tokens_per_s'):>14.0f}"
                     f"{median(key, 'update_peak_bytes') / 2**20:>10.0f} MiB"
                     f"{median(key, 'experience_peak_bytes') / 2**20:>11.0f} MiB"
                     f"{median(key, 'update_rows'):>6.0f}/{median(key, 'experience_rows'):.0f}")
    ratios = {
        "sampled_tokens_per_s_ratio": median("sampled-budget", "tokens_per_s")
        / median("sampled-fixed", "tokens_per_s"),
        "sampled_update_peak_ratio": median("sampled-budget", "update_peak_bytes")
        / median("sampled-fixed", "update_peak_bytes"),
        "full_update_peak_ratio": median("full-budget", "update_peak_bytes")
        / median("full-fixed", "update_peak_bytes"),
        "full_experience_peak_ratio": median("full-budget", "experience_peak_bytes")
        / median("full-fixed", "experience_peak_bytes")}
    lines += ["", f"sampled lengths (mean a third of the max): token budgets run "
                  f"{ratios['sampled_tokens_per_s_ratio']:.2f}x the useful tokens/s of fixed "
                  f"micro-batches at {ratios['sampled_update_peak_ratio']:.2f}x their update "
                  "peak",
              f"every response at full length: the same micro-batches, update peak ratio "
              f"{ratios['full_update_peak_ratio']:.3f}, log-prob peak ratio "
              f"{ratios['full_experience_peak_ratio']:.3f}",
              f"({time.perf_counter() - started:.0f} s)"]
    text = "\n".join(lines) + "\n"
    print(text)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "token_budgets.txt").write_text(text)
    (OUT_DIR / "token_budgets.json").write_text(json.dumps({"runs": runs, **ratios}, indent=1))


if __name__ == "__main__":
    main()
