"""The caching allocator's reserve in HF generation (the `hf` and `policy` engines): a sketch.

HF generation keeps a DynamicCache (transformers' cache_utils.DynamicLayer.update): the
prefill stores each layer's K and V as the layer makes them, then every decode step makes
each layer's K and V anew one token longer by concatenation and frees the old ones. The
prefill's I-wide temporaries leave cached segments the cache's blocks split, and on one GPU
the states the rollout finds sit a tensor a segment, each rounded up to 2 MiB, so the
allocator reserves beyond the tensors: on the H200 0.7 GiB over 8.9 GiB of tensors in a
0.5B rollout of 64 sequences, about half of it the states' slack (benchmarks/results/gpu,
replayed from the trace). A sharded engine also wakes one whole fp32 tensor at a time
(states.wake_gather_bytes), freed between the weights it keeps.

This lays those allocations out in order (the states the rollout finds, AdamW's where the
run's first update left it when the actor's params and optimizer stay on the device
(step_reserve.first_update); the engine's weights
as it wakes; the prefill layer by layer; the decode's first step, the cache at the last
step's length and the last step, as the trace runs it; the cache freed after each batch of
sequences) and replays them through replay.py as step_reserve.py does the training phases:
the replayed reserved peak less the requests' own bytes at their peak. The steps between are
not laid out: each time a layer's K or V outgrows its 2 MiB-rounded segment the old segment
stays cached, too small for any later request, and a long response piles such segments up;
torch frees them and retries before it would run out of memory (release_cached_blocks), so
they decide no OOM, though NVML sees them. A vllm-like engine's pool is one block made at
wake-up, so its rollout is laid out with no batch (`batches` 0): the states it finds and the
engine's weights as it wakes, whose slack is its reserve (the H200's 0.5B rollouts at
utilisation 0.3 and 0.6 reserved 1.09 GiB beyond their tensors; this laid out about 0.4 on
fresh states, 1.49 with the first update's segments).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autotune.memory.replay import AllocatorSettings, replay
from autotune.memory.sketch.layout import (
    COPY_IN,
    DEFAULT_SETTINGS,
    StepShape,
    Stream,
    state_tensors,
)
from autotune.memory.sketch.step_reserve import first_update

BATCHES = 2  # batches laid out: the second finds the first's cached segments


@dataclass(frozen=True)
class GenerationShape:
    """What the sketch needs of the model, the engine and the rollout, in elements."""

    layers: int
    hidden: int
    intermediate: int
    heads_width: int  # one layer's query elements per token on this rank
    kv_width: int  # one layer's K (and V) elements per token on this rank
    vocab: int
    layer_tensors: tuple[int, ...]  # one layer's weights, tensor by tensor, the engine's part
    root_tensors: tuple[int, ...]  # the embedding (and an untied head)
    compute_bytes: int
    rows: int  # sequences generated at once
    prompt: int
    response: int
    batches: int  # batches of `rows` (the cache is freed after each)
    engine_copy: bool  # the engine wakes with a copy of the weights (else the policy's own)
    # bytes an element of each copy of the weights the rollout finds on the device (the
    # actor's fp32 params and AdamW's two states, the reference, the critic's), laid out as
    # layout.state_tensors lays the trained phases' states from `state_layer` (the actor's
    # layer tensor by tensor, whatever the engine's tensor parallelism), over `shards`
    held_copies: tuple[int, ...] = ()
    state_layer: tuple[int, ...] = ()
    shards: int = 1
    wake_gather: bool = False  # the copy loads from whole fp32 tensors gathered from shards
    # copies of the rank's fp32 shard the weight sync holds while it gathers (states.py's
    # wake_gather_bytes: FSDP1's sharded state dict, an offloaded shard brought back)
    wake_shard_copies: int = 0
    policy_gathers: bool = False  # a sharded policy generates itself, gathering each layer
    # the actor's update, whose first optimizer step made AdamW's state among its freed
    # transients (and the backward's cuBLAS workspace): laid out after the held copies
    # (which then leave AdamW's out), so the rollout finds the segments it left
    first_update: StepShape | None = None


def _held(out: Stream, g: GenerationShape) -> None:
    """The states the rollout finds, copy by copy (layout.state_tensors)."""
    every = state_tensors(g.root_tensors, g.state_layer, g.layers, g.shards)
    for width in g.held_copies:
        for params in every:
            out.alloc(width * params // g.shards)


def _wake(out: Stream, g: GenerationShape) -> list[int]:
    """The engine's weights, tensor by tensor; each then loaded from a whole fp32 tensor
    gathered from the FSDP shards, freed once copied, while the sync holds its copies of
    the rank's shard (a block a layer), freed after."""
    tensors = (*g.root_tensors, *g.layer_tensors * g.layers)
    kept = [out.alloc(g.compute_bytes * params) for params in tensors]
    shard = state_tensors(g.root_tensors, g.state_layer, g.layers, g.shards)
    held = [out.alloc(4 * params // g.shards)
            for _ in range(g.wake_shard_copies) for params in shard]
    if g.wake_gather:
        for params in tensors:
            out.free(out.alloc(4 * params))
    out.free(held)
    return kept


def _norm(out: Stream, g: GenerationShape, tokens: int) -> int:
    """An RMSNorm in fp32 (its input widened, squared, scaled) back to the compute dtype."""
    wide = [out.alloc(4 * tokens * g.hidden) for _ in range(2)]
    out.free(wide[1])
    scaled = out.alloc(4 * tokens * g.hidden)
    out.free(wide[0])
    narrow = out.alloc(g.compute_bytes * tokens * g.hidden)
    out.free(scaled)
    normed = out.alloc(g.compute_bytes * tokens * g.hidden)
    out.free(narrow)
    return normed


def _rotary(out: Stream, g: GenerationShape, tokens: int, width: int, raw: int) -> int:
    """x cos + rotate_half(x) sin: the products, the half negated, the rotation; frees
    `raw`, returns the rotated tensor."""
    c = g.compute_bytes
    cos = out.alloc(c * tokens * width)
    half = out.alloc(c * tokens * width // 2)
    rotated = out.alloc(c * tokens * width)
    out.free(half)
    sin = out.alloc(c * tokens * width)
    out.free(rotated, raw)
    summed = out.alloc(c * tokens * width)
    out.free(cos, sin)
    return summed


def _layer(out: Stream, g: GenerationShape, tokens: int, hidden: int) -> tuple[int, list[int]]:
    """One decoder layer's forward of `tokens` tokens (transformers' Qwen2 layer, its weights
    gathered first where a sharded policy generates): returns the residual stream after it
    and its K and V (K after the rotary, V the projection's output)."""
    c, gathered = g.compute_bytes, []
    if g.policy_gathers:
        buffer = out.alloc(c * sum(g.layer_tensors), COPY_IN)
        gathered = [out.alloc(c * p) for p in g.layer_tensors]
        out.free(buffer)
    normed = _norm(out, g, tokens)
    query = out.alloc(c * tokens * g.heads_width)
    key = out.alloc(c * tokens * g.kv_width)
    value = out.alloc(c * tokens * g.kv_width)
    out.free(normed)
    query = _rotary(out, g, tokens, g.heads_width, query)
    key = _rotary(out, g, tokens, g.kv_width, key)
    attended = out.alloc(c * tokens * g.heads_width)
    out.free(query)
    projected = out.alloc(c * tokens * g.hidden)
    out.free(attended)
    residual = out.alloc(c * tokens * g.hidden)
    out.free(projected, hidden)
    normed = _norm(out, g, tokens)
    gate = out.alloc(c * tokens * g.intermediate)
    up = out.alloc(c * tokens * g.intermediate)
    act = out.alloc(c * tokens * g.intermediate)
    out.free(gate)
    product = out.alloc(c * tokens * g.intermediate)
    out.free(act, up, normed)
    down = out.alloc(c * tokens * g.hidden)
    out.free(product)
    after = out.alloc(c * tokens * g.hidden)
    out.free(down, residual, gathered)
    return after, [key, value]


def _batch(out: Stream, g: GenerationShape) -> None:
    """One batch: the prefill (each layer's K and V kept, the last position's logits and
    their fp32 copies), then the cache grown to the response's end and freed."""
    c, rows, tokens = g.compute_bytes, g.rows, g.rows * g.prompt
    hidden, cache = out.alloc(c * tokens * g.hidden), []
    for _ in range(g.layers):
        hidden, kv = _layer(out, g, tokens, hidden)
        cache.append(kv)
    out.free(hidden)
    logits = out.alloc(c * rows * g.vocab)
    scores = [out.alloc(4 * rows * g.vocab) for _ in range(2)]
    out.free(logits, scores)
    end = g.prompt + g.response - 1
    for length in sorted({min(g.prompt + 1, end), max(g.prompt + 1, end - 1), end}):
        for layer in cache:
            if g.policy_gathers:
                out.free(out.alloc(c * sum(g.layer_tensors), COPY_IN))
            for i in range(2):
                grown = out.alloc(c * rows * length * g.kv_width)
                out.free(layer[i])
                layer[i] = grown
    out.free(cache)


@functools.lru_cache(maxsize=256)
def generation_reserve_bytes(g: GenerationShape,
                             settings: AllocatorSettings = DEFAULT_SETTINGS) -> int:
    """What the replayed sketch of one rollout reserved beyond its requests' own bytes at
    their peak (step_reserve.py: the allocator's rounding too): after the states it finds,
    the wake (a copy's weights), up to BATCHES batches of generation (none for an engine
    whose pool is one block), the copy freed."""
    out = Stream()
    out.phase("build")
    _held(out, g)
    out.phase(None)
    if g.first_update is not None:
        out.phase("first_update")
        first_update(out, g.first_update)
        out.phase(None)
    out.phase("rollout")
    weights = _wake(out, g) if g.engine_copy else []
    for _ in range(min(g.batches, BATCHES)):
        _batch(out, g)
    out.free(weights)
    out.phase(None)
    peaks = replay(out.events, settings).phases["rollout"]
    return max(0, peaks.reserved_bytes - peaks.requested_bytes)
