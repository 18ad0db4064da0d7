"""`autotune estimate`: the memory model's answer for one config, before any probe runs.

With `--study` the study's calibration (fitted on its probes, one device) replaces the prior
constants. Pure arithmetic, no torch import, unless `--trace`: then the probe's own step is
traced with fake tensors as one rank of the run (probe/trace.py) and its per-phase peaks are
printed beside the model's.
"""

from __future__ import annotations

import json
from typing import Any

import click

from autotune.cli import options as opt


@click.command()
@opt.model
@opt.model_path
@opt.nnodes
@opt.gpus_per_node
@opt.device
@opt.algorithm
@opt.set_knobs
@click.option("--capacity", "capacity_bytes", type=opt.SIZE, default=None, metavar="SIZE",
              help="Memory of the device planned for (default: this machine's GPU, else "
                   "80GiB; host RAM with --device cpu).")
@opt.gpu_memory_limit
@opt.reserve_gpu_memory
@opt.host_memory
@opt.host_memory_limit
@opt.trainer
@opt.headroom
@opt.dtype
@opt.engine
@opt.study
@opt.results_dir
@opt.storage
@click.option("--response-length", type=click.IntRange(1, 2**24), default=None, metavar="N",
              help="Answer at responses of N tokens, the length the run's responses reach "
                   "now (max_response_length is the worst case they may grow to).")
@click.option("--trace", is_flag=True,
              help="Also trace the probe's own step with fake tensors, as rank 0 of the run "
                   "(no GPU, no weights; seconds for small models, about a minute for 7B).")
@click.option("--bisect-length", is_flag=True,
              help="With --trace: find the traced length headroom by further traces (up to "
                   "about a dozen, each as long as the first) instead of from the one trace "
                   "and the memory model's growth with the length.")
@opt.as_json
def estimate(capacity_bytes: int | None, host_memory_bytes: int | None, headroom: float,
             study: str | None, results_dir: str, storage: str | None,
             response_length: int | None, trace: bool, bisect_length: bool, as_json: bool,
             **given: Any) -> None:
    """Estimate peak memory per GPU and phase, without running anything.

    \b
    autotune estimate --model qwen2.5-7b --gpus-per-node 8
    autotune estimate --model qwen2.5-vl-7b --nnodes 2 --gpus-per-node 8 \\
        --set gradient_checkpointing=true
    autotune estimate --model tiny-qwen2.5 --device cpu --capacity 545MiB
    autotune estimate --trace --model qwen2.5-7b --gpus-per-node 8
    autotune estimate --trace --bisect-length --model qwen2.5-7b --gpus-per-node 8
    autotune estimate --study tiny-qwen2.5-cpu-demo --set micro_batch_size_experience=16
    autotune estimate --model qwen2.5-7b --gpus-per-node 8 --set max_response_length=2048 \\
        --response-length 512
    autotune estimate --model qwen2.5-vl-7b --gpus-per-node 8 --trainer easyr1 \\
        --host-memory 760GB --set offload_params=true --set offload_optimizer=true
    """
    from autotune.errors import ConfigError
    from autotune.estimates import estimate as estimate_run

    if bisect_length and not trace:
        raise ConfigError("--bisect-length: only with --trace (it bisects the traced length "
                          "headroom)")
    answer = estimate_run(opt.take_probe_options(given), capacity_bytes, headroom, study,
                          results_dir, storage, response_length, host_memory_bytes,
                          given["trainer"], trace, bisect_length,
                          say=lambda line: click.echo(line, err=True))
    click.echo(json.dumps(answer.as_dict(), indent=2) if as_json else answer.text())
