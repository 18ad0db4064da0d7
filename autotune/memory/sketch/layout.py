"""The vocabulary of the allocator's sketches (step_reserve.py, rollout_reserve.py): what a
sketch needs of the model and the run (StepShape), the allocation events it writes in the
step's order (Stream), the states it finds on the device (state_tensors), and FSDP's unit
gathered and resharded on its streams: the all-gather copy-in stream with its kept output,
FSDP1's pre-unshard casts and recorded frees.
Sizes are per GPU; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

from autotune.config import autocast_casts_weights
from autotune.memory.replay import ALLOC, FREE, MARK, PHASE, RECORD, AllocatorSettings
from autotune.memory.workspaces import CUBLAS_WORKSPACE_BYTES

# a block's id, or blocks (nested as the step keeps them: per layer, per micro-batch) to free
Blocks: TypeAlias = "int | Sequence[Blocks]"
# FSDP's all-gather copy-in stream (the actor's, the reference's: each FSDP root has its own),
# reduce-scatter stream, and FSDP1's pre-unshard stream (its compute-dtype shard copies)
COPY_IN, REF_COPY_IN, REDUCE, PRE_UNSHARD, CRITIC_COPY_IN = 1, 2, 3, 4, 5
# Micro-batches laid out per optimizer step (and per log-prob forward), and optimizer
# steps per update, at most: the cache settles within them (the first step makes AdamW's
# state), so the reserve is the steady state's. A run with fewer lays out its own: one
# optimizer step an update leaves no freed AdamW temporaries for the next micro-batches to
# split, and the phase's end empties the cache (the trace of a VL-7B rank of 2: 6.5 GiB
# beyond its tensors, the sketch with two steps 13.5).
MICRO_BATCHES = 3
OPTIMIZER_STEPS = 2


@dataclass(frozen=True)
class StepShape:
    """What the sketch needs of the model, the config and the run, in elements and rows."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    layer_params: tuple[int, ...]  # one decoder layer's parameters, one entry each
    root_params: tuple[int, ...]  # the root unit's: embedding (and an untied head)
    shards: int  # FSDP ranks the states are sharded over (1: none)
    compute_bytes: int
    seq: int  # prompt + response tokens
    response: int
    update_rows: int  # sequences in the update's largest micro-batch
    experience_rows: int
    forwards: int  # log-prob forwards in the experience phase (old, reference)
    checkpointing: bool
    fused_logits: bool  # the logits path a chunk at a time (no whole-vocabulary blocks)
    with_reference: bool
    vision_block_params: tuple[int, ...] = ()  # a VL model's vision block (an FSDP unit)
    vision_blocks: int = 0
    vision_hidden: int = 0
    vision_intermediate: int = 0
    patches_per_row: int = 0  # vision patches of one sequence's image
    fused_optimizer: bool = False
    frozen_base: bool = False  # LoRA: no weight gradient nor AdamW state but the adapters'
    optimizer_offloaded: bool = False  # AdamW's state waits on the host outside the update
    fsdp1: bool = False  # sharded by FSDP1: a unit one flat parameter, its frees recorded
    critic_rows: int = 0  # PPO: the experience's value forward (its micro-batch's rows)
    critic_states: tuple[int, ...] = ()  # the critic's fp32 tensors a parameter on the
    # device through the experience (4: params, then AdamW's two unless offloaded)
    value_head: bool = False  # PPO's critic: a head of one output, not the root's last tensor
    reference_on_host: bool = False  # the reference's shards come to the device for its
    # forward alone (offloaded: config.ref_on_host)
    reference_root_kept: bool = False  # its root stays gathered between its forwards
    # (states.keeps_gathered_root)
    actor_root_kept: bool = False  # the experience's root still gathered as the update
    # starts, which places the actor's states (states.keeps_gathered_root: FSDP1's)
    # what the run has of each loop, at most what is laid out (MICRO_BATCHES, OPTIMIZER_STEPS)
    update_micro_batches: int = MICRO_BATCHES  # per optimizer step
    optimizer_steps: int = OPTIMIZER_STEPS  # per update

    @property
    def autocast_casts(self) -> bool:
        """Whether autocast casts the fp32 weights op by op (one GPU, a narrower compute
        dtype: config.autocast_casts_weights, as the memory model reads it)."""
        return autocast_casts_weights(self.shards, self.compute_bytes)


class Stream:
    """Allocation events as the step makes them."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._next = 0
        self.gathered = 0  # FSDP's last all-gather output, kept until the next is made
        self.reduce_input = 0  # FSDP's last reduce-scatter input, kept until the next
        self.copy_in = COPY_IN  # the stream of the model whose units are gathered now
        self.backward_workspace = 0  # the autograd thread's cuBLAS workspace, once made

    def alloc(self, size: int, stream: int = 0) -> int:
        self._next += 1
        if size > 0:
            self.events.append((ALLOC, self._next, int(size), stream))
        return self._next

    def free(self, *ids: Blocks) -> None:
        for item in ids:
            if not isinstance(item, int):
                self.free(*item)
            elif item:
                self.events.append((FREE, item))

    def phase(self, name: str | None) -> None:
        self.events.append((PHASE, name))

    def record(self, block: int, stream: int) -> None:
        """`record_stream`: the block is used on `stream` too (its reuse waits after a free)."""
        self.events.append((RECORD, block, stream))

    def first_backward_gemm(self) -> None:
        """The autograd thread's first GEMM: its cuBLAS handle's workspace is made here, in
        whatever cached block fits then, and held for the process's life
        (memory/workspaces.py)."""
        if not self.backward_workspace:
            self.backward_workspace = self.alloc(CUBLAS_WORKSPACE_BYTES)

    def mark(self) -> None:
        """FSDP1 resharded a unit (the replay's measure of how far the GPU runs behind)."""
        self.events.append((MARK,))


def gather_unit(out: Stream, s: StepShape, params: tuple[int, ...]) -> list[int]:
    """An FSDP unit unsharded: on the copy-in stream its input and output buffers (FSDP2's
    all-gather state keeps the last unit's output until the next one's is made), then its
    parameters copied out in the compute dtype on the default stream. FSDP1: its shard cast
    on the pre-unshard stream, gathered into one flat parameter used in place, the cast's
    free recorded on the all-gather stream (FlatParamHandle._free_low_precision_sharded_param)."""
    c, n = s.compute_bytes, s.shards
    if s.fsdp1:
        cast = out.alloc(c * sum(params) // n, PRE_UNSHARD)
        flat = out.alloc(c * sum(params), out.copy_in)
        out.record(cast, out.copy_in)
        out.free(cast)
        return [flat]
    staging = out.alloc(c * sum(params) // n, out.copy_in)
    buffer = out.alloc(c * sum(params), out.copy_in)
    out.free(staging, out.gathered)
    out.gathered = buffer
    return [out.alloc(c * p) for p in params]


def reshard_unit(out: Stream, s: StepShape, unit: list[int]) -> None:
    """An unsharded unit freed: FSDP1 records its flat parameter on the default stream first
    (FlatParamHandle._free_unsharded_flat_param), so its reuse waits for the GPU, and queues
    the reshard's free event (the replay's MARK)."""
    if s.fsdp1:
        for block in unit:
            out.record(block, 0)
        out.free(unit)
        out.mark()
    else:
        out.free(unit)


def gathered_done(out: Stream) -> None:
    """The forward or backward is over: the last all-gather output goes."""
    out.free(out.gathered)
    out.gathered = 0


DEFAULT_SETTINGS = AllocatorSettings()


def state_tensors(root_params: tuple[int, ...], layer_units: tuple[int, ...], layers: int,
                  shards: int) -> tuple[int, ...]:
    """The parameters of each tensor of one copy of the states (the fp32 params, an AdamW
    state, the reference), as they are allocated, before sharding. One GPU's a unit at a
    time, each sketch's own units of a layer (step_reserve.py's parameter blocks, as it
    lays the gradients and casts out too; rollout_reserve.py's tensors, as a module's
    parameters are: each past 10 MiB in a segment rounded up to 2 MiB, 0.37 GiB of slack in
    the 0.5B rollout's trace). A sharded rank's one block a layer, as FSDP carves its shards
    from the unsharded units it frees (the H200's 7B ranks' traces hold them packed, not
    each in a segment of its own)."""
    if shards == 1:
        return root_params + layer_units * layers
    return root_params + (sum(layer_units),) * layers
