"""The command probe against the built-in probe, for the same GRPO config, side by side.

A real TRL GRPOTrainer run on the CPU (tests/trl_fixture.py: the tiny-qwen2.5 architecture
with a 16384-token vocab, random weights, a tokenizer built locally, `python train_grpo.py
--config {config}`) is probed as `run --launch` probes it; the built-in probe runs the same
shapes on the registry's tiny-qwen2.5: 4 prompts x 4 responses a step, 4 responses per
micro-batch, 64 response tokens, a KL reference. Both through the SubprocessRunner,
alternating, --repeats times each, in one run.

It prints, for each: the fixed cost (process start to the first step: imports and model
build; for the command, until its first step line), seconds per step, tokens/s and peak
memory (device = the probe's RSS on a CPU), and the ratios command / built-in. The ratio is a
figure to read, not a target: TRL generates with Hugging Face generate, counts tokens
without padding, and loads a separate reference model.

    python benchmarks/command_probe_overhead.py [--repeats 2] [--out DIR]

Writes command_probe_overhead.{txt,json} to benchmarks/results/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from trl_fixture import make_trl_workspace  # noqa: E402

from autotune.config import ProbeConfig, Topology, format_bytes  # noqa: E402
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult  # noqa: E402
from autotune.runners.local import SubprocessRunner  # noqa: E402
from autotune.sweep.execution.command_probe import command_template  # noqa: E402
from autotune.trainers import get_adapter  # noqa: E402

SHAPES = {"rollout_batch_size": 4, "rollout_n": 4, "global_batch_size": 4,
          "micro_batch_size_update": 4, "micro_batch_size_experience": 4,
          "max_response_length": 64, "gradient_checkpointing": False}
PROMPT_TOKENS = 16  # the fixture's 8-word prompts, about 2 BPE tokens a word


def command_request(workspace, steps: int) -> ProbeRequest:
    template = command_template(
        get_adapter("trl"), f"{sys.executable} {workspace.script} --config {{config}}",
        Topology(1, 1), workspace.config.read_text(), steps=steps, validate=False)
    config = ProbeConfig(**SHAPES, max_prompt_length=PROMPT_TOKENS)
    return ProbeRequest(model="trl-run", device=Device("cpu"), config=config, timeout_s=600,
                        command=template.command_for(config, {}))


def builtin_request(steps: int) -> ProbeRequest:
    config = ProbeConfig(**SHAPES, max_prompt_length=PROMPT_TOKENS)
    return ProbeRequest(model="tiny-qwen2.5", device=Device("cpu"), config=config, timeout_s=600,
                        warmup_steps=1, timed_steps=steps - 1)


def figures(result: ProbeResult) -> dict[str, float | None]:
    assert result.ok, result.message
    return {"fixed_cost_s": result.fixed_cost_s, "step_s": result.step_s,
            "tokens_per_s": result.tokens_per_s, "peak_mem_bytes": result.peak_mem_bytes,
            "host_peak_rss_bytes": result.host_peak_rss_bytes,
            "probe_wall_s": result.probe_wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    runner = SubprocessRunner()
    runs: dict[str, list[dict[str, float | None]]] = {"command": [], "builtin": []}
    with tempfile.TemporaryDirectory() as scratch:
        workspace = make_trl_workspace(Path(scratch) / "trl", vocab_size=16384,
                                       gradient_accumulation_steps=1,
                                       max_completion_length=SHAPES["max_response_length"])
        for repeat in range(args.repeats):
            for kind, request in (("command", command_request(workspace, args.steps)),
                                  ("builtin", builtin_request(args.steps))):
                log = Path(scratch) / f"{kind}-{repeat}" / "trial-00000.log"
                runs[kind].append(figures(runner.run(request, log)))
                print(f"{kind} {repeat + 1}/{args.repeats}: {runs[kind][-1]}", flush=True)
    median = {kind: {key: statistics.median(r[key] for r in rows)
                     for key in rows[0]} for kind, rows in runs.items()}
    lines = [f"command probe (TRL GRPOTrainer, `python train_grpo.py --config {{config}}`) vs "
             f"built-in probe, same shapes ({SHAPES}, ~{PROMPT_TOKENS} prompt tokens), "
             f"{args.steps} steps, median of {args.repeats} runs each, alternating",
             f"machine: {platform.processor() or platform.machine()}, CPU, "
             f"python {platform.python_version()}",
             "fixed_cost_s: built-in, process start to the first step (imports, model build); "
             "command, until its first step line is printed (that step included: the "
             "trainer logs no earlier mark)", "",
             f"{'figure':<22}{'command':>14}{'built-in':>14}{'ratio':>10}"]
    for key in ("fixed_cost_s", "step_s", "tokens_per_s", "peak_mem_bytes",
                "host_peak_rss_bytes", "probe_wall_s"):
        cmd, builtin = median["command"][key], median["builtin"][key]
        show = format_bytes if key.endswith("bytes") else (lambda v: f"{v:,.2f}")
        lines.append(f"{key:<22}{show(cmd):>14}{show(builtin):>14}{cmd / builtin:>9.2f}x")
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "command_probe_overhead.txt").write_text(text)
    (args.out / "command_probe_overhead.json").write_text(json.dumps(
        {"shapes": SHAPES, "steps": args.steps, "runs": runs, "median": median}, indent=2))


if __name__ == "__main__":
    main()
