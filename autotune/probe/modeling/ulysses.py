"""Ulysses sequence parallelism, as verl runs it (verl/models/transformers/monkey_patch.py
`_ulysses_flash_attention_forward`, verl/utils/ulysses.py; EasyR1's `ulysses_size` the same):

- each sequence's tokens are split over the `sp` ranks of a sequence-parallel group (padded to
  a multiple of sp), each rank running the decoder on its slice with the slice's positions;
- around attention, an all-to-all gathers the sequence and scatters the heads (each rank attends
  over the whole sequence with heads/sp of the heads), and another gives back the slice with
  every head; KV heads fewer than sp are repeated up to sp first (verl's `repeat_kv`);
- the logits and log-probs are the slice's (every local position's, as verl's padding-removed
  path computes them), gathered over the group into the whole sequence's log-probs;
- a group of sp ranks trains the same sequences: the data-parallel size is W / sp, so each group
  takes sp times a rank's share of the rollout (verl gathers it within the group).

Real ranks exchange the slices with all_to_all_single / all_gather over the group (gloo or
NCCL). An emulated rank (one process over torch's fake process group) lays each buffer out as
the collective would, from its own data: the same tensors, shapes and dtypes, no data moved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ATTENTION = "sdpa"  # the attention implementation the probe's models use, wrapped while active


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: its size, this rank's place in it, and the real
    process group (None for an emulated rank)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None

    def local_slice(self, tokens: int) -> slice:
        """This rank's slice of a sequence of `tokens` tokens padded to a multiple of size."""
        per_rank = padded_length(tokens, self.size) // self.size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)


def padded_length(tokens: int, size: int) -> int:
    """`tokens` padded up to a multiple of the group's `size` (verl's ulysses_pad)."""
    return -(-tokens // size) * size


def sequence_group(size: int, rank: int, world_size: int, emulated: bool) -> SequenceGroup:
    """The sequence-parallel group of `rank`: consecutive ranks, `size` of them (verl's device
    mesh (dp, sp)); every rank creates every group, as torch requires."""
    if emulated:
        return SequenceGroup(size, rank % size, None)
    mine = None
    for first in range(0, world_size, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceGroup(size, rank % size, mine)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (equal chunks, one per rank); its gradient goes back the
    same way."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(tensor)
        dist.all_to_all_single(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.group)
        return out, None


def _exchange(chunks: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[sp, ...] chunks, chunk j to rank j; back, chunk i from rank i (emulated: kept)."""
    if group.group is None:
        return chunks.contiguous()  # the collective's output buffer, this rank's data
    return _AllToAll.apply(chunks, group.group)


def gather_sequence_scatter_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[B, H, t, D] (all heads, the local slice) -> [B, H/sp, sp*t, D]."""
    b, h, t, d = x.shape
    sp = group.size
    chunks = x.reshape(b, sp, h // sp, t, d).transpose(0, 1)  # [sp: head group, B, H/sp, t, D]
    out = _exchange(chunks, group)  # [sp: sequence part, B, H/sp, t, D]
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * t, d)


def gather_heads_scatter_sequence(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[B, T, H/sp, D] (the whole sequence, a head group) -> [B, T/sp, H, D]."""
    b, full, h, d = x.shape
    sp = group.size
    chunks = x.reshape(b, sp, full // sp, h, d).transpose(0, 1)  # [sp: seq part, B, t, H/sp, D]
    out = _exchange(chunks, group)  # [sp: head group, B, t, H/sp, D]
    return out.permute(1, 2, 0, 3, 4).reshape(b, full // sp, sp * h, d)


def gather_positions(values: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[B, t] values of the local slice -> [B, sp*t], the whole sequence's (differentiable)."""
    if group.group is None:
        return torch.cat([values] * group.size, dim=1)  # the gathered buffer's shape
    from torch.distributed.nn.functional import all_gather

    return torch.cat(all_gather(values.contiguous(), group=group.group), dim=1)


_active: list[SequenceGroup] = []  # the group of the forwards running now (none: generation)


def ulysses_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The wrapped attention: inside `sequence_parallel`, causal attention over the whole
    sequence with heads/sp of the heads; elsewhere (generation), the plain implementation."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not _active:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    group = _active[-1]
    sp, kv_heads = group.size, key.shape[1]
    if kv_heads < sp:  # every rank needs a KV head of its own
        key = key.repeat_interleave(sp // kv_heads, dim=1)
        value = value.repeat_interleave(sp // kv_heads, dim=1)
    q, k, v = (gather_sequence_scatter_heads(x, group) for x in (query, key, value))
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=kwargs.get("scaling"), enable_gqa=q.shape[1] != k.shape[1])
    return gather_heads_scatter_sequence(out.transpose(1, 2), group), None


def install_attention() -> None:
    """Route the probe's models' attention through ulysses_attention (verl patches its flash
    attention the same way): it acts only inside `sequence_parallel`."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)


@contextlib.contextmanager
def sequence_parallel(group: SequenceGroup | None) -> Iterator[None]:
    """The forwards inside (and their backwards, a checkpointed layer's recompute too) run on
    the local slice, attention over `group`."""
    assert group is not None  # a probe with sequence parallelism
    _active.append(group)
    try:
        yield
    finally:
        _active.pop()
