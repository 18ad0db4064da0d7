"""The log-prob logits: what the [tokens, vocabulary] logits hold on one GPU, by kernel.

A log-prob forward (the experience's) and the update's backward differ by kernel: unfused,
the whole logits in the compute dtype and the fp32 response log-softmax, which the update keeps
for its backward beside its gradient; torch's fused log-probs, one chunk of FUSED_CHUNK_TOKENS
tokens at a time (the backward recomputes it); verl's Triton kernel, fp32 partials per
vocabulary split and one band of the logits' gradient; TRL's fused LM head, one reused tile
and its fp32 accumulators. The entropy adds its softmax and exponentials, or a chunk's with
entropy_chunking: without a gradient where it is a metric, kept for the backward where it is
in the loss (entropy_coeff). These are the logits terms of phases.py's experience and update.
"""

from __future__ import annotations

from autotune.config import (
    ENTROPY_CHUNK_ROWS,
    FUSED_CHUNK_TOKENS,
    TRITON_DLOGITS_COLUMNS,
    TRITON_VOCAB_SPLIT,
    TRL_TOKEN_TILE,
    TRL_VOCAB_CHUNK,
    ProbeConfig,
)
from autotune.memory.states import Sizing


def fused_kernel(config: ProbeConfig) -> str | None:
    """The fused log-prob kernel the config runs (None: the whole logits)."""
    return config.fused_logprob_kernel if config.fused_logprob else None


def fused_chunk_tokens(s: Sizing, rows: int) -> int:
    """Tokens of one chunk of the torch fused log-probs (FUSED_CHUNK_TOKENS at most)."""
    return min(FUSED_CHUNK_TOKENS, rows * s.config.sequence_length)


def trl_positions(s: Sizing, rows: int) -> int:
    """Positions TRL's head scores: the completion tokens where Triton runs (a GPU), else
    every position but each sequence's last."""
    config = s.config
    if s.on_gpu:
        return rows * config.max_response_length
    return rows * (config.sequence_length - 1)


def trl_logits_bytes(s: Sizing, rows: int, backward: bool) -> int:
    """TRL's fused LM head: one reused [4,096 tokens, 32,768 columns] buffer in the compute
    dtype, a copy of the scored hidden states and TRL's seven fp32 accumulators per token;
    without Triton (a CPU) the fold's fp32 temporaries of a tile, 3 in the forward and 8 in
    the backward; the backward's fp32 gradients of the hidden states and the weight."""
    c, hidden, vocab = s.compute_bytes, s.shape.hidden, s.shape.vocab
    positions = trl_positions(s, rows)
    tile = min(positions, TRL_TOKEN_TILE)
    held = tile * TRL_VOCAB_CHUNK * c + positions * (hidden * c + 28)
    fold = 0 if s.on_gpu else tile * min(vocab, TRL_VOCAB_CHUNK) * 4 * (8 if backward else 3)
    grads = 4 * (positions * hidden + vocab * hidden) if backward else 0
    return held + fold + grads


def triton_forward_bytes(s: Sizing, rows: int) -> int:
    """verl's Triton kernel forward: every position's fp32 partials per vocabulary split (max,
    sum, entropy's b), then the log-prob, entropy, max and the two reduced sums per position."""
    splits = -(-s.shape.vocab // TRITON_VOCAB_SPLIT)
    return rows * s.config.sequence_length * (12 * splits + 20)


def triton_backward_bytes(s: Sizing, rows: int) -> int:
    """Its backward: the logits' gradient for one band of vocabulary columns in the compute
    dtype, and the three fp32 per-position values the forward saved."""
    band = min(TRITON_DLOGITS_COLUMNS, s.shape.vocab) * s.compute_bytes
    return rows * s.config.sequence_length * (band + 12)


def unfused_logits_bytes(s: Sizing, rows: int, with_entropy: bool) -> int:
    """The full [seq, vocab] logits and the fp32 response log-softmax; on a GPU the bf16
    logits are freed once their fp32 response slice exists. With the entropy (no gradient),
    its softmax and logsumexp's exponentials beside the fp32 slice, or a chunk's of them."""
    config, c, vocab = s.config, s.compute_bytes, s.shape.vocab
    response = config.max_response_length
    entropy = 0
    if with_entropy:
        positions = rows * response
        chunk = min(ENTROPY_CHUNK_ROWS, positions) if config.entropy_chunking else positions
        entropy = 4 * vocab * (positions + 2 * chunk)
    return max(rows * (c * config.sequence_length + 4 * response) * vocab,
               rows * 8 * response * vocab, entropy)


def logprob_logits_bytes(s: Sizing, rows: int, with_entropy: bool = False) -> int:
    """A log-prob forward's logits by kernel: Triton's partials (the entropy at no extra
    memory), TRL's head, torch's chunks (one chunk's logits in the compute dtype and fp32,
    then its fp32 log-softmax, and the entropy's two), or the whole logits."""
    kernel = fused_kernel(s.config)
    if kernel == "triton":
        return triton_forward_bytes(s, rows)
    if kernel == "trl":
        return trl_logits_bytes(s, rows, backward=False)
    if kernel is not None:
        c = s.compute_bytes
        return fused_chunk_tokens(s, rows) * s.shape.vocab * max(c + 4, 12 if with_entropy else 8)
    return unfused_logits_bytes(s, rows, with_entropy)


def autocast_logits_bytes(s: Sizing, rows: int, with_entropy: bool = False) -> int:
    """What of a log-prob forward's logits is made inside autocast, beside the casts its
    cache keeps on one GPU: a fused kernel's all (the head runs inside it); the unfused
    path's compute-dtype logits alone, as the probe copies their response slice to fp32
    after autocast exits, which empties the cache first (forwards.py, _forward_log_probs;
    torch's autocast __exit__ clears its cache)."""
    if fused_kernel(s.config) is not None:
        return logprob_logits_bytes(s, rows, with_entropy)
    return rows * s.compute_bytes * s.config.sequence_length * s.shape.vocab


def entropy_grad_bytes(s: Sizing, rows: int) -> int:
    """entropy_coeff: the entropy's fp32 softmax, product and exponentials kept for the
    backward and its gradient (recomputed, checkpointed, at the same point: the same peak),
    one more fp32 tensor with chunks (each chunk's copies); measured by the trace
    (tests/test_logprob.py)."""
    config = s.config
    if not config.entropy_coeff:
        return 0
    positions = rows * config.max_response_length
    return positions * s.shape.vocab * (20 if config.entropy_chunking else 16)


def unfused_backward_bytes(s: Sizing, rows: int) -> int:
    """The whole logits' backward at its largest: its start (the kept fp32 log-softmax, the
    gather's gradient and the log-softmax's: three fp32 response slices) or its end (the
    slice's gradient back in the compute dtype, widened into the whole logits' gradient,
    which the head's matmul turns into its weight's gradient: none with LoRA, whose head is
    frozen, as the trace of a 7B LoRA rank's update shows). The compute-dtype logits are
    gone by then (the step keeps only their fp32 response slice)."""
    c, vocab = s.compute_bytes, s.shape.vocab
    seq, response = s.config.sequence_length, s.config.max_response_length
    whole = rows * c * seq * vocab
    head_grad = 0 if s.config.uses_lora else c * vocab * s.shape.hidden
    return max(rows * 12 * response * vocab, whole + rows * c * response * vocab,
               whole + head_grad)


def update_logits_bytes(s: Sizing, rows: int) -> int:
    """The update's logits by kernel: unfused, the forward's (logprob_logits_bytes) or the
    backward's (unfused_backward_bytes), whichever is more, and the entropy's gradient;
    fused, the backward recomputes one chunk at a time: its logits, softmax and gradient."""
    kernel, c, vocab = fused_kernel(s.config), s.compute_bytes, s.shape.vocab
    if kernel == "triton":
        return max(triton_forward_bytes(s, rows), triton_backward_bytes(s, rows))
    if kernel == "trl":
        return trl_logits_bytes(s, rows, backward=True)
    if kernel is not None:
        return fused_chunk_tokens(s, rows) * vocab * (max(c + 4, 8) + c)
    return max(logprob_logits_bytes(s, rows), unfused_backward_bytes(s, rows)) \
        + entropy_grad_bytes(s, rows)
