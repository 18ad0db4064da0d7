"""Before the first probe: can this model run on this device at all, and is the space valid
for this model? Refused at once, in one line, instead of a sweep of OOMs or invalid trials.

Three checks, all arithmetic (the memory model's exact part and the registry; no torch):

- a model that is not one of the tiny registry models, on a machine where --device auto found
  no NVIDIA GPU, is refused: the probes would run on the CPU (minutes to hours each, or a
  host OOM), which nobody asking for `--model qwen2.5-vl-7b` meant;
- the model states one rank holds in the update (16 bytes per parameter: fp32 weights, grads,
  AdamW, FSDP-sharded over the run's W GPUs) must fit the device (its --gpu-memory-limit, the
  GPU, or host RAM on the CPU);
- a VL model's image must fit its prompt (the image tokens are part of max_prompt_length).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from autotune.config import ProbeConfig, format_bytes, model_problems
from autotune.errors import ConfigError
from autotune.hardware import gpu_capacity_bytes, has_nvidia_gpu, host_memory_bytes
from autotune.memory.model import estimate_memory, model_shape, model_state_bytes
from autotune.registry import REGISTRY


def probe_device(request: Any) -> str:
    """Where this machine's probes of `request` run: cuda or cpu."""
    if request.device == "auto":
        return "cuda" if has_nvidia_gpu() else "cpu"
    return request.device


def capacity_bytes(request: Any, device: str) -> int | None:
    """The memory a probe may use on `device`: the limit asked for, else what is there."""
    found = gpu_capacity_bytes() if device == "cuda" else host_memory_bytes()
    limits = [x for x in (request.gpu_memory_limit_bytes, found) if x]
    if found and request.reserve_gpu_memory_bytes:
        limits.append(found - request.reserve_gpu_memory_bytes)
    return min(limits) if limits else None


def check_model_on_device(request: Any, config: ProbeConfig, device_checks: bool = True,
                          what: str = "the sweep") -> None:
    """ConfigError when the model cannot be probed here with `config` (the space's safe
    config for a sweep: if it cannot fit, nothing can). Without `device_checks` (probes on a
    Ray cluster, whose devices are elsewhere) only the model's own rules are checked."""
    name = request.model_path or request.model
    shape = model_shape(request.model, request.model_path)
    problems = [f"{what}: {p}" for p in model_problems(config, shape.is_vl)]
    if not device_checks:
        if problems:
            raise ConfigError(problems)
        return
    device = probe_device(request)
    world = request.world_size
    states = model_state_bytes(shape.num_params, world).update_bytes
    billions = f"{shape.num_params / 1e9:.2f}B params"
    per_rank = "" if world == 1 else f" per rank of {world}"
    tiny = request.model_path is None and REGISTRY[request.model].tiny
    if device == "cpu" and request.device == "auto" and not tiny:
        need = estimate_memory(shape, replace(config, rollout_engine="hf"), num_gpus=world,
                               on_gpu=True).peak_bytes
        raise ConfigError(
            f"no NVIDIA GPU found on this machine (only the CPU), so probes would run there; "
            f"{name} ({billions}) needs about {format_bytes(need)} of GPU memory{per_rank} at "
            f"the smallest config ({format_bytes(states)} of it model states). Plan it here "
            f"with `autotune estimate --model {request.model} --gpus-per-node "
            f"{max(world, 8)}`, run it on a GPU machine, or try the CPU demo: `autotune run` "
            "(pass --device cpu to probe it on the CPU anyway)")
    if device == "cpu" and config.rollout_engine == "vllm-like" \
            and request.gpu_memory_limit_bytes is None:
        problems.append("rollout_engine=vllm-like on the CPU reserves a share of the device "
                        "cap: add --gpu-memory-limit (e.g. 1GiB), or use --engine hf")
    if problems:
        raise ConfigError(problems)
    capacity = capacity_bytes(request, device)
    if capacity is not None and states > capacity:
        where = "the GPU" if device == "cuda" else "the CPU's memory"
        more = "more GPUs (--gpus-per-node, --nnodes), " if world < 64 else ""
        raise ConfigError(
            f"{name} ({billions}) needs {format_bytes(states)} of model states{per_rank} in "
            f"the update alone (16 bytes per parameter: fp32 weights, grads and AdamW, "
            f"sharded over the run's {world} GPU{'s' if world > 1 else ''}), more than the "
            f"{format_bytes(capacity)} a probe may use on {where}; use {more}a larger "
            "device, a higher --gpu-memory-limit, or a smaller model")
