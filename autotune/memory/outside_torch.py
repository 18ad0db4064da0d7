"""What a GPU process holds beyond PyTorch's caching allocator: the terms NVML counts and
`torch.cuda.max_memory_reserved()` does not.

An OOM is decided by the card: the allocator's reserved peak (memory/replay.py replays it)
plus what lives outside torch. Each term is named here, with where its figure comes from:

- `cuda_context_bytes`: the CUDA context with its lazily loaded kernel modules (cuBLAS,
  the step's own kernels). Measured on an H200 with torch 2.11 and CUDA 13 as NVML's process
  figure less torch's reserved peak (benchmarks/results/gpu/: the main run and the three
  held-out grids), each probe's largest phase, by topology more than by model: one GPU 758
  to 808 MiB over 12 probes of 0.5B to VL-7B, a rank of a sharded run 828 to 928 MiB over
  31 (ranks of 2 to 8, emulated: FSDP's own kernels are loaded too; a rank's rollout or
  experience can be lower, to 756). The priors are the two medians; a sweep replaces them
  with what its own probes measured (NVML less reserved: both are read by every probe).
- `nccl_bytes`: NCCL's buffers, allocated by NCCL itself, per communicator a rank is in
  (the FSDP group; a rollout tensor-parallel group): NCCL_BUFFSIZE 4 MiB and its LL and
  LL128 buffers per channel and peer. 512 MiB a communicator is the prior, from reports of
  544 to 688 MB on 4 x A100 (NVIDIA/nccl#964) and 512 MiB for one rank on B300
  (NVIDIA/nccl#2363); not yet measured here. Emulated ranks (the fake process group) and a
  single GPU have none.

cuBLAS's workspaces (32 MiB per handle and stream on Hopper) are allocated through the
caching allocator, so they are in its reserved figure, not here (workspaces.py). No torch
here.
"""

from __future__ import annotations

from dataclasses import dataclass

CUDA_CONTEXT_ONE_GPU_BYTES = 780 << 20  # the median of 758 to 808 MiB on an H200
CUDA_CONTEXT_RANK_BYTES = 852 << 20  # a sharded run's rank: the median of 828 to 928 MiB
NCCL_COMMUNICATOR_BYTES = 512 << 20


@dataclass(frozen=True)
class OutsideTorch:
    """One GPU process's memory outside the caching allocator, by term."""

    cuda_context_bytes: int
    nccl_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.cuda_context_bytes + self.nccl_bytes

    def terms(self) -> dict[str, int]:
        return {"cuda_context": self.cuda_context_bytes, "nccl": self.nccl_bytes}


def nccl_communicators(world_size: int, emulated: bool, rollout_tensor_parallel: int) -> int:
    """The NCCL communicators one rank is in: the FSDP group across the run and, when the
    engine is split over several GPUs, its tensor-parallel group; none on one GPU or over
    the fake process group."""
    if world_size <= 1 or emulated:
        return 0
    return 1 + (1 if rollout_tensor_parallel > 1 else 0)


def outside_torch(world_size: int = 1, emulated: bool = False,
                  rollout_tensor_parallel: int = 1,
                  cuda_context_bytes: int | None = None) -> OutsideTorch:
    """The terms for one rank of a run of `world_size` GPUs; `cuda_context_bytes`: a
    measured context in place of the prior (a sharded run's rank's, or one GPU's)."""
    prior = CUDA_CONTEXT_RANK_BYTES if world_size > 1 else CUDA_CONTEXT_ONE_GPU_BYTES
    context = prior if cuda_context_bytes is None else cuda_context_bytes
    return OutsideTorch(context, NCCL_COMMUNICATOR_BYTES * nccl_communicators(
        world_size, emulated, rollout_tensor_parallel))
