"""The memory model's allocator term: what the caching allocator reserves beyond the tensors.

The arithmetic model (phases.py) counts the tensors a phase holds at its peak; a GPU holds
more, because PyTorch's caching allocator keeps freed blocks cached for their own stream and
splits large cached blocks for smaller requests, so a later large request finds no block
that fits and takes a new segment. How much more depends on the sizes and the order of the
phase's allocations, not on a constant: on an H200 a 7B rank's update reserved 10 to 11 GiB
beyond its tensors and its rollout 0.3 GiB (benchmarks/results/gpu).

This module lays the step's allocations out the way the probe's step makes them, from the
same shapes the model uses (a decoder layer's parameters by block, the root unit's
embedding and head, a VL model's vision blocks, the logits path's tensors, the activations
a layer saves), with FSDP's streams and its all-gather state (layout.py's units gathered
and resharded; reduce-scatter outputs on their stream; the next layer prefetched in the
backward; FSDP1's flat units, whose frees it records on the stream that used them, reused
once the GPU is past them), the run's micro-batches and optimizer steps up to
MICRO_BATCHES and OPTIMIZER_STEPS (AdamW's state made at the first, a foreach temporary a
tensor at each; on one GPU the trained head's autocast cast from the logits to its
backward, and the fp32 gradient that backward widens, alive through the layers' backward),
each phase twice over after the states it finds (for a later phase, where the run's first
update left them: AdamW's state among that update's freed transients and the autograd
thread's cuBLAS workspace where its first GEMM found room, so the segments they keep, holes
and all, are the phase's: first_update); replays it through allocator.py with the run's
allocator settings; and returns, per phase, the replayed reserved peak less the requests' own bytes
at their peak: the allocator's whole term, its rounding and the rests of cached blocks it
hands out whole (1 MiB or less, `should_split`) included, which torch's allocated statistic
counts with the tensors (the H200's 0.5B update: 219 MiB of them beside cuBLAS's
workspaces, the trace's replay within 1 MiB of torch's allocated). The trace
(probe/trace.py) records the real stream and is exact where this is a sketch; this is what
`estimate` adds without one, no torch needed. Sizes are per GPU; the caller gives rows.
"""

from __future__ import annotations

import dataclasses
import functools

from autotune.config.kernels import FUSED_CHUNK_TOKENS
from autotune.memory.replay import AllocatorSettings, replay
from autotune.memory.sketch.layout import (
    COPY_IN,
    CRITIC_COPY_IN,
    DEFAULT_SETTINGS,
    MICRO_BATCHES,
    REDUCE,
    REF_COPY_IN,
    Blocks,
    StepShape,
    Stream,
    gather_unit,
    gathered_done,
    reshard_unit,
    state_tensors,
)


def _chunks(tokens: int) -> list[int]:
    """The fused log-prob's chunks of FUSED_CHUNK_TOKENS tokens (the last one shorter)."""
    return [min(FUSED_CHUNK_TOKENS, tokens - start)
            for start in range(0, tokens, FUSED_CHUNK_TOKENS)]


def _chunk_softmax(out: Stream, compute_bytes: int, elements: int) -> tuple[int, int]:
    """One fused chunk's logits (`elements` of them) in the compute dtype cast to fp32 (the
    compute-dtype ones gone), then its fp32 (log-)softmax beside them: (cast, softmax)."""
    piece = out.alloc(compute_bytes * elements)
    wide = out.alloc(4 * elements)
    out.free(piece)
    return wide, out.alloc(4 * elements)


def _logits(out: Stream, s: StepShape, rows: int, backward: bool,
            autocast_cache: Blocks = ()) -> list[int]:
    """The log-probs from the whole logits: the compute-dtype logits, their fp32 response
    slice, its log-softmax (kept for the backward); returns what stays for the backward.
    `autocast_cache` (a no-grad forward's casts, kept by autocast's cache) goes as autocast
    exits: after the fused chunks, which run inside it, or before the fp32 slice, which the
    probe copies outside it (forwards.py, _forward_log_probs)."""
    c, v = s.compute_bytes, s.vocab
    tokens, scored = rows * s.seq, rows * s.response
    if s.fused_logits:  # a chunk at a time: no whole-vocabulary block outlives it
        for chunk in _chunks(tokens):
            wide, soft = _chunk_softmax(out, c, chunk * v)  # gathered and gone
            out.free(soft, wide)
        out.free(autocast_cache)
        return []
    logits = out.alloc(c * tokens * v)
    out.free(autocast_cache)
    wide = out.alloc(4 * scored * v)
    out.free(logits)
    soft = out.alloc(4 * scored * v)
    out.free(wide)
    if not backward:
        out.free(soft)
        return []
    return [soft]


def _logits_backward(out: Stream, s: StepShape, rows: int, kept: list[int]) -> int:
    """The gather's gradient (fresh zeros scattered into in place: gather_backward in
    TensorAdvancedIndexing.cpp), the log-softmax's, the slice's back in the compute dtype,
    and the whole logits' gradient for the head's matmul."""
    c, v = s.compute_bytes, s.vocab
    tokens, scored = rows * s.seq, rows * s.response
    if s.fused_logits:  # each chunk's logits recomputed, softmaxed, its gradient cast
        for chunk in _chunks(tokens):
            wide, soft = _chunk_softmax(out, c, chunk * v)
            out.first_backward_gemm()  # the first chunk's, its blocks live
            out.free(wide)
            grad = out.alloc(c * chunk * v)  # the softmax's gradient in the compute dtype
            out.free(soft, grad)
        return 0
    scattered = out.alloc(4 * scored * v)
    grad = out.alloc(4 * scored * v)
    out.free(scattered, kept)
    narrow = out.alloc(c * scored * v)
    out.free(grad)
    whole = out.alloc(c * tokens * v)
    out.free(narrow)
    return whole  # the whole logits' gradient: freed after the head's matmul


def _layer_forward_temps(out: Stream, s: StepShape, rows: int) -> None:
    """A layer's forward temporaries that do not outlive it (its MLP's I-wide tensors), and
    through LoRA's adapters peft's (phases.lora_forward_bytes_per_token): the sum made
    beside the base's result; under FSDP1 the input's fp32 copy; on one GPU under autocast
    down_proj's input copied to fp32 and cast back."""
    c, tokens = s.compute_bytes, rows * s.seq
    temps = [out.alloc(c * tokens * s.intermediate) for _ in range(3)]
    temps += [out.alloc(4 * tokens * s.hidden)]
    if s.frozen_base and s.autocast_casts:
        temps += [out.alloc(4 * tokens * s.intermediate), out.alloc(c * tokens * s.intermediate)]
    elif s.frozen_base:
        temps += [out.alloc(c * tokens * s.intermediate)]
        temps += [out.alloc(4 * tokens * s.hidden)] if s.fsdp1 else []
    out.free(temps)


def _saved(out: Stream, s: StepShape, rows: int) -> list[int]:
    """What one layer saves for its backward: its input with checkpointing; else its
    attention's and MLP's activations (shape.py's per-token formula, by tensor)."""
    c, tokens = s.compute_bytes, rows * s.seq
    if s.checkpointing:
        return [out.alloc(c * tokens * s.hidden)]
    return [out.alloc(c * tokens * s.intermediate) for _ in range(4)] + \
        [out.alloc(c * tokens * s.hidden) for _ in range(5)] + \
        [out.alloc(4 * tokens * s.hidden) for _ in range(2)]


def _vision(out: Stream, s: StepShape, rows: int, keep: bool) -> list[list[int]]:
    """A VL model's vision tower, block by block (each an FSDP unit, as the decoder's
    layers): gathered, its forward's temporaries, and with `keep` what each block saves for
    the backward (its input under checkpointing, else its activations)."""
    c, patches = s.compute_bytes, rows * s.patches_per_row
    saved: list[list[int]] = []
    for _ in range(s.vision_blocks):
        block = gather_unit(out, s, s.vision_block_params) if s.shards > 1 else \
            [out.alloc(c * p) for p in s.vision_block_params]
        temps = [out.alloc(c * patches * s.vision_intermediate) for _ in range(2)]
        out.free(temps)
        if keep:
            saved.append([out.alloc(c * patches * s.vision_hidden)] if s.checkpointing else
                         [out.alloc(c * patches * s.vision_intermediate) for _ in range(3)]
                         + [out.alloc(c * patches * s.vision_hidden) for _ in range(4)])
        if s.shards > 1:
            reshard_unit(out, s, block)
        elif not keep:
            out.free(block)
        else:
            saved[-1].extend(block)  # autocast's casts, kept for the backward
    return saved


def _vision_backward(out: Stream, s: StepShape, rows: int, saved: list[list[int]]) -> None:
    """The vision tower's backward, last block first: gathered again, recomputed under
    checkpointing, its gradients reduced (or accumulated on one GPU)."""
    c, n, patches = s.compute_bytes, s.shards, rows * s.patches_per_row
    for held in reversed(saved):
        block = gather_unit(out, s, s.vision_block_params) if n > 1 else []
        if s.checkpointing:
            temps = [out.alloc(c * patches * s.vision_intermediate) for _ in range(2)]
            out.free(temps)
        grads = [out.alloc(c * p) for p in s.vision_block_params]
        out.free(held)
        reshard_unit(out, s, block)
        wide = out.alloc(4 * sum(s.vision_block_params))
        out.free(grads, wide)


def experience(out: Stream, s: StepShape, root_held: list[int]) -> list[int]:
    """The log-prob forwards, micro-batch by micro-batch: the actor's (its root gathered at
    its first, then kept: FSDP does not reshard a root after a forward), then the
    reference's, its units gathered on its own stream (its root kept from the last step,
    or, where its params went to the host under FSDP2 (states.keeps_gathered_root),
    gathered at its first micro-batch and kept to the phase's end, when they go back);
    returns the actor's root, still gathered. A reference waiting on the host
    (s.reference_on_host) comes to the device for its forward alone, after the actor's
    casts have gone (experience.py: placed, its log-probs, placed back)."""
    c = s.compute_bytes
    reference_root: list[int] = []
    arrived: list[int] = []
    for forward in range(s.forwards):
        reference = bool(forward) and s.with_reference
        out.copy_in = REF_COPY_IN if reference else COPY_IN
        if reference and s.reference_on_host:
            arrived = [out.alloc(c * p // s.shards) for p in
                       state_tensors(s.root_params, s.layer_params, s.layers, s.shards)]
        for _ in range(MICRO_BATCHES):
            if s.shards > 1 and not forward and not root_held:
                root_held = gather_unit(out, s, s.root_params)
            if s.shards > 1 and reference and not s.reference_root_kept \
                    and not reference_root:
                reference_root = gather_unit(out, s, s.root_params)
            _vision(out, s, s.experience_rows, keep=False)
            # one GPU: autocast's cache keeps the cast of every weight that needs a
            # gradient to the forward's end, the head's too (the actor's; LoRA's frozen
            # base is cast op by op)
            cached = s.autocast_casts and not s.frozen_base and not reference
            casts: list[int] = []
            for _ in range(s.layers):
                layer = gather_unit(out, s, s.layer_params) if s.shards > 1 else \
                    [out.alloc(c * p) for p in s.layer_params]  # autocast's casts
                _layer_forward_temps(out, s, s.experience_rows)
                if cached:
                    casts += layer
                else:
                    reshard_unit(out, s, layer)
            gathered_done(out)
            casts += [out.alloc(c * _head_params(s))] if cached else []
            _logits(out, s, s.experience_rows, backward=False, autocast_cache=casts)
    out.free(reference_root, arrived)
    out.copy_in = COPY_IN
    return root_held


def value_forward(out: Stream, s: StepShape) -> list[int]:
    """PPO's value forward on a sharded rank, after the log-prob passes: the critic's own
    FSDP root (its embedding alone: a value head of one output) gathered on its own stream
    at its first micro-batch and kept, its layers gathered and resharded one by one, their
    forward's temporaries, the values (one float a token); returns the critic's root, still
    gathered (phases.value_forward_phase counts its tensors)."""
    root: list[int] = []
    out.copy_in = CRITIC_COPY_IN
    for _ in range(MICRO_BATCHES):
        if not root:
            root = gather_unit(out, s, s.root_params[:1])
        for _ in range(s.layers):
            layer = gather_unit(out, s, s.layer_params)
            _layer_forward_temps(out, s, s.critic_rows)
            reshard_unit(out, s, layer)
        gathered_done(out)
        out.free(out.alloc(4 * s.critic_rows * s.seq))
    out.copy_in = COPY_IN
    return root


def _first_keeps(out: Stream, grads: list[int], made: list[int], first: bool) -> None:
    """The first micro-batch's gradients become the parameters' (kept to the optimizer
    step); a later one's are summed into them in place and go."""
    if first:
        grads.extend(made)
    else:
        out.free(made)


def _update_forward(out: Stream, s: StepShape
                    ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """One update micro-batch's forward, the vision tower then layer by layer: what each
    layer saves for the backward, on one GPU autocast's casts (kept for the backward), and
    what the vision blocks save."""
    c, n = s.compute_bytes, s.shards
    saved, casts = [], []
    vision_saved = _vision(out, s, s.update_rows, keep=True)
    for _ in range(s.layers):
        layer = gather_unit(out, s, s.layer_params) if n > 1 else \
            [out.alloc(c * p) for p in s.layer_params]
        saved.append(_saved(out, s, s.update_rows))
        if s.checkpointing:
            _layer_forward_temps(out, s, s.update_rows)
        if n > 1:
            reshard_unit(out, s, layer)  # resharded after its forward
        else:
            casts.append(layer)  # autocast keeps them for the backward
    gathered_done(out)
    return saved, casts, vision_saved


def _layers_backward(out: Stream, s: StepShape, saved: list[list[int]],
                     casts: list[list[int]], grads: list[int], first: bool) -> None:
    """The decoder's backward, last layer first: each layer gathered again (FSDP prefetches
    the next), recomputed under checkpointing, its weight gradients made and reduced to an
    fp32 shard (or widened to fp32 on one GPU)."""
    c, n = s.compute_bytes, s.shards
    ahead = gather_unit(out, s, s.layer_params) if n > 1 else []
    for index in reversed(range(s.layers)):
        if n > 1:  # FSDP prefetches the next layer's gather for the backward
            layer, ahead = ahead, (gather_unit(out, s, s.layer_params) if index else [])
        if s.checkpointing:
            _layer_forward_temps(out, s, s.update_rows)
        if s.frozen_base:  # the adapters' gradients alone: a few MB, not laid out
            out.free(saved.pop())
            if n > 1:
                reshard_unit(out, s, layer)
            else:
                out.free(casts.pop())
            continue
        if s.fsdp1:
            _flat_gradient_reduced(out, s, s.layer_params, layer, saved.pop(), grads, first)
            continue
        weight_grads = [out.alloc(c * p) for p in reversed(s.layer_params)]
        out.free(saved.pop())
        if n > 1:
            out.free(layer, out.reduce_input)
            out.reduce_input = out.alloc(4 * sum(s.layer_params))
            out.free(weight_grads)
            shard = out.alloc(4 * sum(s.layer_params) // n, REDUCE)
            _first_keeps(out, grads, [shard], first)
        else:
            wide = [out.alloc(4 * p) for p in s.layer_params]
            out.free(weight_grads, casts.pop())
            _first_keeps(out, grads, wide, first)


def _flat_gradient_reduced(out: Stream, s: StepShape, params: tuple[int, ...], unit: list[int],
                           done: Blocks, grads: list[int], first: bool,
                           padded: bool = False) -> None:
    """FSDP1's reduction of a unit: its flat gradient made, what the backward held (`done`)
    freed and the unit resharded, the gradient cast to fp32 on the reduce-scatter stream
    (torch's _post_backward_hook) and, where the world does not divide its elements
    (`padded`), copied out padded there too (_get_reduce_scatter_tensors: F.pad), reduced to
    a shard there (kept, or summed into the first's), its free recorded there."""
    flat_grad = out.alloc(s.compute_bytes * sum(params))
    out.free(done)
    reshard_unit(out, s, unit)
    cast = out.alloc(4 * sum(params), REDUCE)
    pad = out.alloc(4 * sum(params), REDUCE) if padded else 0
    shard = out.alloc(4 * sum(params) // s.shards, REDUCE)
    out.free(pad, cast)
    out.record(flat_grad, REDUCE)
    out.free(flat_grad)
    _first_keeps(out, grads, [shard], first)


def _root_backward(out: Stream, s: StepShape, root_held: list[int], head_grad: int,
                   grads: list[int], first: bool) -> list[int]:
    """The root unit's backward: the embedding's gradient beside the head's, reduced to an
    fp32 shard with the root resharded (FSDP1: one flat gradient cast to fp32 on the
    reduce-scatter stream, as a layer's; one GPU: kept in fp32); returns the root still
    gathered after it."""
    c, n = s.compute_bytes, s.shards
    if s.frozen_base:  # no gradient for the embedding nor the head
        if n == 1:
            return root_held
        reshard_unit(out, s, root_held)
        return []
    embed_grad = out.alloc((c if n > 1 else 4) * s.root_params[0])
    if n == 1:  # the head's fp32 gradient (its own, or the tied weight's sum) and the
        # embedding's (summed into it where tied) become the parameters' or are summed in
        if len(s.root_params) == 1:
            out.free(embed_grad)
            _first_keeps(out, grads, [head_grad], first)
        else:
            _first_keeps(out, grads, [head_grad, embed_grad], first)
        return root_held
    if s.fsdp1:  # as a layer's; a critic's root holds its value head's bias, one element,
        # so no world divides its flat gradient (the registry's models' other units are
        # multiples of 8 elements: vocabularies, widths, biases). Held-out H200 rows of
        # FSDP1 PPO critics: their updates' reserve 0.4-4.4 GiB over the sketch's without it
        _flat_gradient_reduced(out, s, s.root_params, root_held, [embed_grad, head_grad],
                               grads, first, padded=s.value_head)
        return []
    reshard_unit(out, s, root_held)
    out.free(out.reduce_input)
    out.reduce_input = 0
    reduce_in = out.alloc(4 * sum(s.root_params))
    out.free(embed_grad)
    shard = out.alloc(4 * sum(s.root_params) // n, REDUCE)
    _first_keeps(out, grads, [shard], first)
    out.free(head_grad, reduce_in)
    return []


def _head_params(s: StepShape) -> int:
    """The trained head's parameters: the LM head's (the root's last tensor, the embedding
    where tied) or a critic's value head's (one output)."""
    return s.hidden if s.value_head else s.root_params[-1]


def _update_micro_batch(out: Stream, s: StepShape, root_held: list[int], grads: list[int],
                        first: bool) -> list[int]:
    """One micro-batch of the update: the root gathered anew, the forward, the logits and
    their backward, the layers', the vision tower's and the root's backward; returns the
    root still gathered."""
    if s.shards > 1:
        fresh = gather_unit(out, s, s.root_params)
        reshard_unit(out, s, root_held)
        root_held = fresh
    saved, casts, vision_saved = _update_forward(out, s)
    # one GPU: autocast casts the trained head's weight at the logits and keeps the cast
    # (a tensor the matmul saves) to the head's backward, whose bf16 gradient the cast's
    # backward widens to an fp32 one at once; that waits for the embedding's through the
    # layers' backward (a tied weight's two gradients are summed before it is accumulated)
    widened = s.autocast_casts and not s.frozen_base
    head_cast = out.alloc(s.compute_bytes * _head_params(s)) if widened else 0
    kept = _logits(out, s, s.update_rows, backward=True)
    head_grad = 0 if s.frozen_base or not s.fused_logits else \
        out.alloc(s.compute_bytes * _head_params(s))  # fused: zeroed before the chunks
    whole = _logits_backward(out, s, s.update_rows, kept)
    if not (s.frozen_base or s.fused_logits):
        head_grad = out.alloc(s.compute_bytes * _head_params(s))
    out.first_backward_gemm()  # unfused: the head's, beside its weight's gradient
    out.free(whole)
    if widened:
        out.free(head_cast)
        wide_grad = out.alloc(4 * _head_params(s))
        out.free(head_grad)
        head_grad = wide_grad
    _layers_backward(out, s, saved, casts, grads, first)
    _vision_backward(out, s, s.update_rows, vision_saved)
    gathered_done(out)
    out.free(saved)
    return _root_backward(out, s, root_held, head_grad, grads, first)


def update(out: Stream, s: StepShape, root_held: list[int], adam: list[int]
           ) -> tuple[list[int], list[int]]:
    """The optimizer steps, each over its micro-batches (forward, logits, backward, the
    gradients reduced or accumulated), then AdamW (its state made at the first; offloaded,
    it comes back from the host whole as a later update starts and goes back as it ends:
    the probe's `_place_actor`, verl's load_fsdp_optimizer and offload_fsdp_optimizer)."""
    n = s.shards
    every = optimizer_tensors(s)
    if adam and s.optimizer_offloaded:  # back from the host as the update starts
        adam = [out.alloc(4 * p // n) for p in every for _ in range(2)]
    for _ in range(s.optimizer_steps):
        grads: list[int] = []
        for micro in range(s.update_micro_batches):
            root_held = _update_micro_batch(out, s, root_held, grads, first=micro == 0)
        if s.frozen_base:  # AdamW over the adapters alone: a few MB, not laid out
            continue
        if not adam:  # AdamW's state, made at the first step
            adam = [out.alloc(4 * p // n) for p in every for _ in range(2)]
        if not s.fused_optimizer:  # foreach: one fp32 temporary a parameter
            temps = [out.alloc(4 * p // n) for p in every]
            out.free(temps)
        out.free(grads)
    if s.optimizer_offloaded:  # to the host as it ends (the ids stay: the state is made)
        out.free(adam)
    return root_held, adam


def first_update(out: Stream, s: StepShape) -> list[int]:
    """The run's first update, as the states a later phase finds it left: AdamW's state
    made at its first optimizer step among its freed transients, and the autograd thread's
    cuBLAS workspace where its first backward GEMM found room (the head's; a PPO critic's
    update runs first, its value head's backward among no vocabulary-wide blocks, so that
    one is made before); returns AdamW's state."""
    if s.critic_rows:
        out.first_backward_gemm()
    _, adam = update(out, dataclasses.replace(s, optimizer_steps=1), [], [])
    return adam


def optimizer_tensors(s: StepShape) -> tuple[int, ...]:
    """The parameters of each tensor the update's AdamW makes a state or a foreach
    temporary of, before sharding: FSDP2's a parameter each (it shards every parameter, a
    DTensor of its own: a VL-7B rank's step, traced, 1,800 allocations), FSDP1's a flat unit
    each, one GPU's as state_tensors. (The experience finds the states packed, a block a
    layer: laid out a parameter each there, the committed 7B ranks' experiences went 1.5
    points further over their NVML peaks.)"""
    if s.shards > 1 and not s.fsdp1:
        return s.root_params + s.layer_params * s.layers
    return state_tensors(s.root_params, s.layer_params, s.layers, s.shards)


@functools.lru_cache(maxsize=256)
def phase_reserve_bytes(s: StepShape, settings: AllocatorSettings = DEFAULT_SETTINGS,
                        names: tuple[str, ...] = ("experience", "update")) -> dict[str, int]:
    """Per training phase (experience, update: those of `names`), what the replayed sketch
    reserved beyond its requests' own bytes at their peak. Each phase is laid out twice
    over (as two training steps run it) after the states it finds (state_tensors): the fp32 master
    shards, the reference (one waiting on the host arrives for its own pass), FSDP's root
    unit gathered, and AdamW's state: on the host when offloaded; the update makes it at its
    first step; the experience finds it where the run's first update left it (first_update,
    laid out with that update's settings). So a phase moves with its own knobs
    (phases.PHASE_KNOBS, the batches among them: they set its loops' counts) and the
    experience with the update's that size those segments too (phases.CARRIED_KNOBS), as
    the dominance rules read them. On the committed 0.5B row the experience's held
    segments then match its trace's at the phase's peak: the two 1,188 MiB logits segments,
    one keeping AdamW's embedding states, the other the workspace (1,156 MiB free)."""
    n, c = s.shards, s.compute_bytes
    every = state_tensors(s.root_params, s.layer_params, s.layers, s.shards)
    reserve = {}
    for name in names:
        out = Stream()
        out.phase("build")
        for p in every:  # the fp32 master shards
            out.alloc(4 * p // n)
        if s.with_reference and not s.reference_on_host:  # else: it arrives for its pass
            for p in every:
                out.alloc(c * p // n)
        adam: list[int] = []
        critic = name == "experience" and s.critic_rows > 0 and n > 1  # a sharded rank's
        # PPO critic, on the device for its value forward (one GPU's: its trace held no
        # more reserve for it, benchmarks/model_vs_trace.py row 19): its layers' states,
        # then its embedding's
        if critic:
            for p in every[len(s.root_params):] + every[:1]:
                for width in s.critic_states:
                    out.alloc(width * p // n)
        # the actor's root: gathered by the experience, resharded by the update before an
        # experience; FSDP1's is still gathered when the update starts, FSDP2's is not (the
        # update places the states first: s.actor_root_kept; verl reshards roots after the
        # log-prob passes), so its first micro-batch gathers it afresh into blocks of the
        # root's own sizes (laid out freed there, the sketch's root split a larger cached
        # block between its passes, and an embedding gradient took the root's reduce
        # input: a VL-7B rank of 8's update 2.4 GiB past its trace). The reference's: kept
        # gathered after its forward where it is not placed (states.kept_root_bytes)
        kept_root = s.actor_root_kept and name == "update"
        root = [out.alloc(c * p) for p in s.root_params] if kept_root else []
        if s.with_reference and s.reference_root_kept:
            for p in s.root_params:
                out.alloc(c * p)
        out.phase(None)
        if name == "experience" and not (s.frozen_base or s.optimizer_offloaded):
            # the states as the first update left them: AdamW's made among its freed
            # transients, the backward's cuBLAS workspace where its first GEMM found room
            out.phase("first_update")
            adam = first_update(out, s)
            out.phase(None)
        for _ in range(2):
            if kept_root and not root:
                root = [out.alloc(c * p) for p in s.root_params]
            out.phase(name)
            if name == "experience":
                root = experience(out, s, root)
                if critic:
                    root = [*root, *value_forward(out, s)]
            else:
                root, adam = update(out, s, root, adam)
            out.phase(None)
            if name == "experience":
                out.free(root)
                root = []
        peaks = replay(out.events, settings).phases[name]
        reserve[name] = max(0, peaks.reserved_bytes - peaks.requested_bytes)
    return reserve
