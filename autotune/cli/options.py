"""Every option of the `autotune` commands, declared once, and the typed values they give.

A command stacks the options it takes (pip-tools' options module): one spelling, one help
text and one parser per option, so `run`, `probe` and `estimate` agree on every option they
share. Choices are read from the library's own tables. Values are parsed as they are read
(sizes, durations, shares, GPU ids, --set): a bad one is a ConfigError, one line and exit 2.
No torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from autotune.config import (
    ALGORITHMS,
    DEFAULT_HEADROOM,
    DTYPE_CHOICES,
    engine_choices,
    parse_assignments,
    parse_bytes,
    parse_duration_s,
    parse_headroom,
)
from autotune.errors import ConfigError
from autotune.hardware import DEVICE_CHOICES
from autotune.runners import EXECUTORS
from autotune.sweep.plan import ProbeOptions
from autotune.sweep.study.objective import OBJECTIVES
from autotune.sweep.study.settings import SAMPLERS
from autotune.trainers import ADAPTERS

Decorator = Callable[[Any], Any]


class _Parsed(click.ParamType):
    """A value parsed by one of the library's parsers, which names the flag when it refuses."""

    def __init__(self, name: str, parse: Callable[[str, str], Any]) -> None:
        self.name, self.parse = name, parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None
                ) -> Any:
        if not isinstance(value, str):
            return value  # a default already parsed
        flag = param.opts[0] if param is not None and param.opts else self.name
        return self.parse(value, flag)


def _gpu_ids(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected ids such as 0 or 0,1") from None


SIZE = _Parsed("size", lambda text, flag: parse_bytes(text, flag))
SIZE_OR_ZERO = _Parsed("size", lambda text, flag: parse_bytes(text, flag, allow_zero=True))
DURATION = _Parsed("duration", parse_duration_s)
SHARE = _Parsed("share", lambda text, flag: parse_headroom(text))
GPU_IDS = _Parsed("ids", _gpu_ids)


# -- the model, the device, the run being tuned: every command that probes or estimates -----

model = click.option("--model", default=None, metavar="NAME",
                     help="Registry model (see `autotune models`), e.g. qwen2.5-vl-7b.")
model_path = click.option("--model-path", type=click.Path(file_okay=False), default=None,
                          help="A local Hugging Face checkpoint or config directory, instead "
                               "of a registry model (its config.json is read, its weights "
                               "loaded where a probe runs; `models` lists it too).")
device = click.option("--device", type=click.Choice(DEVICE_CHOICES), default="auto",
                      show_default=True,
                      help="Where probes run; auto: cuda where an NVIDIA GPU is visible, else "
                           "cpu (`estimate` plans a GPU run unless --device cpu).")
gpu_memory_limit = click.option(
    "--gpu-memory-limit", "gpu_memory_limit_bytes", type=SIZE, default=None, metavar="SIZE",
    help="Cap on device memory per probe, e.g. 40GiB (tunes for a smaller GPU; on a CPU "
         "caps the probe's device RSS).")
reserve_gpu_memory = click.option(
    "--reserve-gpu-memory", "reserve_gpu_memory_bytes", type=SIZE_OR_ZERO, default="0",
    metavar="SIZE", help="Device memory left free for a co-located process such as a "
                         "retriever, e.g. 6GiB (default: 0).")
nnodes = click.option("--nnodes", type=click.IntRange(1), default=None,
                      help="Nodes of the training run (default: a trainer base config's; "
                           "else 1, or for `export` the study's).")
gpus_per_node = click.option(
    "--gpus-per-node", type=click.IntRange(1), default=None,
    help="GPUs per node of that run (default: a trainer base config's; else the GPUs visible "
         "here, 1 on a CPU, or for `export` the study's): each takes an equal share of every "
         "batch.")
engine = click.option("--engine", type=click.Choice(("auto", *engine_choices())),
                      default="auto", show_default=True,
                      help="Rollout engine's memory: vllm-like reserves gpu_memory_utilization "
                           "of the device (EasyR1, verl); hf grows a KV cache with the batch "
                           "(TRL). auto: vllm-like on a GPU, hf for --trainer trl and on a CPU.")
dtype = click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto",
                     show_default=True, help="Compute dtype; auto: bf16 on a GPU, fp32 on a CPU.")
set_knobs = click.option("--set", "knobs", multiple=True, metavar="KEY=VALUE",
                         help="Set a knob, repeatable: --set micro_batch_size_update=8; with "
                              "--trainer, also the trainer's own keys (num_generations, "
                              "ppo_micro_batch_size_per_gpu, ...).")
algorithm = click.option(
    "--algorithm", type=click.Choice(ALGORITHMS), default=None,
    help="grpo (no critic) or ppo (GAE with a critic on the same GPUs; rollout_n 1 unless "
         "set). Default: a trainer base config's estimator, else the space's, else grpo; the "
         "same as --set algorithm=...")
headroom = click.option("--headroom", type=SHARE, default=f"{DEFAULT_HEADROOM:.0%}",
                        show_default=True,
                        help="Device memory kept free in every phase of a feasible config.")

# -- how a probe runs: `probe` and `run` --------------------------------------------------

gpus = click.option("--gpus", type=GPU_IDS, default=None, metavar="IDS",
                    help="GPU ids to pin probes to, e.g. 0 or 0,1 (default: all visible).")
threads = click.option("--threads", "cpu_threads", type=click.IntRange(1), default=None,
                       help="CPU threads per probe (default: torch's choice).")
host_memory_limit = click.option(
    "--host-memory-limit", "host_memory_limit_bytes", type=SIZE, default=None,
    metavar="SIZE", help="Cap on the probe tree's host RSS, e.g. 64GiB; past it the probe is "
                         "killed and classified host_oom.")
host_memory = click.option(
    "--host-memory", "host_memory_bytes", type=SIZE, default=None, metavar="SIZE",
    help="RAM of one node of the run, e.g. 1TiB: a config whose node's host memory passes "
         "where the OOM killer acts (Ray's memory monitor at RAY_memory_usage_threshold, "
         "0.95) is predicted host_oom; `run` then never probes it (without it, the verdict "
         "is stated for this machine's RAM).")
probe_timeout = click.option("--probe-timeout", "probe_timeout_s", type=DURATION,
                             default="15m", show_default=True,
                             help="Wall-clock limit per probe: 90s, 15m, 2h.")
ranks = click.option("--ranks", type=click.Choice(("auto", "real", "emulated")),
                     default="auto", show_default=True,
                     help="With more than one GPU in the run: real ranks (one process per GPU, "
                          "needs them here) or one emulated rank (exact per-rank memory on "
                          "one device, time without communication); auto: see docs/sweep.md.")
MAX_PROBE_STEPS = 100  # warm-up or timed steps a probe may be told to run: more would hold a
# probe past any --probe-timeout a user means
warmup_steps = click.option("--warmup-steps", type=click.IntRange(0, MAX_PROBE_STEPS), default=1,
                            show_default=True, help="Untimed steps before timing.")
timed_steps = click.option("--timed-steps", type=click.IntRange(1, MAX_PROBE_STEPS), default=None,
                           help="Timed steps averaged into the figures, exactly (default: 2 "
                                "short steps at least, more while the step's standard error "
                                "is over 1%; with --full-steps 3, more while under 2 s).")
full_steps = click.option("--full-steps", is_flag=True, default=False,
                          help="Run every micro-batch, mini-batch and generation wave of every "
                               "step. By default a probe is short: each loop's first units "
                               "and its last, the step's time predicted from them "
                               "(docs/probe-and-engine.md).")
seed = click.option("--seed", type=click.IntRange(0, 2**32 - 1), default=0, show_default=True,
                    help="Random seed of the probes and the sampler.")

# -- studies ----------------------------------------------------------------------------

study = click.option("--study", default=None,
                     help="Study name: `run` makes or resumes it (default MODEL-SPACE); `show`, "
                          "`report` and `export` read it (default: the latest in "
                          "--results-dir); `estimate` uses its calibration.")
results_dir = click.option("--results-dir", type=click.Path(file_okay=False),
                           default="results", show_default=True,
                           help="Where results/<study>/ is.")
storage = click.option("--storage", default=None, metavar="URL|FILE",
                       help="A study several drivers share: a PostgreSQL URL or a journal file "
                            "on a shared disk (default: SQLite in results/<study>/).")

# -- the trainer --------------------------------------------------------------------------

trainer = click.option("--trainer", type=click.Choice(tuple(ADAPTERS)), default=None,
                       help="The trainer whose config is written (best.<trainer>.yaml, "
                            "`export`: required) and whose rules every config must pass.")
base_config = click.option(
    "--base-config", type=click.Path(dir_okay=False), default=None,
    help="Your config: with --trainer your trainer's own YAML (an export changes only the keys "
         "it writes, listed in its header), else a YAML of knobs. A sweep holds its values "
         "fixed, or tries them first where it searches them.")

# -- output -------------------------------------------------------------------------------

as_json = click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
out_path = click.option("--out", "out_path", type=click.Path(), default=None,
                        metavar="FILE", help="Where to write it (default: in "
                                             "results/<study>/; never over another file).")

# -- `run` only: the search and where probes run -------------------------------------------

objective = click.option("--objective", type=click.Choice(OBJECTIVES),
                         default=OBJECTIVES[0], show_default=True)
sampler = click.option("--sampler", type=click.Choice(SAMPLERS), default=SAMPLERS[0],
                       show_default=True, help="Optuna sampler (seeded with --seed).")
executor = click.option("--executor", type=click.Choice(EXECUTORS), default=EXECUTORS[0],
                        show_default=True,
                        help="Where probes run: subprocesses here, or Ray tasks on a Ray "
                             "cluster (pip install 'autotune[ray]').")


def stack(*options: Decorator) -> Decorator:
    """The options as one decorator, in the order given (as --help lists them)."""
    def decorate(command: Any) -> Any:
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


# what `probe` and `run` take to make their probes (ProbeOptions' fields)
probe_options = stack(model, model_path, device, gpus, threads, gpu_memory_limit,
                      reserve_gpu_memory, host_memory_limit, probe_timeout, nnodes,
                      gpus_per_node, ranks, warmup_steps, timed_steps, full_steps, engine,
                      dtype, seed,
                      algorithm, set_knobs)
study_options = stack(study, results_dir, storage)  # every command that reads a study


def take_probe_options(given: dict[str, Any]) -> ProbeOptions:
    """The ProbeOptions among a command's parsed options (removed from `given`); --set is
    read as knobs, and as the trainer's own keys where the command has --trainer."""
    fields = ProbeOptions.__dataclass_fields__
    chosen = given.pop("algorithm", None)
    values = {name: given.pop(name) for name in list(given) if name in fields}
    translate = None
    if given.get("trainer") is not None:
        from autotune.config import Topology
        from autotune.trainers import get_adapter

        adapter = get_adapter(given["trainer"])
        topology = Topology(values.get("nnodes") or 1, values.get("gpus_per_node") or 1)
        topology_given = values.get("gpus_per_node") is not None

        def translate(keys: dict[str, Any]) -> dict[str, Any]:
            return adapter.knobs_of_keys(keys, topology, topology_given)
    values["knobs"] = parse_assignments(values.get("knobs", ()), translate)
    if chosen is not None:
        if values["knobs"].get("algorithm", chosen) != chosen:
            raise ConfigError(f"--algorithm {chosen} but --set algorithm="
                              f"{values['knobs']['algorithm']}; give one")
        values["knobs"]["algorithm"] = chosen
    return ProbeOptions(**values)
