"""The `autotune` command: thin click commands over the library.

The only place that turns an AutotuneError into one line on stderr and an exit code (2 for
bad input). torch, transformers and ray are imported inside commands, never at import time, so
`autotune --help` is instant.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from autotune import __version__
from autotune.errors import AutotuneError, ConfigError

_state = {"debug": False}
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _size_option(name: str, help_text: str) -> Any:
    return click.option(name, default=None, metavar="SIZE", help=help_text)


def probe_options(command: Any) -> Any:
    """Options shared by every command that runs probes: model, device and memory limits."""
    options = [
        click.option("--model", "model", required=True, metavar="NAME",
                     help="Registry model (see `autotune models`), e.g. qwen2.5-vl-7b."),
        click.option("--model-path", type=click.Path(file_okay=False), default=None,
                     help="Local HF checkpoint or config directory (overrides the registry)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                     show_default=True, help="Where probes run; auto = cuda when present."),
        click.option("--gpus", default=None, metavar="IDS",
                     help="GPU ids to pin probes to, e.g. 0 or 0,1 (default: all visible)."),
        click.option("--threads", "cpu_threads", type=click.IntRange(1), default=None,
                     help="CPU threads per probe (default: torch's choice)."),
        _size_option("--gpu-memory-limit", "Cap on device memory per probe, e.g. 40GiB "
                     "(emulates a smaller GPU; on CPU caps the probe's device RSS)."),
        _size_option("--reserve-gpu-memory", "Device memory left free for a co-located "
                     "process such as a retriever, e.g. 6GiB (default: 0)."),
        _size_option("--host-memory-limit", "Cap on the probe tree's host RSS, e.g. 64GiB; "
                     "past it the probe is killed and classified host_oom."),
        click.option("--timeout", "timeout", default="15m", show_default=True,
                     help="Wall-clock limit per probe: 90s, 15m, 2h."),
        click.option("--warmup-steps", type=click.IntRange(0), default=1, show_default=True,
                     help="Untimed steps before timing."),
        click.option("--timed-steps", type=click.IntRange(1), default=2, show_default=True,
                     help="Timed steps averaged into the figures."),
        click.option("--dtype", type=click.Choice(["auto", "bf16", "fp32"]), default="auto",
                     show_default=True, help="Compute dtype; auto = bf16 on GPU, fp32 on CPU."),
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def build_probe_request(options: dict[str, Any], knob_values: dict[str, Any]) -> Any:
    """A ProbeRequest from the shared probe options and typed knob values."""
    from autotune.config import make_probe_config, parse_bytes, parse_duration_s
    from autotune.models import get_model_spec
    from autotune.result import ProbeRequest

    if options["model_path"] is None:
        get_model_spec(options["model"])
    gpu_ids = None
    if options["gpus"]:
        try:
            gpu_ids = tuple(int(x) for x in options["gpus"].split(","))
        except ValueError:
            raise ConfigError(f"--gpus {options['gpus']!r}: expected ids such as 0 or 0,1") \
                from None

    def size(flag: str) -> int | None:
        raw = options[flag.lstrip("-").replace("-", "_")]
        return parse_bytes(raw, flag) if raw is not None else None

    return ProbeRequest(
        model=options["model"], config=make_probe_config(knob_values),
        model_path=options["model_path"], device=options["device"], gpu_ids=gpu_ids,
        cpu_threads=options["cpu_threads"], gpu_memory_limit_bytes=size("--gpu-memory-limit"),
        reserve_gpu_memory_bytes=size("--reserve-gpu-memory") or 0,
        host_memory_limit_bytes=size("--host-memory-limit"),
        timeout_s=parse_duration_s(options["timeout"], "--timeout"),
        warmup_steps=options["warmup_steps"], timed_steps=options["timed_steps"],
        seed=options["seed"], dtype=options["dtype"])


@click.group(context_settings=CONTEXT_SETTINGS)
@click.version_option(__version__, "--version", prog_name="autotune")
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
def cli(debug: bool) -> None:
    """Find the fastest memory-safe configuration for an RL fine-tuning run.

    \b
    autotune models                                  the model registry
    autotune probe --model tiny-qwen2.5              one real GRPO step, measured
    autotune probe --model qwen2.5-0.5b --set micro_batch_size_update=8 --json
    """
    _state["debug"] = debug


@cli.command()
@click.option("--model-path", type=click.Path(file_okay=False), default=None,
              help="Also count a local checkpoint or config directory.")
def models(model_path: str | None) -> None:
    """List the registry: each model's parameter count, built on the meta device.

    \b
    autotune models
    autotune models --model-path ./my-checkpoint
    """
    from autotune.models import REGISTRY, count_params, load_model_config
    from autotune.report import format_table

    rows = []
    for name, spec in REGISTRY.items():
        params = count_params(load_model_config(name))
        card = f"{spec.card_params:.3f}B" if spec.card_params else "-"
        rows.append({"model": name, "kind": spec.kind, "params": f"{params / 1e9:.3f}B",
                     "card": card, "source": spec.hf_id})
    if model_path:
        params = count_params(load_model_config("", model_path))
        rows.append({"model": model_path, "kind": "local", "params": f"{params / 1e9:.3f}B",
                     "card": "-", "source": "--model-path"})
    click.echo(format_table(rows, ["model", "kind", "params", "card", "source"]))


@cli.command()
@probe_options
@click.option("--set", "assignments", multiple=True, metavar="KEY=VALUE",
              help="Set a knob, repeatable: --set micro_batch_size_update=8.")
@click.option("--log", "log_path", type=click.Path(dir_okay=False), default=None,
              help="Keep the probe's full output in this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def probe(assignments: tuple[str, ...], log_path: str | None, as_json: bool,
          **options: Any) -> None:
    """Run one probe: a real GRPO training step in its own process, measured.

    Exit code 0 when it fits, 1 when it failed (OOM, timeout, crash), 2 for bad input.

    \b
    autotune probe --model tiny-qwen2.5
    autotune probe --model qwen2.5-0.5b --set micro_batch_size_update=8 --json
    autotune probe --model qwen2.5-7b --gpu-memory-limit 40GiB --set offload_params=true
    """
    from pathlib import Path

    from autotune.config import parse_assignments
    from autotune.report import format_probe_result
    from autotune.result import ProbeStatus
    from autotune.runners.local import SubprocessRunner

    request = build_probe_request(options, parse_assignments(assignments))
    if log_path is not None and Path(log_path).exists():
        raise ConfigError(f"--log {log_path}: file exists; choose a new path")
    click.echo(f"probing {request.model} on {request.device} ...", err=True)
    result = SubprocessRunner().run(request, Path(log_path) if log_path else None)
    click.echo(result.to_json() if as_json else format_probe_result(result, request.model))
    if result.status is ProbeStatus.INVALID:
        sys.exit(2)
    sys.exit(0 if result.ok else 1)


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the command, turning known errors into one line and an exit code."""
    try:
        cli.main(args=argv, prog_name="autotune", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except AutotuneError as err:
        if _state["debug"]:
            raise
        click.echo(f"Error: {err}", err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
