"""The node's host memory against what users reported (issue 31): held-back cases.

Each case is a run someone reported with its node's host memory (a measured peak, or a run
Ray's memory monitor killed), as far as the report gives its config; the rest is the trainer's
default (EasyR1's examples/config.yaml, verl's ppo_trainer.yaml). For each, memory/host.py's
node total and verdict, with offload as reported and with it off, beside what was reported.
Nothing here was fitted to these cases.

    python benchmarks/host_memory_cases.py

Writes benchmarks/results/host_memory_cases.txt and .json.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from autotune.config import ProbeConfig, format_bytes
from autotune.memory.host import NodeRun, node_host
from autotune.memory.shape import model_shape

OUT_DIR = Path(__file__).parent / "results"
GB = 10**9

# EasyR1's examples/config.yaml for Qwen2.5-VL-7B (assets/baselines.md: rollout batch 512,
# n 5, global batch 128, prompt and response 2048, vLLM TP 2 sleeping at level 1, actor and
# reference offloaded)
EASYR1_VL7B = ProbeConfig(rollout_batch_size=512, rollout_n=5, global_batch_size=128,
                          micro_batch_size_update=4, micro_batch_size_experience=8,
                          max_prompt_length=2048, max_response_length=2048,
                          rollout_engine="vllm-like", rollout_tensor_parallel=2,
                          gpu_memory_utilization=0.6, sleep_level=1, offload_params=True,
                          offload_optimizer=True, offload_ref_params=True, image_size_px=448,
                          fsdp_strategy="fsdp")  # EasyR1 and verl's default: FSDP1

CASES = [
    {"case": "EasyR1 baselines, Qwen2.5-VL-7B, 8xH100, micro 1/2",
     "source": "hiyouga/EasyR1 assets/baselines.md (peak CPU memory)",
     "model": "qwen2.5-vl-7b", "trainer": "easyr1", "gpus": 8, "host_gb": 2000,
     "config": dataclasses.replace(EASYR1_VL7B, micro_batch_size_update=1,
                                   micro_batch_size_experience=2),
     "reported": "ran; peak CPU memory 120 GB", "reported_gb": 120, "killed": False},
    {"case": "EasyR1 baselines, Qwen2.5-VL-7B, 8xH100, micro 4/8",
     "source": "hiyouga/EasyR1 assets/baselines.md (peak CPU memory)",
     "model": "qwen2.5-vl-7b", "trainer": "easyr1", "gpus": 8, "host_gb": 2000,
     "config": EASYR1_VL7B, "reported": "ran; peak CPU memory 200 GB", "reported_gb": 200,
     "killed": False},
    {"case": "EasyR1, Qwen2.5-VL-7B, 8xA100-40GB, param and optimizer offload",
     "source": "issue 31 (726 of 760 GB used when Ray killed a worker)",
     "model": "qwen2.5-vl-7b", "trainer": "easyr1", "gpus": 8, "host_gb": 760,
     "config": EASYR1_VL7B, "reported": "killed by Ray at 726 of 760 GB", "reported_gb": 726,
     "killed": True},
    {"case": "verl, Qwen2.5-VL-7B GRPO, 8 GPUs, 8 workers x ~30 GB",
     "source": "verl-project/verl#5206 (ran after going to 4 GPUs and smaller batches)",
     "model": "qwen2.5-vl-7b", "trainer": "verl", "gpus": 8, "host_gb": 256,
     "config": dataclasses.replace(EASYR1_VL7B, sleep_level=2),
     "reported": "killed by Ray, ~240 GB in 8 workers (node size not given: 256 GB assumed)",
     "reported_gb": 240, "killed": True},
]


def main() -> None:
    rows = []
    for case in CASES:
        shape = model_shape(case["model"])
        run = NodeRun(case["gpus"], case["gpus"], True, 2, case["trainer"])
        config = case["config"]
        off = dataclasses.replace(config, offload_params=False, offload_optimizer=False,
                                  offload_ref_params=False)
        host = node_host(shape, config, run, case["host_gb"] * GB)
        without = node_host(shape, off, run, case["host_gb"] * GB)
        rows.append({"case": case["case"], "source": case["source"],
                     "reported": case["reported"], "reported_killed": case["killed"],
                     "node_bytes": host.peak_bytes, "binding_phase": host.binding_phase,
                     "kill_bytes": host.kill_bytes, "predicted_host_oom": host.host_oom,
                     "verdict_matches": host.host_oom == case["killed"],
                     "model_over_reported": host.peak_bytes / (case["reported_gb"] * GB),
                     "terms": host.phases[host.binding_phase],
                     "offload_off_node_bytes": without.peak_bytes,
                     "offload_off_host_oom": without.host_oom})
    lines = [f"node host memory against reported runs ({time.strftime('%Y-%m-%d')}); "
             "memory/host.py, nothing fitted to these", ""]
    for row in rows:
        lines += [f"{row['case']}  [{row['source']}]",
                  f"  reported: {row['reported']}",
                  f"  modelled: {format_bytes(row['node_bytes'])} at {row['binding_phase']} "
                  f"({row['model_over_reported']:.2f}x the reported figure); "
                  f"{'predicted host_oom' if row['predicted_host_oom'] else 'fits'} against "
                  f"{format_bytes(row['kill_bytes'])} -> verdict "
                  f"{'matches' if row['verdict_matches'] else 'DOES NOT match'} the report",
                  f"  offload off: {format_bytes(row['offload_off_node_bytes'])}, "
                  f"{'predicted host_oom' if row['offload_off_host_oom'] else 'fits'}",
                  "  terms: " + ", ".join(f"{k} {format_bytes(v)}"
                                          for k, v in row["terms"].items()), ""]
    matched = sum(row["verdict_matches"] for row in rows)
    lines.append(f"verdicts matching the reports: {matched} of {len(rows)}")
    text = "\n".join(lines)
    print(text)
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "host_memory_cases.txt").write_text(text + "\n")
    (OUT_DIR / "host_memory_cases.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
