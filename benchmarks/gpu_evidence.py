"""GPU evidence in one command (under 10 minutes on one H100/H200): real probes of the
registry models, a real OOM, memory and throughput figures against the memory model.

    python benchmarks/gpu_evidence.py [--out benchmarks/results/gpu]

- qwen2.5-0.5b, real, one GPU: a plain config and one with both offloads (HF generation),
  and the vllm-like engine at gpu_memory_utilization 0.3 and 0.6 (its reservation, pool and
  concurrency against the rollout's torch.cuda reserved peak);
- qwen2.5-7b and qwen2.5-vl-7b as emulated rank 0 of a W = 8 FSDP run on the one GPU (the
  rank's shards, gathered units, activations, logits, AdamW and the rollout engine's whole
  bf16 copy are real allocations; collectives move no data);
- a real OOM: qwen2.5-7b's rank under a 24 GiB cap (--gpu-memory-limit), which its model
  states and engine copy alone exceed;
- the 7B rank with verl's allocator (expandable_segments: on outside the rollout), with
  fused_logprob (against "7b rank0/8 mbu8", the same micro-batches unfused; with the torch
  chunks and with verl's Triton kernel where verl is installed), and a PPO probe
  of qwen2.5-0.5b (the critic's states and its update phase);
- per phase, NVML's peak, torch's reserved peak and torch's allocated peak: the traced
  tensors are held to the last, the rest is the CUDA context and the allocator's slack;
- what each probe pins on the host against the node model's held terms (memory/host.py);
- every case traced beside it (`autotune estimate --trace`: the probe's own step under fake
  tensors, on this machine's CPU cores, in parallel with the probes): traced per phase (the
  tensors plus memory.py's 1 GiB GPU fixed term) against measured, and what the GPU held
  beyond the traced tensors (the caching allocator's reserve, cuBLAS's workspaces among it,
  and the CUDA context outside torch);
- when trl is installed: the built-in probe against real TRL at the same shapes
  (benchmarks/trainer_fidelity.py --gpu, rows FIDELITY_ROWS, as the deadline allows), then a
  command sweep (`autotune run --trainer trl --launch ...`) of TRL's
  GRPOTrainer on the qwen2.5-0.5b architecture (random weights, a tokenizer built here), 3
  probes over per_device_train_batch_size 8, 32 and 256 with and without checkpointing, the
  largest a real CUDA OOM of the whole card.

Each row: status, the phase an OOM hit, tokens/s, per-phase peaks against memory.py's prior
estimate for the same rank, and model states against memory.py's exact term. Writes
gpu_evidence.txt and .json, naming the device, after every case: a run cut short by
--deadline-s (default 540 s: no case starts later, each probe's timeout ends by it) keeps
every case it finished; --cases picks some by label. Without an NVIDIA GPU it says so and
exits 0 (it is not part of CI). `--holdout N` runs only issue 67's held-out rows
(benchmarks/gpu_holdout.py: drawn, predicted and written, then probed). `--noise cuda` runs
only issue 49's noise experiment (three 0.5B configs, 5 interleaved repeats each, quiet and
beside a pool of traces: the coefficient of variation of each, and which probes were flagged
contended), into gpu_noise.{txt,json}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from autotune.config import ProbeConfig, format_bytes
from autotune.hardware import Device, gpu_capacity_bytes, gpu_name, has_nvidia_gpu
from autotune.memory.host import NodeRun, node_host
from autotune.memory.model import estimate_memory
from autotune.memory.shape import model_shape
from autotune.memory.states import model_state_bytes
from autotune.probe.measure.meter import SNAPSHOT_ENV
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.local import SubprocessRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_holdout  # noqa: E402  (README command 1's row, one declaration)

SHAPES = {"max_prompt_length": 512, "max_response_length": 256, "rollout_n": 4}
SMALL = {"rollout_batch_size": 16, "global_batch_size": 8, "micro_batch_size_update": 8,
         "micro_batch_size_experience": 16}
BIG = {"rollout_batch_size": 16, "global_batch_size": 16, "micro_batch_size_experience": 4,
       "gradient_checkpointing": True}
SNAPSHOTS = "snapshots"  # a case whose label ends in "snapshot": segment maps per phase
EASYR1_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False",
              "TORCH_NCCL_AVOID_RECORD_STREAMS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
CASES = [  # (label, model, world, emulated, knobs, gpu memory limit[, worker env]); most
    # wanted first, so a run cut short by --deadline-s still has them. Issue 48's first: the
    # allocator's segment maps at each phase's end (the 0.5B update the replay under-counts
    # by one logits-sized block; the 7B update with expandable segments off and on), FSDP1
    # ranks (EasyR1 under its allocator environment)
    # issue 51: LoRA (peft's adapters, the base frozen, no reference copy) and Ulysses SP 4
    ("7b rank0/8 lora", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 2, "lora_rank": 64}, None),
    ("7b rank0/8 sp4", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 2, "ulysses_sequence_parallel_size": 4}, None),
    ("0.5b plain snapshot", "qwen2.5-0.5b", 1, False, {**SMALL}, None),
    ("7b rank0/8 snapshot", "qwen2.5-7b", 8, True, {**BIG, "micro_batch_size_update": 2},
     None),
    ("7b rank0/8 expandable snapshot", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 2, "expandable_segments": True}, None),
    ("7b rank0/8 fsdp1 easyr1", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 2, "fsdp_strategy": "fsdp"}, None, EASYR1_ENV),
    ("0.5b plain", "qwen2.5-0.5b", 1, False, {**SMALL}, None),
    ("7b rank0/8 ckpt", "qwen2.5-7b", 8, True, {**BIG, "micro_batch_size_update": 2}, None),
    ("7b rank0/8 OOM", "qwen2.5-7b", 8, True, {**BIG, "micro_batch_size_update": 2},
     24 * 2**30),
    # verl's allocator (the knob): expandable segments outside the rollout
    ("7b rank0/8 verl alloc", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 2, "expandable_segments": True}, None),
    # PPO: the critic's states and its own update phase on a real GPU
    ("0.5b ppo", "qwen2.5-0.5b", 1, False,
     {**SMALL, "algorithm": "ppo", "rollout_n": 1, "critic_micro_batch_size_update": 8,
      "critic_gradient_checkpointing": True}, None),
    # fused_logprob: the 7B rank's micro-batch of 8 with a 512-token chunk of logits at a time
    ("7b rank0/8 fused", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 8, "micro_batch_size_experience": 8,
      "fused_logprob": True}, None),
    # the same with verl's Triton kernel (fused_logprob_kernel=triton): runs where verl and
    # Triton are installed on the device; elsewhere the probe fails saying so
    ("7b rank0/8 fused triton", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 8, "micro_batch_size_experience": 8,
      "fused_logprob": True, "fused_logprob_kernel": "triton"}, None),
    # the vllm-like engine at two utilisations: rollout peak against torch.cuda's reserved
    # peak and against the trainer's states at wake-up plus the reservation
    ("0.5b vllm 0.3", "qwen2.5-0.5b", 1, False,
     {**SMALL, "rollout_engine": "vllm-like", "gpu_memory_utilization": 0.3}, None),
    ("vl-7b rank0/8", "qwen2.5-vl-7b", 8, True, {**BIG, "micro_batch_size_update": 2}, None),
    ("0.5b offload", "qwen2.5-0.5b", 1, False,
     {**SMALL, "offload_params": True, "offload_optimizer": True}, None),
    ("7b rank0/8 mbu8", "qwen2.5-7b", 8, True,
     {**BIG, "micro_batch_size_update": 8, "micro_batch_size_experience": 8}, None),
    ("0.5b vllm 0.6", "qwen2.5-0.5b", 1, False,
     {**SMALL, "rollout_engine": "vllm-like", "gpu_memory_utilization": 0.6}, None),
    # issue 67: README command 1's first probe (gpu_holdout.README_ROW), its update 7.3% over
    # the traced replay with the tensors within 1%: each phase's segment map, to find the
    # block. Last, so a default run rarely reaches it; run it with --cases (a full probe took
    # 205 s on the H200).
    ("readme 0.5b w1 snapshot", "qwen2.5-0.5b", 1, False, gpu_holdout.README_ROW["knobs"],
     None),
]


def case_request(case: tuple) -> ProbeRequest:
    label, model, world, emulated, knobs, limit = case[:6]
    env = case[6] if len(case) > 6 else {}
    return ProbeRequest(model=model, config=ProbeConfig(**{**SHAPES, **knobs}),
                        device=Device("cuda", limit_bytes=limit), gpu_ids=(0,), warmup_steps=1,
                        timed_steps=1, timeout_s=240.0, nnodes=1, gpus_per_node=world,
                        emulated=emulated, env=dict(env))


def trace_case(case: tuple, capacity_bytes: int | None) -> dict:
    """The case's probe traced on the CPU (fake tensors), in a process of the pool's."""
    import torch

    from autotune.probe.trace import trace_request
    from autotune.probe.worker import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(1)
    try:
        request = case_request(case)
        device = request.device.with_capacity(capacity_bytes)
        traced = trace_request(dataclasses.replace(request, device=device), 0)
    except Exception as exc:  # said in the table; the probes go on
        first = (str(exc).splitlines() or [""])[0]
        return {"error": f"{type(exc).__name__}: {first[:200]}"}
    return {"phase_tensor_bytes": traced.phase_tensor_bytes,
            "phase_reserved_bytes": traced.phase_reserved_bytes,
            "fits_under_bytes": traced.fits_under_bytes, "allocator": traced.allocator,
            "trace_s": traced.trace_s}


def describe_trace(row: dict) -> str:
    """Per phase the prediction (the trace's allocations replayed through the caching
    allocator, plus what this probe held outside torch: NVML less its reserved peak) against
    NVML's peak, the replayed reserve against torch's, the traced tensors against torch's
    allocated peak."""
    traced = row.get("traced") or {}
    if "error" in traced or not traced:
        return f"{row['label']:<17}trace: {traced.get('error', 'none')}"
    reserved = traced["phase_reserved_bytes"]
    if row["status"] != "ok":
        return (f"{row['label']:<17}trace {traced['trace_s']:.0f} s: replayed reserve peak "
                f"{format_bytes(max(reserved.values()))}, runs under no cap below "
                f"{format_bytes(traced['fits_under_bytes'])}; the probe: {row['status']} in "
                f"{row['failed_phase']}")
    parts = []
    for phase, nvml in row["phase_peak_mem_bytes"].items():
        if phase not in reserved:
            continue
        torch_reserved = row["phase_allocator_peak_bytes"].get(phase, 0)
        allocated = row.get("phase_tensor_peak_bytes", {}).get(phase) or 1
        predicted = reserved[phase] + nvml - torch_reserved
        tensors = traced["phase_tensor_bytes"][phase]
        parts.append(f"{phase} {format_bytes(predicted)} vs {format_bytes(nvml)} "
                     f"({(predicted - nvml) / nvml:+.1%}; reserve replayed "
                     f"{format_bytes(reserved[phase])} vs {format_bytes(torch_reserved)}, "
                     f"tensors traced {(tensors - allocated) / allocated:+.1%})")
    return f"{row['label']:<17}trace {traced['trace_s']:.0f} s: " + "  ".join(parts)


def run_case(case: tuple, where: Path, timeout_s: float, snapshots: Path | None = None,
             limit_bytes: int | None = None) -> dict:
    label, model, world, emulated, knobs, limit = case[:6]
    request = dataclasses.replace(case_request(case),
                                  timeout_s=min(case_request(case).timeout_s, timeout_s))
    if limit_bytes is not None:  # torch's allowed reserve (set_per_process_memory_fraction)
        limit = limit_bytes
        request = dataclasses.replace(request, device=Device("cuda", limit_bytes=limit))
    config = request.config
    if label.endswith("snapshot") and snapshots is not None:  # kept with the results
        folder = snapshots / label.replace(" ", "_").replace("/", "_")
        request = dataclasses.replace(request, env={**request.env,
                                                    SNAPSHOT_ENV: str(folder.resolve())})
    result = SubprocessRunner().run(request, where / f"{label.replace(' ', '_')}.log")
    shape = model_shape(model)
    estimate = estimate_memory(shape, config, num_gpus=world, on_gpu=True,
                               engine_capacity_bytes=limit or result.device_capacity_bytes or 0)
    return {"label": label, "model": model, "world_size": world, "emulated": emulated,
            "limit_bytes": limit, "status": result.status.value,
            "failed_phase": result.failed_phase, "message": result.message[:300],
            "tokens_per_s": result.tokens_per_s, "step_s": result.step_s,
            "phase_peak_mem_bytes": result.phase_peak_mem_bytes,
            "phase_allocator_peak_bytes": result.phase_allocator_peak_bytes,
            "phase_tensor_peak_bytes": result.phase_tensor_peak_bytes,
            "engine": result.engine,
            "estimate_bytes": {p: e.total_bytes for p, e in estimate.phases.items()},
            "model_state_bytes": result.model_state_bytes,
            # what the probe pinned on the host (PyTorch's host allocator, power-of-two blocks)
            # against the node model's held terms for this rank (memory/host.py)
            "host_held_peak_bytes": result.host_held_peak_bytes,
            "host_held_model_bytes": node_host(shape, config, NodeRun(1, world, True, 2),
                                               2**50).rank_held_bytes,
            "states_model_bytes": model_state_bytes(
                shape.num_params + (lora := shape.lora_params(config.lora_rank,
                                                              config.lora_target_modules)),
                world, trained_params=lora if config.uses_lora else None).update_bytes + (
                model_state_bytes(shape.critic_params, world).update_bytes
                if config.has_critic else 0),
            "build_s": result.build_s, "probe_wall_s": result.probe_wall_s,
            "num_alloc_retries": result.num_alloc_retries,
            "fsdp_strategy": result.fsdp_strategy, "allocator": result.allocator,
            "device": result.device_name, "versions": result.versions,
            "stderr_tail": "" if result.ok else result.stderr_tail[-1500:]}


CAP_CASES = ("0.5b plain", "7b rank0/8 mbu8")  # each probed just above and below its
CAP_STEPS = (1.02, 0.96)  # replayed smallest cap: the first should run, the second OOM


def cap_bisection(traces: dict[str, dict], where: Path, left_s: Callable[[], float]
                  ) -> list[str]:
    """Each CAP_CASES case probed under a cap (torch's allowed reserve) just above and just
    below the smallest the replay runs its stream under: whether it ran, where an OOM hit,
    and how often torch's allocator freed its cache and retried."""
    lines = ["cap bisection (--gpu-memory-limit: torch's allowed reserve) around the "
             "replayed smallest cap:"]
    for label in CAP_CASES:
        traced = traces.get(label) or {}
        fits = traced.get("fits_under_bytes")
        if not fits:
            lines.append(f"  {label}: no trace ({traced.get('error', 'not traced')})")
            continue
        case = next(c for c in CASES if c[0] == label)
        for step in CAP_STEPS:
            if left_s() < 75:
                lines.append(f"  {label} at {step:.2f}x: skipped, {left_s():.0f} s left")
                continue
            row = run_case(case, where, timeout_s=left_s(), limit_bytes=int(fits * step))
            reserved = max(row["phase_allocator_peak_bytes"].values(), default=0)
            lines.append(f"  {label} at {step:.2f}x the replayed {format_bytes(fits)} "
                         f"({format_bytes(int(fits * step))}): {row['status']}"
                         + (f" in {row['failed_phase']}" if row["failed_phase"] else "")
                         + f", reserved peak {format_bytes(reserved)}, "
                         f"num_alloc_retries {row['num_alloc_retries']}")
            print(lines[-1], flush=True)
    return lines


def describe(row: dict) -> str:
    head = f"{row['label']:<17}{row['status']:<9}"
    if row["status"] != "ok":
        return head + f"in {row['failed_phase']}: {row['message'][:160]}"
    phases = "  ".join(f"{p} {format_bytes(v)} (est {format_bytes(row['estimate_bytes'][p])})"
                       for p, v in row["phase_peak_mem_bytes"].items())
    states = sum(row["model_state_bytes"].values())
    engine = row["engine"]
    if engine:  # vllm-like: what the engine reserved and what the rollout held
        head += (f"[engine: reserved {format_bytes(engine['reserved_bytes'])}, pool "
                 f"{format_bytes(engine['kv_pool_bytes'])}, {engine['concurrency']} seqs at "
                 f"once; rollout torch reserved "
                 f"{format_bytes(row['phase_allocator_peak_bytes'].get('rollout'))}, states at "
                 f"wake + reservation "
                 f"{format_bytes(engine['wake_used_bytes'] + engine['reserved_bytes'])}]  ")
    host = (f"  host held {format_bytes(row['host_held_peak_bytes'])} (host.py "
            f"{format_bytes(row['host_held_model_bytes'])})"
            if row.get("host_held_model_bytes") else "")
    return (head + f"{row['tokens_per_s']:,.0f} tok/s  {phases}  states "
            f"{format_bytes(states)} (memory.py {format_bytes(row['states_model_bytes'])})  "
            f"build {row['build_s']:.0f} s{host}")


TRL_SPACE = """\
params:
  micro_batch_size_update: {type: categorical, choices: [8, 32, 256]}
  gradient_checkpointing: {type: bool}
"""


def _find_spec(util, name: str) -> object:
    try:
        return util.find_spec(name)
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        return None


def missing_for_trl() -> list[str]:
    """What a real TRL run probed by autotune needs that this Python lacks."""
    import importlib.util

    needed = ("trl", "optuna", "ruamel.yaml", "click", "yaml", "psutil", "rich")  # the CLI's too
    return [name for name in needed if _find_spec(importlib.util, name) is None]


FIDELITY_ROWS = ("base beta=0.04", "mbu 2x beta=0.0", "resp 2x beta=0.04")


def trl_fidelity(deadline_s: float) -> list[str]:
    """The built-in probe against real TRL's GRPOTrainer at the same shapes on this GPU
    (benchmarks/trainer_fidelity.py, qwen2.5-0.5b): the table's lines."""
    missing = missing_for_trl()
    if missing:
        return [f"trl fidelity: {', '.join(missing)} not installed here (carry their wheels); "
                "skipped"]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trainer_fidelity as fidelity

    setup = fidelity.gpu_setup()
    results, baselines = fidelity.compare(setup, list(FIDELITY_ROWS), deadline_s,
                                          echo=lambda line: print(line, flush=True))
    return fidelity.table(setup, results, baselines)


def trl_command_sweep(where: Path, timeout_s: float) -> list[str]:
    """TRL's own GRPOTrainer probed by `run --launch` on the GPU: the study's lines."""
    import subprocess

    missing = missing_for_trl()
    if missing:
        return [f"trl command sweep: {', '.join(missing)} not installed here (carry their "
                f"wheels); skipped"]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from trl_fixture import make_trl_workspace

    from autotune.registry import get_model_spec

    numbers = {key: value for key, value in get_model_spec("qwen2.5-0.5b").text_config.items()
               if not key.endswith("token_id")}  # the tokenizer built here names its own
    workspace = make_trl_workspace(
        where / "trl", vocab_size=16384, architecture=numbers, use_cpu=False, bf16=True,
        model_init_kwargs={"dtype": "bfloat16"}, per_device_train_batch_size=8,
        num_generations=8, gradient_accumulation_steps=32, max_completion_length=512)
    space = where / "trl-space.yaml"
    space.write_text(TRL_SPACE)
    launch = f"{sys.executable} {workspace.script} --config {{config}}"
    argv = [sys.executable, "-m", "autotune", "run", "--trainer", "trl", "--base-config",
            str(workspace.config), "--launch", launch, "--space", str(space), "--trials", "3",
            "--gpus", "0", "--results-dir", str(where / "results"), "--study", "trl-gpu",
            "--probe-timeout", "150s"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        out = (done.stdout + done.stderr).strip().splitlines()
    except subprocess.TimeoutExpired as stopped:  # what it printed before --deadline-s
        printed = [part.decode() if isinstance(part, bytes) else part or ""
                   for part in (stopped.stdout, stopped.stderr)]
        out = [*"".join(printed).strip().splitlines(),
               f"(stopped at --deadline-s after {timeout_s:.0f} s)"]
    return ["trl command sweep (qwen2.5-0.5b architecture, TRL GRPOTrainer, 512 tokens):",
            *out[-25:]]


def traced_or_error(trace: Future, timeout_s: float) -> dict:
    """A trace's figures, or why there are none (still running at the deadline, a dead pool
    process): said in the table, never raised."""
    try:
        return trace.result(timeout=timeout_s)
    except TimeoutError:
        return {"error": "the trace did not finish inside --deadline-s"}
    except Exception as exc:  # noqa: BLE001 - a broken pool process, said in the table
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def write_results(out: Path, rows: list[dict], started: float, tail: list[str]) -> None:
    """The text and JSON files as they stand (rewritten after every case, so a run stopped
    early still leaves every case it finished)."""
    device = next((r["device"] for r in rows if r["device"]), None) or gpu_name(0)
    versions = rows[0]["versions"] if rows else {}
    lines = [f"gpu_evidence on {device}, {time.strftime('%Y-%m-%d')}, "
             f"{(time.monotonic() - started) / 60:.1f} min",
             f"machine: {platform.platform()}; versions {json.dumps(versions)}",
             "benchmark: python benchmarks/gpu_evidence.py", ""]
    lines += [describe(row) for row in rows]
    lines += ["", "predicted per phase (the step traced with fake tensors on the CPU, its "
                  "allocations replayed through the caching allocator, plus what the probe "
                  "held outside torch) vs NVML's peak; the replayed reserve vs torch's "
                  "reserved peak; the traced tensors vs torch's allocated peak:",
              *(describe_trace(row) for row in rows if "traced" in row), *tail]
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_evidence.txt").write_text("\n".join(lines) + "\n")
    (out / "gpu_evidence.json").write_text(json.dumps(rows, indent=1) + "\n")


NOISE_CONFIGS = {  # issue 49: three 0.5B configs, each probed NOISE_REPEATS times round robin
    "0.5b plain": {**SMALL},
    "0.5b mbu4": {**SMALL, "micro_batch_size_update": 4},
    "0.5b checkpointed": {**SMALL, "gradient_checkpointing": True},
}
NOISE_REPEATS = 5
NOISE_MODEL, NOISE_SHAPES = "qwen2.5-0.5b", SHAPES


def noise_repeats(device: str, left_s: Callable[[], float], repeats: int = NOISE_REPEATS
                  ) -> dict:
    """Each NOISE_CONFIGS config probed `repeats` times, interleaved, quiet and then with
    traces running beside the probes (a pool of trace processes on the CPU, as the old
    evidence run did): each probe's tokens/s, its step spread and contention flag, and each
    config's coefficient of variation over its repeats in each condition."""
    import statistics

    from autotune.probe.measure.result import coefficient_of_variation

    runner = SubprocessRunner()
    out: dict = {"repeats": repeats, "conditions": {}}
    for condition in ("quiet", "beside traces"):
        pool = None
        if condition == "beside traces":
            pool = ProcessPoolExecutor(max_workers=8, mp_context=get_context("spawn"))
            for case in CASES[:8]:
                pool.submit(trace_case, case, None)
        runs: dict[str, list[dict]] = {label: [] for label in NOISE_CONFIGS}
        for _ in range(repeats):
            for label, knobs in NOISE_CONFIGS.items():
                if left_s() < 30:
                    break
                request = ProbeRequest(
                    model=NOISE_MODEL, config=ProbeConfig(**{**NOISE_SHAPES, **knobs}),
                    device=Device(device), gpu_ids=(0,) if device == "cuda" else None,
                    warmup_steps=1, timed_steps=3, timeout_s=min(240.0, left_s()))
                result = runner.run(request)
                runs[label].append({"status": result.status.value,
                                    "tokens_per_s": result.tokens_per_s,
                                    "step_cv": result.step_cv,
                                    "contention": result.contention,
                                    "machine": result.machine})
        if pool is not None:
            for process in list(pool._processes.values()):
                process.kill()
            pool.shutdown(wait=False, cancel_futures=True)
        out["conditions"][condition] = {
            label: {"runs": rows, "cv": coefficient_of_variation(
                [r["tokens_per_s"] for r in rows if r["tokens_per_s"]]),
                "mean_tokens_per_s": statistics.fmean(
                    [r["tokens_per_s"] for r in rows if r["tokens_per_s"]] or [0.0]),
                "contended": sum(bool(r["contention"]) for r in rows)}
            for label, rows in runs.items()}
    return out


def describe_noise(noise: dict) -> list[str]:
    lines = [f"noise: {noise['repeats']} interleaved repeats of each config, quiet and beside "
             "a pool of trace processes (issue 49)"]
    for condition, configs in noise["conditions"].items():
        for label, figures in configs.items():
            cv = figures["cv"]
            lines.append(f"  {condition:<14} {label:<18} mean {figures['mean_tokens_per_s']:,.0f}"
                         f" tok/s, cv over repeats {'-' if cv is None else f'{cv:.1%}'}, "
                         f"{figures['contended']} of {len(figures['runs'])} flagged contended")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "gpu")
    parser.add_argument("--deadline-s", type=float, default=540.0,
                        help="start no case (and no TRL sweep) past this many seconds")
    parser.add_argument("--cases", default="",
                        help="comma-separated labels to run (default: every case)")
    parser.add_argument("--noise", choices=("cuda", "cpu"), default=None,
                        help="only the noise experiment (issue 49), on this device (cpu: a "
                             "dry run of its code)")
    parser.add_argument("--noise-repeats", type=int, default=NOISE_REPEATS,
                        help="repeats of each config in the noise experiment")
    parser.add_argument("--holdout", type=int, default=0, metavar="N",
                        help="only issue 67's held-out rows: draw N configs, predict them "
                             "(written before any probe), probe them (gpu_holdout.py)")
    parser.add_argument("--seed", type=int, default=None, help="--holdout's draw (default: "
                                                               "a fresh one, printed)")
    args = parser.parse_args()
    if args.holdout:
        seed = ["--seed", str(args.seed)] if args.seed is not None else []
        out = ["--out", str(args.out)]
        return (gpu_holdout.main(["predict", "--n", str(args.holdout), "--workers", "8",
                                  *seed, *out])
                or gpu_holdout.main(["probe", "--deadline-s", str(args.deadline_s), *out]))
    cases = [c for c in CASES if not args.cases or c[0] in args.cases.split(",")]
    started = time.monotonic()

    def left_s() -> float:
        return args.deadline_s - (time.monotonic() - started)

    if args.noise is not None:
        noise = noise_repeats(args.noise, left_s, args.noise_repeats)
        lines = describe_noise(noise)
        print("\n".join(lines), flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        device = gpu_name(0) if args.noise == "cuda" else platform.processor() or "cpu"
        (args.out / "gpu_noise.json").write_text(json.dumps(
            {"device": device, "date": time.strftime("%Y-%m-%d"), **noise}, indent=2) + "\n")
        (args.out / "gpu_noise.txt").write_text(f"{device}, {time.strftime('%Y-%m-%d')}\n"
                                                + "\n".join(lines) + "\n")
        return 0
    if not has_nvidia_gpu():
        print("gpu_evidence: needs an NVIDIA GPU (none found); nothing measured")
        return 0

    rows: list[dict] = []
    capacity = gpu_capacity_bytes(0)
    traced_cases = cases + [c for c in CASES if c[0] in CAP_CASES and c not in cases]
    pool = ProcessPoolExecutor(max_workers=max(1, min(8, len(traced_cases))),
                               mp_context=get_context("spawn"))
    traces = {case[0]: pool.submit(trace_case, case, capacity)  # on the CPU
              for case in traced_cases}
    snapshots = args.out / SNAPSHOTS
    with tempfile.TemporaryDirectory() as scratch:
        for case in cases:
            if left_s() < 60:
                print(f"{case[0]}: skipped, {left_s():.0f} s left of --deadline-s", flush=True)
                continue
            rows.append(run_case(case, Path(scratch), timeout_s=left_s(),
                                 snapshots=snapshots))
            print(describe(rows[-1]), flush=True)
            if traces[case[0]].done():
                rows[-1]["traced"] = traced_or_error(traces[case[0]], 0.0)
                print(describe_trace(rows[-1]), flush=True)
            write_results(args.out, rows, started, [])
        for row in rows:
            if "traced" not in row:
                row["traced"] = traced_or_error(traces[row["label"]],
                                                max(1.0, min(60.0, left_s())))
                print(describe_trace(row), flush=True)
        capped = {label: traced_or_error(traces[label], max(1.0, min(60.0, left_s())))
                  for label in CAP_CASES if label in traces}
        tail: list[str] = ["", *cap_bisection(capped, Path(scratch), left_s)]
        write_results(args.out, rows, started, tail)
    for process in list(pool._processes.values()):  # unfinished traces: not waited for
        process.kill()
    pool.shutdown(wait=False, cancel_futures=True)
    if left_s() > 150:
        tail += ["", *trl_fidelity(deadline_s=left_s() - 100)]
        write_results(args.out, rows, started, tail)
    else:
        tail += ["", f"trl fidelity: skipped, {left_s():.0f} s left of --deadline-s"]
    if left_s() > 150:
        with tempfile.TemporaryDirectory() as scratch:
            tail += ["", *trl_command_sweep(Path(scratch), timeout_s=left_s())]
    else:
        tail += ["", f"trl command sweep: skipped, {left_s():.0f} s left of --deadline-s"]
    print("\n".join(tail), flush=True)
    write_results(args.out, rows, started, tail)
    print(f"wrote {args.out}/gpu_evidence.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
