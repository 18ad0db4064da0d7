"""Memory per role when the rollout engine has GPUs of its own (separate placement).

Colocated (model.estimate_memory), every GPU holds the trainer's states and the engine, and the
phases take turns on it. Separate, the run's W GPUs split in two roles:

- **engine GPUs** (`rollout_gpus` of them, an engine per `rollout_tensor_parallel`): the
  engine's reservation (gpu_memory_utilization of the GPU, or its KV pool in bytes beside its
  weights: weights, KV pool and activations inside it), awake for the whole run (its sleep is
  a no-op there: verl's standalone replicas), the weight sync's receive buffers outside that
  reservation, and what lives outside torch. No trainer state.
- **trainer GPUs** (the other W - rollout_gpus): the trained phases (experience, the critic's
  update, the update) on W - rollout_gpus ranks with the states sharded over them, no engine
  copy held or asleep, offload only where asked; and the weight sync, which brings the
  actor's params back where they are offloaded, gathers one whole tensor at a time beside the
  resident states and sends it through bucket buffers.

The sync's buffers follow verl 0.7.1's checkpoint engine (docs/research/placement.md,
section 5): a trainer rank holds two buckets (nccl_checkpoint_engine.py: "overhead is 2 *
bucket_size"), an engine GPU three (the checkpoint-engine worker's two and the server's IPC
buffer), each `update_weights_bucket_megabytes`, 2,048 MiB by default; verl refuses a tensor
larger than a bucket. Pure arithmetic over model.py's and phases.py's terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import (
    DTYPE_BYTES,
    SYNC_PHASE,
    ProbeConfig,
    compute_dtype,
    format_bytes,
)
from autotune.memory.model import (
    CPU_CONTEXT_BYTES,
    MemoryEstimate,
    allocator_reserve,
    host_offload_bytes,
    sequence_slice,
    with_allocator_reserve,
)
from autotune.memory.outside_torch import outside_torch
from autotune.memory.phases import (
    PhaseEstimate,
    critic_update_phase,
    engine_asleep_bytes,
    engine_reservation_bytes,
    experience_phase,
    update_phase,
)
from autotune.memory.shape import ModelShape
from autotune.memory.states import (
    PARAM_BYTES,
    Sizing,
    resident_bytes,
    shard_bytes,
    wake_gather_bytes,
)
from autotune.memory.workspaces import CUBLAS_WORKSPACES_BYTES

SYNC_BUCKET_BYTES = 2048 << 20  # verl 0.7.1's update_weights_bucket_megabytes default
TRAINER_SYNC_BUCKETS = 2  # a trainer rank's send buffers
ENGINE_SYNC_BUCKETS = 3  # an engine GPU's: the checkpoint-engine worker's two, the server's one
ROLE_COLUMN = 24  # "trainer GPU (one of 63)" and a space


@dataclass(frozen=True)
class PlacementEstimate:
    """One engine GPU's estimate and one trainer GPU's, for a run of `rollout_gpus` engine
    GPUs and `trainer_gpus` trainer GPUs."""

    engine: MemoryEstimate
    trainer: MemoryEstimate
    rollout_gpus: int
    trainer_gpus: int

    @property
    def binding_role(self) -> str:
        """The role whose GPU needs more (both roles' GPUs are the node's, of one size)."""
        return "engine" if self.engine.peak_bytes >= self.trainer.peak_bytes else "trainer"

    @property
    def by_phase(self) -> MemoryEstimate:
        """Both roles as one estimate of phases, each on the GPU that runs it (the engine's
        rollout, the trainer's sync and trained phases): what a split probe reports, one peak
        per phase from the side that ran it; its peak is the binding role's."""
        return MemoryEstimate({"rollout": self.engine.phases["rollout"],
                               **self.trainer.phases},
                              self.trainer.host_offload_bytes, self.trainer.share)


def estimate_placement(shape: ModelShape, config: ProbeConfig, world_size: int,
                       rollout_gpus: int, capacity_bytes: int, on_gpu: bool = True,
                       compute_bytes: int | None = None,
                       sync_bucket_bytes: int = SYNC_BUCKET_BYTES) -> PlacementEstimate:
    """Peak bytes per GPU of each role of a run whose engine has `rollout_gpus` of the
    `world_size` GPUs to itself (`capacity_bytes` each), the rest training."""
    if not config.engine_reserves:
        raise ValueError(f"rollout_engine={config.rollout_engine}: an engine on GPUs of its "
                         "own is a served one, with vLLM's memory (vllm, vllm-like)")
    if not 0 < rollout_gpus < world_size:
        raise ValueError(f"rollout_gpus={rollout_gpus}: the engine takes 1 to "
                         f"{world_size - 1} of the run's {world_size} GPUs")
    engine, trainer = (role_estimate(shape, config, world_size, rollout_gpus, capacity_bytes,
                                     role, on_gpu, compute_bytes, sync_bucket_bytes)
                       for role in ("engine", "trainer"))
    return PlacementEstimate(engine, trainer, rollout_gpus, world_size - rollout_gpus)


def role_estimate(shape: ModelShape, config: ProbeConfig, world_size: int, rollout_gpus: int,
                  capacity_bytes: int, role: str, on_gpu: bool = True,
                  compute_bytes: int | None = None,
                  sync_bucket_bytes: int = SYNC_BUCKET_BYTES) -> MemoryEstimate:
    """One GPU of `role` (engine | trainer) of estimate_placement's run, the other role left
    unsized (a trainer's GPU sketches the allocator: tens of milliseconds)."""
    width = compute_bytes or DTYPE_BYTES[compute_dtype("auto", on_gpu)]
    if role == "engine":
        return engine_gpu(Sizing(shape, config, 1, width, on_gpu), rollout_gpus,
                          capacity_bytes, sync_bucket_bytes)
    trainer_gpus = world_size - rollout_gpus
    return trainer_gpu(Sizing(shape, config, trainer_gpus, width, on_gpu), trainer_gpus,
                       sync_bucket_bytes)


def role_peak_bytes(shape: ModelShape, config: ProbeConfig, world_size: int,
                    rollout_gpus: int, capacity_bytes: int, role: str, on_gpu: bool = True,
                    compute_bytes: int | None = None,
                    sync_bucket_bytes: int = SYNC_BUCKET_BYTES) -> int:
    """Peak bytes of one GPU of `role` (role_estimate's)."""
    return role_estimate(shape, config, world_size, rollout_gpus, capacity_bytes, role, on_gpu,
                         compute_bytes, sync_bucket_bytes).peak_bytes


def engine_gpu(s: Sizing, rollout_gpus: int, capacity_bytes: int,
               sync_bucket_bytes: int) -> MemoryEstimate:
    """One engine GPU: the engine's reservation, the sync's receive buffers and what lives
    outside torch (the engine's own TP communicator)."""
    reservation = engine_reservation_bytes(s, capacity_bytes)
    sync = ENGINE_SYNC_BUCKETS * sync_bucket_bytes
    context = outside_torch(rollout_gpus, False, s.config.rollout_tensor_parallel).total_bytes \
        if s.on_gpu else CPU_CONTEXT_BYTES
    rollout = PhaseEstimate(reservation, sync, context,
                            {"engine_reservation": reservation, "sync_buffers": sync})
    return MemoryEstimate({"rollout": rollout}, 0, s.config.share(rollout_gpus))


def trainer_gpu(s: Sizing, trainer_gpus: int, sync_bucket_bytes: int) -> MemoryEstimate:
    """One trainer GPU: the weight sync and the trained phases on `trainer_gpus` ranks, with
    no engine beside them; on a GPU each adds the caching allocator's reserve."""
    config = s.config
    trained, share = sequence_slice(s), config.trained_share(trainer_gpus)
    context = outside_torch(trainer_gpus, False, 1).total_bytes if s.on_gpu \
        else CPU_CONTEXT_BYTES
    phases = {SYNC_PHASE: weight_sync_phase(s, sync_bucket_bytes, context),
              "experience": experience_phase(trained, share, {}, context)}
    if config.has_critic:
        phases["critic_update"] = critic_update_phase(trained, share, {}, context)
    phases["update"] = update_phase(trained, share, {}, context)
    if s.on_gpu:
        reserve = allocator_reserve(s.shape, config, num_gpus=trainer_gpus,
                                    compute_bytes=s.compute_bytes, state_shards=s.shards)
        # the sync lays out no reserve, but holds the workspaces the steps made
        reserve[SYNC_PHASE] = CUBLAS_WORKSPACES_BYTES
        phases = with_allocator_reserve(phases, reserve)
    host = host_offload_bytes(s) - engine_asleep_bytes(s)  # no engine here to sleep
    return MemoryEstimate(phases, host, config.share(trainer_gpus))


def weight_sync_phase(s: Sizing, sync_bucket_bytes: int, context: int) -> PhaseEstimate:
    """The trainer's side of a weight sync: its resident states, the actor's params brought
    back where they are offloaded, one whole tensor gathered at a time (states.py's
    wake_gather_bytes: the same gather as a colocated engine's wake-up) and the send
    buffers."""
    params = shard_bytes(PARAM_BYTES, s.shape.num_params, s.shards) \
        if s.config.offload_params else 0
    states = {"resident": resident_bytes(s), "actor_params": params}
    sending = {"gathered_tensor": wake_gather_bytes(s),
               "sync_buffers": TRAINER_SYNC_BUCKETS * sync_bucket_bytes}
    return PhaseEstimate(sum(states.values()), sum(sending.values()), context,
                         {**states, **sending})


def format_placement(name: str, shape: ModelShape, config: ProbeConfig,
                     placed: PlacementEstimate, capacity_bytes: int, budget_bytes: int,
                     headroom: float, compute: str) -> str:
    """What `autotune estimate` prints for a separate placement: each role's phases per GPU,
    each role's peak against the budget, and which binds."""
    tp = config.rollout_tensor_parallel
    engines = placed.rollout_gpus // tp
    lines = [f"{name}: {shape.num_params / 1e9:.3f}B params, separate placement: the engine "
             f"on {placed.rollout_gpus} GPU{'s' if placed.rollout_gpus > 1 else ''} "
             f"({engines} engine{'s' if engines > 1 else ''} of tensor parallel {tp}), the "
             f"trainer on {placed.trainer_gpus} (FSDP); {compute} compute; capacity "
             f"{format_bytes(capacity_bytes)} per device, budget {format_bytes(budget_bytes)} "
             f"at {headroom:.0%} headroom", "memory model: the prior (no calibration of a "
             "separate placement yet)"]
    verdicts = []
    for role, memory, gpus in (("engine", placed.engine, placed.rollout_gpus),
                               ("trainer", placed.trainer, placed.trainer_gpus)):
        binding = memory.binding_phase
        lines += ["", f"{role + ' GPU (one of ' + str(gpus) + ')':<{ROLE_COLUMN}}"
                      f"{'model states':>14}{'transient':>12}{'context':>11}{'total':>12}"
                      f"{'of capacity':>13}"]
        for phase, part in memory.phases.items():
            mark = "  <- binds" if phase == binding else ""
            lines.append(f"  {phase:<{ROLE_COLUMN - 2}}{format_bytes(part.states_bytes):>14}"
                         f"{format_bytes(part.transient_bytes):>12}"
                         f"{format_bytes(part.context_bytes):>11}"
                         f"{format_bytes(part.total_bytes):>12}"
                         f"{part.total_bytes / capacity_bytes:>12.0%}{mark}")
        terms = ", ".join(f"{k} {format_bytes(v)}"
                          for k, v in memory.phases[binding].parts.items() if v)
        peak = memory.peak_bytes
        verdict = "fits" if peak <= budget_bytes else (
            "over the headroom budget" if peak <= capacity_bytes else "does not fit")
        lines.append(f"  {role}'s peak: {binding}, {format_bytes(peak)} ({verdict}); "
                     f"prior terms: {terms}")
        verdicts.append((peak, role))
    peak, role = max(verdicts)
    lines += ["", f"binds: the {role}'s GPUs, {format_bytes(peak)} of the "
                  f"{format_bytes(budget_bytes)} budget ({peak / budget_bytes:.0%})"]
    return "\n".join(lines)
