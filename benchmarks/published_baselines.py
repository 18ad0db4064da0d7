"""EasyR1's published memory figures against `autotune estimate --trainer easyr1`.

The one published per-GPU table with a config: EasyR1's assets/baselines.md (v0.3.2,
Qwen2.5-VL-7B GRPO on geometry3k, 8 x H100 80GB, its default config, vLLM TP 2), rows
"Batch Size" 1/2 and 4/8 (micro-batches for update / experience), reporting "Peak VRAM" 68
and 72 GB and "Peak Mem" (CPU) 120 and 200 GB. EasyR1's own metrics for them are
perf/max_memory_reserved_gb and perf/cpu_memory_used_gb (memory/trainer_figures.py: how
EasyR1 takes each), in GiB; the table calls them GB.

Each row is `autotune estimate --json` with EasyR1's defaults for that run (examples/config.yaml
v0.3.2: prompt and response 2,048, rollout batch 512 x 5, global batch 128, dynamic batching
with padding removed, checkpointing, actor params and optimizer offloaded, the reference
offloaded by FSDP, vLLM at utilisation 0.6 with TP 2 sleeping at level 1, FSDP1) on an H100's
85,520,809,984 bytes, and the figures EasyR1 would log, beside the published ones.

    python benchmarks/published_baselines.py [--out DIR]

Target (issue 48): both figures within 10% of the published ones, and the direction of
change between the rows right. Writes published_baselines.{txt,json} to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

H100_BYTES = 85_520_809_984  # torch.cuda.get_device_properties().total_memory of an H100 80GB
EASYR1_RUN = {"rollout_batch_size": 512, "rollout_n": 5, "global_batch_size": 128,
              "max_prompt_length": 2048, "max_response_length": 2048,
              "dynamic_batching": True, "gradient_checkpointing": True,
              "offload_params": True, "offload_optimizer": True, "use_kl": True,
              "offload_ref_params": True, "rollout_engine": "vllm-like",
              "gpu_memory_utilization": 0.6, "rollout_tensor_parallel": 2, "sleep_level": 1,
              "image_size_px": 448}
ROWS = [  # (name, micro-batches update / experience, published VRAM GB, host GB)
    ("qwen2.5-vl-7b 8xH100 AMP 1/2", 1, 2, 68, 120),
    ("qwen2.5-vl-7b 8xH100 AMP 4/8", 4, 8, 72, 200),
]


def estimate(micro_update: int, micro_experience: int) -> dict:
    knobs = {**EASYR1_RUN, "micro_batch_size_update": micro_update,
             "micro_batch_size_experience": micro_experience}
    argv = [sys.executable, "-m", "autotune", "estimate", "--model", "qwen2.5-vl-7b",
            "--gpus-per-node", "8", "--trainer", "easyr1", "--device", "cuda",
            "--capacity", str(H100_BYTES), "--host-memory", "2TB", "--json"]
    for key, value in knobs.items():
        argv += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    started = time.monotonic()
    rows, lines = [], []
    for name, mbu, mbe, vram, host in ROWS:
        report = estimate(mbu, mbe)
        figures = report["trainer_figures"]
        predicted_vram = figures["perf/max_memory_reserved_gb"]["gib"]
        predicted_host = figures["perf/cpu_memory_used_gb"]["gib"]
        pool = report["phase_bytes"]["rollout"] / 2**30  # rollout: the engine's pool binds
        rows.append({"name": name, "published_vram_gb": vram,
                     "predicted_vram_gb": predicted_vram, "published_host_gb": host,
                     "predicted_host_gb": predicted_host,
                     "phase_gib": {p: round(v / 2**30, 2)
                                   for p, v in report["phase_bytes"].items()},
                     "host_terms_gib": {t: round(v / 2**30, 2) for t, v in
                                        report["node_host"]["terms"]["update"].items()}})
        lines.append(f"{name}: Peak VRAM published {vram}, predicted {predicted_vram:.1f} "
                     f"({predicted_vram / vram - 1:+.0%}); Peak Mem published {host}, "
                     f"predicted {predicted_host:.1f} ({predicted_host / host - 1:+.0%}); "
                     f"card peak by phase (NVML, GiB): {rows[-1]['phase_gib']}, rollout "
                     f"{pool:.1f} with the engine's pool")
    vram_up = rows[1]["predicted_vram_gb"] > rows[0]["predicted_vram_gb"]
    host_up = rows[1]["predicted_host_gb"] > rows[0]["predicted_host_gb"]
    lines += ["", f"direction 1/2 -> 4/8: VRAM published up, predicted "
              f"{'up' if vram_up else 'not up'}; host published up (+80), predicted "
              f"{'up' if host_up else 'not up'} "
              f"({rows[1]['predicted_host_gb'] - rows[0]['predicted_host_gb']:+.1f})"]
    text = [f"published_baselines, {time.strftime('%Y-%m-%d')}, "
            f"{time.monotonic() - started:.0f} s",
            "benchmark: python benchmarks/published_baselines.py (autotune estimate "
            "--trainer easyr1 --json, EasyR1 v0.3.2's defaults; GiB, as EasyR1 logs them)",
            "", *lines]
    print("\n".join(text))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "published_baselines.txt").write_text("\n".join(text) + "\n")
    (out / "published_baselines.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
