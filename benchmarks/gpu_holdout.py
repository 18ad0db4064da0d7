"""Held-out GPU rows (issue 67): configs nobody tuned the memory model to, drawn at random from
a declared distribution, every CPU prediction written (and committed) before the first probe.

    python benchmarks/gpu_holdout.py predict --n 10 --seed S   # here, on the CPU
    python benchmarks/gpu_holdout.py probe [--deadline-s 480]    # on the GPU, the file's rows
    python benchmarks/gpu_holdout.py report RUN.json [RUN.json ...]  # runs merged, in order

(`benchmarks/gpu_evidence.py --holdout N [--seed S]` does both in one go, on the GPU machine.)

- `predict` draws N configs from DISTRIBUTION (seeded; the seed printed and kept), redraws a
  config the trainers' rules refuse or the memory model says cannot fit the card (the
  distribution is conditional on a predicted fit, so that every row measures a peak), then
  sizes each to finish inside one device call: its probe's wall time is estimated from the
  committed H200 probes (`probe_wall_s`) and its response length, then its share of
  prompts, halved until the estimate is under WALL_CAP_S (both the drawn and the sized
  config are kept). For each it writes the memory model's prediction (memory/model.py, no
  trace) and the traced one (the probe's two steps under fake tensors, replayed through the
  caching allocator: probe/trace.py), each plus the outside-torch prior
  (memory/outside_torch.py), to results/gpu/holdout_predictions.json.
- `probe` reads that file and probes its rows on the GPU, several at once when NVML sees each
  process's own memory (a process's peak is its own then) and their predicted peaks fit the
  card together, else one at a time; every row is reported, none dropped: a failed probe with
  its reason, one the deadline left unrun as such. Writes results/gpu/holdout.{json,txt}.

Targets (issue 67): the traced prediction within 5% of NVML's peak and the model alone within
10% on each phase of each row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from autotune.config import ProbeConfig, format_bytes
from autotune.config.rules import device_problems, validate_probe_config
from autotune.hardware import Device
from autotune.memory.model import estimate_memory
from autotune.memory.outside_torch import outside_torch
from autotune.memory.shape import model_shape
from autotune.probe.measure.result import ProbeRequest
from autotune.registry import get_model_spec

RESULTS = Path(__file__).resolve().parent / "results" / "gpu"
PREDICTIONS = "holdout_predictions.json"
MEASURED = "holdout.json"  # the probes' results, beside the predictions
H200_CAPACITY_BYTES = 150_109_880_320  # what the committed H200 probes' engine read
FIT_SHARE = 0.85  # a drawn config must be predicted under this share of the card
WALL_CAP_S = 90.0  # a row's estimated probe wall time (quiet card), after sizing
GRACE_S = 120.0  # a probe's time past --deadline-s (which only stops new rows starting)
CONCURRENT_SHARE = 0.8  # probes run side by side while their predicted peaks sum under this

# The declared distribution: each knob drawn uniformly from its choices, independently, then
# the rules' and the fit's redraws. Lengths are tokens; `share` is the sequences one rank
# generates a step (rollout_batch_size x rollout_n / W), from which rollout_batch_size follows.
DISTRIBUTION: dict[str, tuple] = {
    "model": ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-vl-7b"),
    "world": (1, 2, 4, 8),  # W > 1: rank 0 of W, emulated on the one GPU
    "max_prompt_length": (256, 512, 1024, 2048),
    "max_response_length": (256, 512, 1024, 2048, 4096),
    "rollout_n": (1, 2, 4, 8, 16),
    "share": (4, 8, 16, 32),
    # optimizer steps an update (rollout_batch_size / global_batch_size): on-policy 1, EasyR1's
    # default 4 (512 prompts, 128 a step); the grids of 2026-11-30 drew 1 only
    "minibatches": (1, 2, 4),
    "algorithm": ("grpo", "grpo", "ppo"),
    "micro_batch_size_update": (1, 2, 4, 8),
    "micro_batch_size_experience": (1, 2, 4, 8, 16),
    "dynamic_batching": (False, True),
    "token_budget_sequences": (1, 2, 4),  # with dynamic batching: max_token_len = this x seq
    "gradient_checkpointing": (False, True),
    "offload_params": (False, True),
    "offload_optimizer": (False, True),
    "fused_logprob": (False, True),
    "rollout_engine": ("hf", "vllm-like"),
    "gpu_memory_utilization": (0.3, 0.4, 0.5, 0.6),
    "expandable_segments": (False, True),
    "fsdp_strategy": ("fsdp", "fsdp2"),
    "lora_rank": (0, 0, 0, 32, 64),
    "ulysses_sequence_parallel_size": (1, 1, 2),
    "critic_micro_batch_size_update": (1, 2, 4, 8),
    "critic_gradient_checkpointing": (False, True),
}

# Estimated probe wall time on the H200 (two steps: warm-up and timed), from the committed
# probes of benchmarks/results/gpu/ (512-token prompts, 256-token responses): a process's
# start and build (imports, CUDA, the model) of about 25 s, a decode step of about 25 ms
# however small the model (launch-bound: 28-layer 7B ranks and 24-layer 0.5B alike), and the
# trained phases' sampled micro-batches at the full model's FLOPs per token.
START_S = {"qwen2.5-vl-7b": 35.0}
START_DEFAULT_S = 25.0
DECODE_STEP_S = 0.025
TRAIN_FLOPS_PER_S = 2e14  # bf16 at small micro-batches, checkpointing's recompute included
OFFLOAD_BYTES_PER_S = 1e10  # host <-> GPU, pinned
# The 12 rows of 2026-11-30 (results/gpu/holdout.json; seed 31703 was sized without it) ran
# 0.93 to 1.78 times these estimates, median 1.32, one to three probes side by side: the
# estimate is scaled by that median since.
MEASURED_OVER_ESTIMATED = 1.32


def label_of(index: int, model: str, world: int) -> str:
    return f"holdout {index:02d} {model.removeprefix('qwen2.5-')} w{world}"


def draw_knobs(rng: random.Random) -> dict:
    """One draw from DISTRIBUTION, as the probe's knobs plus `model` and `world`."""
    drawn = {name: rng.choice(choices) for name, choices in DISTRIBUTION.items()}
    world, n = drawn["world"], drawn["rollout_n"]
    if drawn["algorithm"] == "ppo":
        n = drawn["rollout_n"] = 1 if rng.random() < 0.5 else n  # PPO runs 1 as often as not
    steps = drawn["minibatches"]
    prompts = max(steps, drawn["share"] * world // n // steps * steps)
    seq = drawn["max_prompt_length"] + drawn["max_response_length"]
    knobs = {name: drawn[name] for name in (
        "max_prompt_length", "max_response_length", "rollout_n", "algorithm",
        "micro_batch_size_update", "micro_batch_size_experience", "gradient_checkpointing",
        "offload_params", "offload_optimizer", "fused_logprob", "rollout_engine",
        "expandable_segments", "fsdp_strategy", "lora_rank",
        "ulysses_sequence_parallel_size")}
    knobs.update(rollout_batch_size=prompts, global_batch_size=prompts // steps)
    if drawn["rollout_engine"] == "vllm-like":
        knobs["gpu_memory_utilization"] = drawn["gpu_memory_utilization"]
    if drawn["dynamic_batching"]:
        budget = drawn["token_budget_sequences"] * seq
        knobs.update(dynamic_batching=True, max_token_len_update=budget,
                     max_token_len_experience=budget)
    if drawn["algorithm"] == "ppo":
        knobs.update(critic_micro_batch_size_update=drawn["critic_micro_batch_size_update"],
                     critic_gradient_checkpointing=drawn["critic_gradient_checkpointing"])
        if drawn["dynamic_batching"]:
            knobs["critic_max_token_len_update"] = knobs["max_token_len_update"]
    if world == 1:
        knobs["ulysses_sequence_parallel_size"] = 1
    return {"model": drawn["model"], "world": world, "knobs": knobs}


def problems_of(draw: dict) -> list[str]:
    """The rules a trainer enforces on this draw, and what the probe cannot run on a GPU."""
    try:
        config = ProbeConfig(**draw["knobs"])
    except (TypeError, ValueError) as exc:
        return [str(exc)]
    problems = validate_probe_config(config, draw["world"])
    spec = get_model_spec(draw["model"])
    return problems + device_problems(config, on_gpu=True, is_vl=spec.kind == "vl",
                                      capped=False)


def request_of(draw: dict, timeout_s: float = 300.0, device: str = "cuda") -> ProbeRequest:
    world = draw["world"]
    return ProbeRequest(model=draw["model"], config=ProbeConfig(**draw["knobs"]),
                        device=Device(device), gpu_ids=(0,) if device == "cuda" else None,
                        warmup_steps=1, timed_steps=1,
                        timeout_s=timeout_s, nnodes=1, gpus_per_node=world,
                        emulated=world > 1, cpu_threads=4)


def outside_bytes(draw: dict) -> int:
    config = ProbeConfig(**draw["knobs"])
    return outside_torch(draw["world"], draw["world"] > 1,
                         config.rollout_tensor_parallel).total_bytes


def model_prediction(draw: dict) -> dict[str, int]:
    """The memory model's per-phase peak (no trace), plus the outside-torch prior."""
    config = ProbeConfig(**draw["knobs"])
    estimate = estimate_memory(model_shape(draw["model"]), config, num_gpus=draw["world"],
                               on_gpu=True, engine_capacity_bytes=H200_CAPACITY_BYTES,
                               outside_bytes=outside_bytes(draw))
    return {phase: e.total_bytes for phase, e in estimate.phases.items()}


def estimated_wall_s(draw: dict) -> float:
    """The probe's wall time on the H200, two steps, from the committed probes' figures."""
    config = ProbeConfig(**draw["knobs"])
    shape = model_shape(draw["model"])
    share = config.rollout_batch_size * config.rollout_n // draw["world"] or 1
    if config.rollout_engine == "vllm-like":
        waves = math.ceil(share / max(1, config.max_num_seqs))
    else:
        waves = 1
    rollout_s = min(waves, 3) * config.max_response_length * DECODE_STEP_S
    seq = config.max_prompt_length + config.max_response_length
    sampled = min(share, 4 * max(config.micro_batch_size_update,
                                 config.micro_batch_size_experience))
    passes = 3 + (1 if config.gradient_checkpointing else 0) + 2  # update, ref + old pass
    if config.has_critic:
        passes += 4
    train_s = 2 * shape.num_params * passes * sampled * seq / TRAIN_FLOPS_PER_S
    offload_s = (2 * shape.num_params * 2 / draw["world"] / OFFLOAD_BYTES_PER_S
                 * (config.offload_params + 4 * config.offload_optimizer))
    start_s = START_S.get(draw["model"], START_DEFAULT_S)
    return MEASURED_OVER_ESTIMATED * (start_s + 2 * (rollout_s + train_s + offload_s))


def sized(draw: dict) -> tuple[dict, list[str]]:
    """The draw with its response length, then its share of prompts, halved until its
    estimated wall time is under WALL_CAP_S; what changed, said."""
    knobs, said = dict(draw["knobs"]), []
    current = {**draw, "knobs": knobs}
    steps = knobs["rollout_batch_size"] // knobs["global_batch_size"]
    while estimated_wall_s(current) > WALL_CAP_S:
        if knobs["max_response_length"] > 256:
            knobs["max_response_length"] //= 2
        elif knobs["rollout_batch_size"] > steps:  # its optimizer steps kept
            knobs["rollout_batch_size"] = max(steps, knobs["rollout_batch_size"] // 2
                                              // steps * steps)
            knobs["global_batch_size"] = knobs["rollout_batch_size"] // steps
        else:
            break
        if knobs.get("dynamic_batching"):  # the budget keeps its sequences per micro-batch
            per = knobs["max_token_len_update"] // (draw["knobs"]["max_prompt_length"]
                                                    + draw["knobs"]["max_response_length"])
            budget = per * (knobs["max_prompt_length"] + knobs["max_response_length"])
            knobs["max_token_len_update"] = knobs["max_token_len_experience"] = budget
            if "critic_max_token_len_update" in knobs:
                knobs["critic_max_token_len_update"] = budget
    for name in ("max_response_length", "rollout_batch_size", "global_batch_size"):
        if knobs[name] != draw["knobs"][name]:
            said.append(f"{name} {draw['knobs'][name]} -> {knobs[name]}")
    return current, said


def draw_rows(n: int, seed: int) -> list[dict]:
    """N sized rows: each draw redrawn while the rules refuse it or the model says it cannot
    fit FIT_SHARE of the card; every redraw counted."""
    rng = random.Random(seed)
    rows: list[dict] = []
    while len(rows) < n:
        refused = unfit = 0
        while True:
            draw = draw_knobs(rng)
            if problems_of(draw):
                refused += 1
                continue
            current, said = sized(draw)
            if problems_of(current):
                refused += 1
                continue
            peak = max(model_prediction(current).values())
            if peak > FIT_SHARE * H200_CAPACITY_BYTES:
                unfit += 1
                continue
            break
        rows.append({"label": label_of(len(rows), draw["model"], draw["world"]),
                     "model": current["model"], "world": current["world"],
                     "knobs": current["knobs"], "drawn_knobs": draw["knobs"],
                     "sized": said, "estimated_wall_s": round(estimated_wall_s(current), 1),
                     "redrawn": {"refused by the rules": refused, "predicted not to fit": unfit}})
    return rows


# Issue 67's row (README command 1's first probe on one H200: the safe config of the `grpo`
# space, the vllm-like engine): not held out (the model's misses on it are known), probed
# first and reported apart, so that results/gpu/ holds it as a case of its own.
README_ROW = {"label": "readme 0.5b w1", "model": "qwen2.5-0.5b", "world": 1, "knobs": {
    "rollout_batch_size": 16, "rollout_n": 8, "global_batch_size": 8,
    "micro_batch_size_update": 1, "micro_batch_size_experience": 1,
    "gradient_checkpointing": True, "offload_params": True, "offload_optimizer": True,
    "max_prompt_length": 512, "max_response_length": 512, "max_num_seqs": 128,
    "rollout_engine": "vllm-like", "gpu_memory_utilization": 0.3, "fused_logprob": True},
    "held_out": False, "sized": []}


def trace_row(row: dict) -> dict:
    """The row's probe traced on this CPU (fake tensors), its allocations replayed through the
    caching allocator under the row's settings; per phase, with the outside-torch prior."""
    import torch

    from autotune.probe.trace import trace_request
    from autotune.probe.worker import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(1)
    request = request_of(row)
    request = dataclasses.replace(request,
                                  device=request.device.with_capacity(H200_CAPACITY_BYTES))
    try:
        traced = trace_request(request, outside_bytes(row))
    except Exception as exc:  # said in the file; the other rows go on
        return {"error": f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"}
    return {"phase_peak_mem_bytes": traced.phase_peak_mem_bytes,
            "phase_reserved_bytes": traced.phase_reserved_bytes,
            "phase_tensor_bytes": traced.phase_tensor_bytes,
            "phase_allocated_bytes": traced.phase_allocated_bytes,
            "trace_s": round(traced.trace_s, 1)}


def predict(n: int, seed: int, out: Path, workers: int) -> dict:
    """Draw, size and predict N rows; write them before anything is probed."""
    started = time.monotonic()
    rows = [{**README_ROW, "estimated_wall_s": round(estimated_wall_s(README_ROW), 1)},
            *({**row, "held_out": True} for row in draw_rows(n, seed))]
    print(f"drew {n} rows with seed {seed}; tracing them ({workers} at a time)", flush=True)
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        traces = list(pool.map(trace_row, rows))
    for row, traced in zip(rows, traces, strict=True):
        row["predicted"] = {"model_bytes": model_prediction(row), "traced": traced,
                            "outside_torch_bytes": outside_bytes(row)}
        print(f"  {row['label']}: {describe_prediction(row)}", flush=True)
    document = {"seed": seed, "n": n, "date": time.strftime("%Y-%m-%d"),
                "predicted_on": platform.processor() or platform.machine(),
                "capacity_bytes": H200_CAPACITY_BYTES, "fit_share": FIT_SHARE,
                "wall_cap_s": WALL_CAP_S,
                "distribution": {k: list(v) for k, v in DISTRIBUTION.items()},
                "predict_s": round(time.monotonic() - started, 1), "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / PREDICTIONS).write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {out / PREDICTIONS}")
    return document


def describe_prediction(row: dict) -> str:
    traced = row["predicted"]["traced"]
    model = row["predicted"]["model_bytes"]
    if "error" in traced:
        return f"trace failed: {traced['error']}"
    return "  ".join(f"{phase} traced {format_bytes(value)} model {format_bytes(model[phase])}"
                     for phase, value in traced["phase_peak_mem_bytes"].items()
                     if phase in model)


def nvml_sees_each_process() -> bool:
    """Whether NVML lists a CUDA process by its own PID with its own memory (it does not
    inside some containers, where the meter falls back to the whole card's use, which a
    probe beside it would swell)."""
    import subprocess

    code = ("import os, torch, pynvml; x = torch.ones(1 << 28, device='cuda'); "
            "pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0); "
            "print(any(p.pid == os.getpid() and (p.usedGpuMemory or 0) > (1 << 29) "
            "for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    return ran.stdout.strip().endswith("True")


def predicted_peak(row: dict) -> int:
    """The larger of the row's two predictions, for the card's share it may take."""
    traced = row["predicted"]["traced"].get("phase_peak_mem_bytes") or {}
    return max([*row["predicted"]["model_bytes"].values(), *traced.values()])


def errors(row: dict, measured: dict[str, int]) -> dict[str, dict]:
    """Per phase NVML's peak, the predictions and their relative errors."""
    traced = row["predicted"]["traced"].get("phase_peak_mem_bytes") or {}
    model = row["predicted"]["model_bytes"]
    out = {}
    for phase, nvml in measured.items():
        entry: dict = {"nvml_bytes": nvml}
        if phase in traced:
            entry.update(traced_bytes=traced[phase],
                         traced_error=round((traced[phase] - nvml) / nvml, 4))
        if phase in model:
            entry.update(model_bytes=model[phase],
                         model_error=round((model[phase] - nvml) / nvml, 4))
        out[phase] = entry
    return out


def probe_rows(document: dict, out: Path, deadline_s: float, device: str = "cuda"
               ) -> list[dict]:
    """Every predicted row probed (several at once where NVML counts each process apart and
    their predicted peaks fit the card together), reported as it ends. `device` cpu: a dry
    run of this code on a CPU (side by side, no NVML)."""
    from autotune.hardware import gpu_capacity_bytes
    from autotune.runners.local import SubprocessRunner

    started = time.monotonic()
    capacity = (gpu_capacity_bytes(0) if device == "cuda" else None) or H200_CAPACITY_BYTES
    side_by_side = nvml_sees_each_process() if device == "cuda" else True
    print(f"NVML counts each process apart: {side_by_side}; "
          f"{'up to 3 probes at once' if side_by_side else 'one probe at a time'}", flush=True)
    rows = document["rows"]
    results: dict[str, dict] = {}
    lock = threading.Condition()
    running: dict[str, int] = {}
    runner = SubprocessRunner()

    def left_s() -> float:
        return deadline_s - (time.monotonic() - started)

    def save() -> None:
        done = [results.get(r["label"]) or {"label": r["label"], "status": "not run"}
                for r in rows]
        write_report(out, document, done, started, side_by_side)

    def one(row: dict, scratch: Path) -> None:
        need = predicted_peak(row)
        with lock:
            while running and (sum(running.values()) + need > CONCURRENT_SHARE * capacity):
                lock.wait()
            if left_s() < min(row["estimated_wall_s"] * 1.2, 90.0):
                results[row["label"]] = {"label": row["label"], "status": "not run",
                                         "message": f"{left_s():.0f} s left of --deadline-s"}
                lock.notify_all()
                return
            beside = list(running)
            running[row["label"]] = need
        try:
            # a row started near the deadline still gets its time: GRACE_S past it
            request = request_of(row, timeout_s=max(60.0, left_s() + GRACE_S), device=device)
            result = runner.run(request, scratch / f"{row['label'].replace(' ', '_')}.log")
        finally:
            with lock:
                running.pop(row["label"], None)
                lock.notify_all()
        measured = dict(result.phase_peak_mem_bytes)
        entry = {"label": row["label"], "status": result.status.value,
                 "failed_phase": result.failed_phase, "message": result.message[:300],
                 "beside": beside, "phases": errors(row, measured),
                 "phase_allocator_peak_bytes": result.phase_allocator_peak_bytes,
                 "phase_tensor_peak_bytes": result.phase_tensor_peak_bytes,
                 "probe_wall_s": result.probe_wall_s, "build_s": result.build_s,
                 "step_s": result.step_s, "tokens_per_s": result.tokens_per_s,
                 "probe_mode": result.probe_mode, "engine": result.engine,
                 "fsdp_strategy": result.fsdp_strategy, "allocator": result.allocator,
                 "device": result.device_name, "versions": result.versions,
                 "stderr_tail": "" if result.ok else result.stderr_tail[-1200:]}
        with lock:
            results[row["label"]] = entry
            print(describe_row(row, entry), flush=True)
            save()

    with tempfile.TemporaryDirectory() as scratch, \
            ThreadPoolExecutor(max_workers=3 if side_by_side else 1) as pool:
        for future in [pool.submit(one, row, Path(scratch)) for row in rows]:
            future.result()
    save()
    return [results[r["label"]] for r in rows]


def describe_row(row: dict, entry: dict) -> str:
    head = f"{row['label']:<26}{entry['status']:<9}"
    if entry["status"] != "ok":
        return head + f"{entry.get('failed_phase') or ''} {entry.get('message', '')[:200]}"
    parts = []
    for phase, e in entry["phases"].items():
        traced = f"{e['traced_error']:+.1%}" if "traced_error" in e else "-"
        model = f"{e['model_error']:+.1%}" if "model_error" in e else "-"
        parts.append(f"{phase} {format_bytes(e['nvml_bytes'])} (traced {traced}, model {model})")
    run = f" (run {entry['run']})" if "run" in entry else ""
    return head + f"{entry['probe_wall_s']:.0f} s{run}  " + "  ".join(parts)


def describe_knobs(row: dict) -> str:
    knobs = row["knobs"]
    return (f"{row['model']} W={row['world']} {knobs.get('algorithm', 'grpo')} "
            f"{knobs['max_prompt_length']}+{knobs['max_response_length']} tok x "
            f"n={knobs['rollout_n']}, {knobs['rollout_batch_size']} prompts, "
            + ", ".join(f"{k}={v}" for k, v in knobs.items() if k not in {
                "algorithm", "max_prompt_length", "max_response_length", "rollout_n",
                "rollout_batch_size", "global_batch_size"})
            + (f" (sized: {'; '.join(row['sized'])})" if row["sized"] else ""))


def summary(done: list[dict], held_out: set[str]) -> list[str]:
    """The held-out rows' errors, all phases pooled (rows not held out are not counted)."""
    done = [d for d in done if d["label"] in held_out]
    traced = [e["traced_error"] for d in done if d["status"] == "ok"
              for e in d["phases"].values() if "traced_error" in e]
    model = [e["model_error"] for d in done if d["status"] == "ok"
             for e in d["phases"].values() if "model_error" in e]
    ok = sum(d["status"] == "ok" for d in done)
    others = ", ".join(f"{s}: {sum(d['status'] == s for d in done)}"
                       for s in sorted({d["status"] for d in done}) if s != "ok")
    lines = [f"held out: {ok} of {len(done)} rows probed ok" + (f"; {others}" if others else "")]
    if traced:
        lines.append(f"traced prediction against NVML: {min(traced):+.1%} to {max(traced):+.1%}"
                     f", median |error| {statistics.median(abs(e) for e in traced):.1%}, "
                     f"{sum(abs(e) <= 0.05 for e in traced)} of {len(traced)} phases within "
                     f"5% (target: all)")
    if model:
        lines.append(f"memory model alone: {min(model):+.1%} to {max(model):+.1%}, "
                     f"{sum(abs(e) <= 0.10 for e in model)} of {len(model)} within 10% "
                     f"(target: all); {sum(e > 0 for e in model)} over, "
                     f"{sum(e < 0 for e in model)} under")
    return lines


def merged(document: dict, runs: list[dict]) -> tuple[list[dict], int]:
    """Each row's result from the last run that ran it (else "not run"), tagged with that
    run's number, and the number of runs. A run given that is itself a merged report (its
    rows carry their run numbers) keeps its numbers; the runs after it count on from its
    `runs` (or its largest run number, in a report written before it kept `runs`), so
    re-probing a committed grid's rows adds runs to its history."""
    out: dict[str, dict] = {}
    count = 0
    for run in runs:
        numbers = [e["run"] for e in run["rows"] if "run" in e]
        first = count + 1
        for entry in run["rows"]:
            number = count + entry["run"] if "run" in entry else first
            if entry["status"] != "not run" or entry["label"] not in out:
                out[entry["label"]] = {**entry, "run": number}
        count += run.get("runs") or (max(numbers) if numbers else 1)
    return [out.get(r["label"]) or {"label": r["label"], "status": "not run"}
            for r in document["rows"]], count


def committed_grids() -> list[Path]:
    """The committed held-out grids: results/gpu/ (the first) and each folder under it that
    holds a grid's predictions and its probes (`--out`), by folder name."""
    grids = [RESULTS, *sorted(p for p in RESULTS.iterdir() if p.is_dir())]
    return [g for g in grids if (g / PREDICTIONS).exists() and (g / MEASURED).exists()]


def probed_rows(grid: Path) -> tuple[dict, list[tuple[dict, dict]]]:
    """A committed grid's predictions, and each predicted row beside its probe's result
    (`{"status": "not run"}` where no run reached it), in the predictions' order."""
    predictions = json.loads((grid / PREDICTIONS).read_text())
    measured = {r["label"]: r for r in json.loads((grid / MEASURED).read_text())["rows"]}
    return predictions, [(row, measured.get(row["label"], {"status": "not run"}))
                         for row in predictions["rows"]]


def held_out_labels(document: dict) -> set[str]:
    return {r["label"] for r in document["rows"] if r.get("held_out")}


def write_report(out: Path, document: dict, done: list[dict], started: float | None,
                 side_by_side: bool, runs: int = 1) -> None:
    device = next((d["device"] for d in done if d.get("device")), None) or "no GPU"
    by_label = {r["label"]: r for r in document["rows"]}
    took = (f"{(time.monotonic() - started) / 60:.1f} min" if started is not None
            else f"{runs} runs, each resuming the rows the last left unrun (a row's run is "
                 "given)")
    lines = [f"gpu_holdout on {device}, {time.strftime('%Y-%m-%d')}, {took}; "
             f"seed {document['seed']}, "
             f"predicted on {document['date']} ({PREDICTIONS})",
             "benchmark: python benchmarks/gpu_holdout.py probe; probes side by side: "
             f"{side_by_side}", ""]
    for d in done:
        row = by_label[d["label"]]
        lines += [f"{d['label']}: {describe_knobs(row)}", "  " + describe_row(row, d)]
    lines += ["", *summary(done, held_out_labels(document))]
    out.mkdir(parents=True, exist_ok=True)
    (out / "holdout.txt").write_text("\n".join(lines) + "\n")
    (out / MEASURED).write_text(json.dumps(
        {"seed": document["seed"], "device": device, "date": time.strftime("%Y-%m-%d"),
         "predicted": document["date"], "side_by_side": side_by_side, "runs": runs,
         "rows": done},
        indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    drawing = sub.add_parser("predict", help="draw, size and predict rows here (CPU)")
    drawing.add_argument("--n", type=int, default=10)
    drawing.add_argument("--seed", type=int, default=None,
                         help="the draw's seed (default: a fresh one, printed)")
    drawing.add_argument("--workers", type=int, default=2, help="traces at a time")
    probing = sub.add_parser("probe", help="probe the predicted rows (GPU)")
    probing.add_argument("--deadline-s", type=float, default=480.0,
                         help="start a row only while this many seconds less those spent "
                              "leave it 1.2 x its estimated wall (90 s at most): a call's "
                              "budget for starting rows, not for a row's end")
    probing.add_argument("--predictions", type=Path, default=RESULTS / PREDICTIONS,
                         help="the rows and their predictions (written by `predict`)")
    probing.add_argument("--rows", nargs="+", default=None, metavar="LABEL",
                         help="probe only the rows whose labels start so (e.g. 'holdout 04' "
                              "'readme'): a row a fix changed, or one a call left unrun")
    probing.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                         help="cpu: a dry run of the probing code (tiny rows)")
    merging = sub.add_parser("report", help="one report from several probe runs' holdout.json "
                                            "(a run cut short, then resumed on the rows it left)")
    merging.add_argument("runs", nargs="+", type=Path, help="holdout.json files, in run order")
    merging.add_argument("--predictions", type=Path, default=RESULTS / PREDICTIONS)
    for each in (drawing, probing, merging):
        each.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.command == "predict":
        seed = args.seed if args.seed is not None else random.SystemRandom().randrange(10**6)
        print(f"seed {seed}", flush=True)
        predict(args.n, seed, args.out, args.workers)
        return 0
    if args.command == "report":
        document = json.loads(args.predictions.read_text())
        done, runs = merged(document, [json.loads(run.read_text()) for run in args.runs])
        write_report(args.out, document, done, None, True, runs)
        print((args.out / "holdout.txt").read_text())
        return 0
    from autotune.hardware import has_nvidia_gpu

    document = json.loads(args.predictions.read_text())
    if args.rows:
        document["rows"] = [r for r in document["rows"]
                            if r["label"].startswith(tuple(args.rows))]
        if not document["rows"]:
            parser.error(f"--rows {' '.join(args.rows)}: no row of {args.predictions} "
                         "starts so")
    if args.device == "cuda" and not has_nvidia_gpu():
        print("gpu_holdout probe: needs an NVIDIA GPU (none found); nothing measured")
        return 0
    done = probe_rows(document, args.out, args.deadline_s, args.device)
    print("\n".join(summary(done, held_out_labels(document))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
