"""One rank of a W-rank FSDP run: the process group, FSDP wrapping, and sharded tensors.

A probe of a run on W > 1 GPUs shards as the trainers' FSDP workers do, with the wrapper the
trainer uses (`fsdp_strategy`):

- fsdp (FSDP1, `FullyShardedDataParallel`): EasyR1's workers and verl's default
  `strategy: fsdp` (verl/workers/fsdp_workers.py, EasyR1's the same): FULL_SHARD, every
  decoder layer and vision block a unit (transformer auto-wrap over `_no_split_modules`),
  one flat parameter a unit (use_orig_params=False), bf16 params, fp32 gradient reduction
  and buffers, no forward prefetch;
- fsdp2 (`fully_shard`, verl's `strategy: fsdp2`): the same units, per-parameter DTensor
  shards.

Either way: fp32 master weights, gradients and AdamW state sharded over W; compute in the
mixed-precision dtype, gradients reduced in fp32; each wrapper gathers and reduces on its
own CUDA streams, whose blocks the caching allocator keeps apart.

The process group is real (one process per rank: NCCL on GPUs, gloo on CPUs, started by
launcher.py) or emulated: rank 0 of W in this one process over torch's fake process group,
where every shard, all-gather buffer, activation and optimizer state is a real allocation on
the real device but collectives move no data (torchtitan's memory estimator works the same
way). An emulated rank's memory is the real rank's; its time leaves out communication.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle
    from transformers import PreTrainedModel

COLLECTIVE_TIMEOUT_S = 120.0  # a rank whose peer died stops waiting after this

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the run: rank, world size, and whether peers are real."""

    rank: int
    world_size: int
    emulated: bool
    mesh: DeviceMesh  # over the W ranks


def rank_from_env() -> int:
    """This process's rank as launcher.py set it (0 when it is the only process)."""
    return int(os.environ.get("RANK", "0"))


def join_group(world_size: int, emulated: bool, device: torch.device) -> RankGroup:
    """Join the run's process group: real peers through MASTER_ADDR/PORT, or fake ones."""
    from torch.distributed.device_mesh import init_device_mesh

    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if emulated:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size,
                                timeout=timeout)
    else:
        on_gpu = device.type == "cuda"
        dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank_from_env(),
                                world_size=world_size, timeout=timeout,
                                device_id=device if on_gpu else None)
    mesh = init_device_mesh(device.type, (world_size,))
    return RankGroup(rank=dist.get_rank(), world_size=world_size, emulated=emulated, mesh=mesh)


def leave_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def shard_model(model: ModuleT, group: RankGroup, compute_dtype: torch.dtype,
                strategy: str = "fsdp2", lora: bool = False) -> ModuleT:
    """Each decoder layer and vision block a unit, then the root; the forward gathers one
    unit at a time in `compute_dtype`. fsdp2: in place, parameters become DTensor shards;
    fsdp: the FSDP1 wrapper returned, one flat fp32 shard a unit, which stands in for the
    model (it reads every attribute it lacks through to the model it wraps); with `lora`,
    FSDP1 also makes each trained leaf module a unit (lora.trained_leaf, verl's rule)."""
    units = set(getattr(model, "_no_split_modules", None) or ())
    if strategy == "fsdp":
        from torch.distributed.fsdp import (
            FullyShardedDataParallel,
            MixedPrecision,
            ShardingStrategy,
        )
        from torch.distributed.fsdp.wrap import (
            CustomPolicy,
            ModuleWrapPolicy,
        )

        from autotune.probe.modeling.lora import trained_leaf

        classes = {type(m) for m in model.modules() if type(m).__name__ in units}
        wrap: ModuleWrapPolicy | CustomPolicy = ModuleWrapPolicy(classes)
        if lora:
            wrap = CustomPolicy(lambda m: trained_leaf(m) or type(m) in classes)
        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=wrap,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            mixed_precision=MixedPrecision(param_dtype=compute_dtype,
                                           reduce_dtype=torch.float32,
                                           buffer_dtype=torch.float32),
            device_id=next(model.parameters()).device, use_orig_params=False,
            device_mesh=group.mesh, forward_prefetch=False)
        return cast(ModuleT, wrapped)  # used as the model: its attributes read through
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for module in model.modules():
        if module is not model and type(module).__name__ in units:
            fully_shard(module, mesh=group.mesh, mp_policy=policy)
    fully_shard(model, mesh=group.mesh, mp_policy=policy)
    return model


def is_fsdp1(model: torch.nn.Module) -> bool:
    """Whether `model` is FSDP1-wrapped (flat parameters, not DTensor shards)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(model, FullyShardedDataParallel)


def reshard_gathered(model: torch.nn.Module) -> None:
    """FSDP1 units still gathered after the update's backward resharded, as FSDP's own
    post-backward does on a GPU: under the trace's fake tensors a frozen unit (LoRA's root)
    kept its gathered params, and the next weight sync's state dict, which gathers each flat
    parameter from its shard, failed on it (held-out rows 03 and 10: FSDP1 with LoRA on an
    emulated rank). A unit already sharded is left as it is: on a GPU this changes nothing."""
    if not is_fsdp1(model):
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in FullyShardedDataParallel.fsdp_modules(model):
        handle = unit._handle
        if handle is not None and handle.uses_sharded_strategy and \
                handle.flat_param.numel() != handle.flat_param._local_shard.numel():
            handle.reshard(True)


def named_weights(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of each of the model's own parameters as the trainer's weight sync
    reads them: FSDP1's sharded state dict (one DTensor a parameter, EasyR1's and verl's
    get_model_state_dict), else the parameters (DTensors under FSDP2)."""
    from autotune.probe.modeling.lora import base_name, is_adapter

    if is_fsdp1(model):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        named = [(name, value) for name, value in get_model_state_dict(model).items()
                 if isinstance(value, torch.Tensor)]  # a model's state: tensors only
    else:
        named = list(model.named_parameters())
    # with LoRA, the base's weights by their names in the base model (the engine's); the
    # adapters are not the engine's weights
    return [(base_name(name), value) for name, value in named if not is_adapter(name)]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds: a DTensor's local shard, or the tensor itself."""
    return getattr(tensor, "_local_tensor", tensor)


def map_local(tensor: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`fn` applied to the rank's local shard, wrapped back into a DTensor if it was one."""
    local = local_tensor(tensor)
    if local is tensor:
        return fn(tensor)
    from torch.distributed.tensor import DTensor

    assert isinstance(tensor, DTensor)  # the one tensor with a local shard
    mapped = fn(local)
    # DTensor's own constructor, as DTensor.to("cpu") builds its result: from_local moves a
    # local that is on another device than the mesh's back to it, so an FSDP2 shard or AdamW
    # state offloaded through it came straight back to the GPU (held-out H200 rows 00 and
    # 08: the states stayed resident); verl offloads each with .to("cpu"), which keeps it
    return DTensor(mapped, tensor._spec, requires_grad=mapped.requires_grad)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on this rank (an all-gather of a DTensor; under the fake group the
    buffer is allocated and left as it is)."""
    if local_tensor(tensor) is tensor:
        return tensor
    from torch.distributed.tensor import DTensor

    assert isinstance(tensor, DTensor)  # the one tensor with a local shard
    return tensor.full_tensor()


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank holds of `tensors` (local shards of DTensors)."""
    total = 0
    for tensor in tensors:
        if tensor is not None:
            local = local_tensor(tensor)
            total += local.numel() * local.element_size()
    return total



def tensor_parallel_engine(engine: PreTrainedModel, group: RankGroup, tp: int
                           ) -> torch.nn.Module:
    """Shard the rollout engine over `tp` ranks with torch's tensor-parallel API, as vLLM
    shards it: q/k/v and the MLP's gate/up column-wise, o/down row-wise (so each rank keeps
    1/tp of the KV heads and of the KV cache), and an untied embedding and LM head over the
    vocabulary. Kept whole on every rank: norms, a tied embedding, the vision tower's
    attention (vLLM shards those too: the probe overstates them by (tp - 1) / tp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(group.mesh.device_type, (group.world_size // tp, tp),
                            mesh_dim_names=("dp", "tp"))["tp"]
    plan: dict[str, ParallelStyle] = {}
    for name, module in engine.named_modules():
        prefix = f"{name}." if name else ""
        if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            plan.update({f"{prefix}{n}": ColwiseParallel() for n in ("q_proj", "k_proj",
                                                                     "v_proj")})
            plan[f"{prefix}o_proj"] = RowwiseParallel()
        if all(hasattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")):
            plan.update({f"{prefix}gate_proj": ColwiseParallel(),
                         f"{prefix}up_proj": ColwiseParallel(),
                         f"{prefix}down_proj": RowwiseParallel()})
    head = engine.get_output_embeddings()
    if head is not None and head.weight is not engine.get_input_embeddings().weight:
        names = {id(m): n for n, m in engine.named_modules()}
        plan[names[id(engine.get_input_embeddings())]] = RowwiseParallel(
            input_layouts=Replicate())
        plan[names[id(head)]] = ColwiseParallel(output_layouts=Replicate())
    return parallelize_module(engine, mesh, plan)


def engine_part(whole: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The part of a whole weight an engine parameter holds on this rank: all of it, or its
    tensor-parallel shard (torch.chunk along the sharded dim, as DTensor splits)."""
    if local_tensor(param) is param:
        return whole
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(param, DTensor)  # the one tensor with a local shard
    placement = param.placements[0]
    if not isinstance(placement, Shard):
        return whole
    parts = param.device_mesh.size()
    return whole.chunk(parts, placement.dim)[param.device_mesh.get_local_rank()]


def free_storage(tensor: torch.Tensor) -> None:
    """Release a tensor's memory but keep its shape (FSDP's trick): the engine sleeps."""
    local_tensor(tensor).untyped_storage().resize_(0)


def fill_storage(tensor: torch.Tensor, values: torch.Tensor) -> None:
    """Allocate a slept tensor's memory again and copy `values` in: the engine wakes."""
    local = local_tensor(tensor)
    local.untyped_storage().resize_(local.numel() * local.element_size())
    local.copy_(values)
