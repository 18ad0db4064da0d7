"""The built-in probe against real TRL, config by config: does the built-in step hold what
TRL's GRPOTrainer holds at the same shapes?

For each row of a small grid (micro-batch, response length, rollout n, beta 0 and 0.04, one
factor at a time around a base), the same config runs twice on the CPU, through the
SubprocessRunner, alternating:

- real TRL: `python train_grpo.py --config {config}` (tests/trl_fixture.py: the tiny-qwen2.5
  architecture, 16,384-token vocab, random weights, a tokenizer built here) probed as
  `run --trainer trl --launch` probes it, 3 optimizer steps;
- the built-in probe of tiny-qwen2.5 with the knobs `--trainer trl` gives it: generation by
  the policy itself (rollout_engine=policy), TRL's fused LM head (fused_logprob_kernel=trl),
  the reference only at beta != 0, no old-log-prob pass (one optimizer step a generation),
  experience micro-batches of per_device_train_batch_size, as TRL scores; 3 steps.

Both report one figure, the peak anonymous RSS of the probe's processes
(memory-and-trace.md#one-cpu-device-figure). Each is taken as its increment over a process
that only imports what that probe imported (every module `python -X importtime` lists for a
run of it: the TRL script's, or the probe worker's), measured here the same way: the step's
memory, model and data, without the libraries. Prints the rows side by side with
the ratio built-in / TRL; the check is every row within 10%.

On an NVIDIA GPU (`--gpu`; benchmarks/gpu_evidence.py runs it there) the model is
qwen2.5-0.5b's architecture, fp32 weights with bf16 autocast in both (TRL's bf16: true over a
float32 load, the built-in's fp32 master weights), 4x the response lengths, and the figure is
the GPU memory each probe read (NVML), the CUDA context in both, so no import baseline.

    python benchmarks/trainer_fidelity.py [--rows "base beta=0.04,mbu 2x beta=0.0"] [--gpu]
                                          [--out DIR]

Writes trainer_fidelity.{txt,json} (trainer_fidelity_gpu.* with --gpu) to
benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from trl_fixture import make_trl_workspace  # noqa: E402

from autotune.config import ProbeConfig, Topology, format_bytes  # noqa: E402
from autotune.hardware import Device  # noqa: E402
from autotune.probe.measure.result import ProbeRequest, ProbeResult  # noqa: E402
from autotune.runners.local import SubprocessRunner  # noqa: E402
from autotune.sweep.execution.command_probe import command_template  # noqa: E402
from autotune.sweep.plan import engine_knobs, trainer_knobs  # noqa: E402
from autotune.trainers import get_adapter  # noqa: E402

PROMPT_TOKENS = 9  # the fixture's 8-word prompts at a 16,384 vocab: a token a word, and one
BASE = {"rollout_batch_size": 4, "global_batch_size": 4, "rollout_n": 4,
        "micro_batch_size_update": 4, "max_response_length": 64, "use_kl": True}
ROWS = {"base": {}, "mbu 2x": {"micro_batch_size_update": 8},  # one factor doubled
        "resp 2x": {"max_response_length": 128}, "n 2x": {"rollout_n": 8}}
TOLERANCE = 0.10
STEPS = 3
IMPORTING = """import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException:
        pass
from autotune.process_tag import read_statm_bytes
print(read_statm_bytes()[1])
"""


@dataclass(frozen=True)
class Setup:
    """Where the comparison runs: the model, the TRL run's settings, the response scale."""

    model: str
    device: Device
    workspace: dict[str, Any]
    response_scale: int

    @property
    def on_gpu(self) -> bool:
        return self.device.on_gpu


CPU = Setup("tiny-qwen2.5", Device("cpu"), {}, 1)


def gpu_setup() -> Setup:
    from autotune.registry import get_model_spec

    numbers = {key: value for key, value in get_model_spec("qwen2.5-0.5b").text_config.items()
               if not key.endswith("token_id")}  # the tokenizer built here names its own
    return Setup("qwen2.5-0.5b", Device("cuda"),
                 {"architecture": numbers, "use_cpu": False, "bf16": True,
                  "model_init_kwargs": {"dtype": "float32"}}, 4)


def grid(setup: Setup = CPU) -> dict[str, dict]:
    """Each row's shapes: beta 0.04 (a reference model) and 0 (none), one factor at a time."""
    rows = {}
    for beta in (0.04, 0.0):
        for name, change in ROWS.items():
            shapes = {**BASE, **change, "use_kl": beta != 0}
            shapes["max_response_length"] *= setup.response_scale
            rows[f"{name} beta={beta}"] = shapes
    return rows


def trl_config(shapes: dict, on_gpu: bool = False) -> ProbeConfig:
    """The built-in's config for TRL at `shapes`: what `--trainer trl` sets (its engine, head
    and optimizer), TRL's old-log-prob rule, and its tie (the experience micro-batch)."""
    knobs = {**engine_knobs("auto", on_gpu=on_gpu, trainer="trl"),
             **trainer_knobs("trl", on_gpu=on_gpu), **shapes,
             "old_logprob_pass": None, "gradient_checkpointing": False,
             "max_prompt_length": PROMPT_TOKENS}
    config = ProbeConfig(**knobs)
    return config.replace(**get_adapter("trl").ties(config))


def imported(text: str) -> list[str]:
    """The modules `python -X importtime` says a run imported, in its order."""
    return [line.rsplit("|", 1)[1].strip() for line in text.splitlines()
            if line.startswith("import time:") and line.count("|") == 2
            and not line.rstrip().endswith("| package")]


def baseline_bytes(modules: list[str]) -> int:
    """Anonymous RSS of a fresh process that only imports `modules`."""
    out = subprocess.run([sys.executable, "-c", IMPORTING, *modules], capture_output=True,
                         text=True, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    return int(out.stdout.split()[-1])


def baselines_of(workspace, scratch: Path, setup: Setup = CPU) -> dict[str, int]:
    """Each probe's import baseline: what a real run of it imported, imported alone (none on
    a GPU, where the figure is the device's)."""
    if setup.on_gpu:
        return {"trl": 0, "builtin": 0}
    trl = subprocess.run([sys.executable, "-X", "importtime", *workspace.command()[1:]],
                         capture_output=True, text=True, env=workspace.env(), check=True)
    builtin_log = scratch / "imports" / "builtin.log"
    result = SubprocessRunner([sys.executable, "-X", "importtime", "-m",
                               "autotune.probe.worker"]).run(
        builtin_request(trl_config(BASE)), builtin_log)
    assert result.ok, result.message
    return {"trl": baseline_bytes(imported(trl.stderr)),
            "builtin": baseline_bytes(imported(builtin_log.read_text()))}


def command_request(workspace, config: ProbeConfig, setup: Setup = CPU) -> ProbeRequest:
    template = command_template(
        get_adapter("trl"), f"{sys.executable} {workspace.script} --config {{config}}",
        Topology(1, 1), workspace.config.read_text(), steps=STEPS, validate=False)
    return ProbeRequest(model="trl-run", device=setup.device, config=config, timeout_s=900,
                        command=template.command_for(config, {}),
                        gpu_ids=(0,) if setup.on_gpu else None)


def builtin_request(config: ProbeConfig, setup: Setup = CPU) -> ProbeRequest:
    return ProbeRequest(model=setup.model, device=setup.device, config=config,
                        timeout_s=900, warmup_steps=1, timed_steps=STEPS - 1,
                        gpu_ids=(0,) if setup.on_gpu else None)


def peak(result: ProbeResult) -> int:
    assert result.ok, result.message
    return result.peak_mem_bytes


def compare(setup: Setup, names: list[str], deadline_s: float = math.inf,
            echo: Any = print) -> tuple[list[dict], dict[str, int]]:
    """Each row named (all when none): TRL's and the built-in's step memory, side by side;
    no row starts after `deadline_s` (seconds from now)."""
    rows = {name: shapes for name, shapes in grid(setup).items() if not names or name in names}
    runner, started = SubprocessRunner(), time.monotonic()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        workspace = make_trl_workspace(Path(scratch) / "trl", vocab_size=16384,
                                       gradient_accumulation_steps=1, **setup.workspace)
        baselines = baselines_of(workspace, Path(scratch), setup)
        echo(f"import baselines: TRL {format_bytes(baselines['trl'])}, built-in "
             f"{format_bytes(baselines['builtin'])}")
        for i, (name, shapes) in enumerate(rows.items()):
            if time.monotonic() - started > deadline_s:
                echo(f"{name}: skipped at the deadline")
                continue
            config = trl_config(shapes, setup.on_gpu)
            logs = Path(scratch) / f"row-{i}"
            trl = peak(runner.run(command_request(workspace, config, setup), logs / "trl.log"))
            builtin = peak(runner.run(builtin_request(config, setup), logs / "builtin.log"))
            row = {"row": name, "shapes": shapes, "trl_peak_bytes": trl,
                   "builtin_peak_bytes": builtin,
                   "trl_step_bytes": trl - baselines["trl"],
                   "builtin_step_bytes": builtin - baselines["builtin"]}
            row["ratio"] = row["builtin_step_bytes"] / row["trl_step_bytes"]
            results.append(row)
            echo(f"[{time.monotonic() - started:4.0f} s] {name}: TRL "
                 f"{format_bytes(row['trl_step_bytes'])}, built-in "
                 f"{format_bytes(row['builtin_step_bytes'])} ({row['ratio']:.2f}x)")
    return results, baselines


def table(setup: Setup, results: list[dict], baselines: dict[str, int]) -> list[str]:
    """The rows side by side, and the verdict against TOLERANCE."""
    where = "on the CPU" if not setup.on_gpu else f"on {setup.device.kind} ({_gpu_name()})"
    figure = ("memory: peak anonymous RSS less a process that only imports what the probe "
              "imports" if not setup.on_gpu else "memory: each probe's GPU peak (NVML), "
              "fp32 weights, bf16 autocast")
    lines = [f"built-in probe vs real TRL {_version('trl')} GRPOTrainer, per config, {where} "
             f"({platform.machine()}, python {platform.python_version()}), "
             f"{time.strftime('%Y-%m-%d')}",
             f"{setup.model} (16,384-token tokenizer), ~{PROMPT_TOKENS} prompt tokens, {STEPS} "
             f"steps each, one generation per optimizer step; {figure}",
             f"import baselines: TRL {format_bytes(baselines['trl'])}, built-in "
             f"{format_bytes(baselines['builtin'])}", "",
             f"{'row':<20}{'mbu':>5}{'resp':>6}{'n':>4}{'beta':>6}{'TRL':>12}{'built-in':>12}"
             f"{'ratio':>8}"]
    for row in results:
        s = row["shapes"]
        lines.append(f"{row['row']:<20}{s['micro_batch_size_update']:>5}"
                     f"{s['max_response_length']:>6}{s['rollout_n']:>4}"
                     f"{0.04 if s['use_kl'] else 0.0:>6}{format_bytes(row['trl_step_bytes']):>12}"
                     f"{format_bytes(row['builtin_step_bytes']):>12}{row['ratio']:>7.2f}x")
    if not results:
        return [*lines, "", "no row ran"]
    worst = max(abs(row["ratio"] - 1) for row in results)
    verdict = "within" if worst <= TOLERANCE else "NOT within"
    return [*lines, "", f"worst row {worst:.1%} from TRL: {verdict} the {TOLERANCE:.0%} check"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated row names (default all)")
    parser.add_argument("--gpu", action="store_true", help="on GPU 0, qwen2.5-0.5b")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    setup = gpu_setup() if args.gpu else CPU
    results, baselines = compare(setup, [n for n in args.rows.split(",") if n],
                                 echo=lambda line: print(line, flush=True))
    text = "\n".join(table(setup, results, baselines)) + "\n"
    print("\n" + text)
    name = "trainer_fidelity_gpu" if args.gpu else "trainer_fidelity"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.txt").write_text(text)
    (args.out / f"{name}.json").write_text(json.dumps(
        {"baselines": baselines, "rows": results, "tolerance": TOLERANCE}, indent=2))


def _gpu_name() -> str:
    from autotune.hardware import gpu_name

    return gpu_name(0) or "an NVIDIA GPU"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
