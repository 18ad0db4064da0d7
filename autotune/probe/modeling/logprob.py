"""Log-probs of the tokens from the LM head, as the trainers compute them.

Unfused (every trainer's default): the model returns the whole [tokens, vocabulary] logits
and the step takes an fp32 log-softmax of the response positions (probe/step/training.py).

Fused (`fused_logprob`): the log-probs come from the last hidden states and the LM head's
weight in chunks of FUSED_CHUNK_TOKENS tokens, and the logits of the whole micro-batch never
exist: the arithmetic of verl's `use_fused_kernels` with its torch backend (FusedLinearForPPO,
verl/utils/experimental/torch_functional.py: chunks of 512 tokens, each chunk's logits cast to
fp32, backward keeping only the hidden states, the weight and the labels and recomputing each
chunk's logits). Liger's fused linear losses hold the same order of memory (a chunk's logits
at a time). The head is swapped in for the model's own LM head for one forward (`fused_head`),
so it runs inside the model's forward, where FSDP has the root's parameters (the head's among
them) gathered, as verl's patched forward does.

TRL's (`fused_logprob_kernel=trl`): TRL 1.x always scores through its fused LM head
(trl/trainer/utils.py add_fused_lm_head, trl/kernels/chunked_logprob.py): each tile of
TRL_TOKEN_TILE tokens is projected TRL_VOCAB_CHUNK vocabulary columns at a time into one
reused buffer and folded into an online logsumexp (and the entropy's sum) per token; the
backward recomputes each tile, turns it into the logits' gradient in place and accumulates
fp32 gradients of the hidden states and the weight. Without Triton (a CPU) the fold is torch
ops over the whole tile and every position is scored; with it (a GPU) the fold makes no
temporaries and only the completion tokens are scored. TRL's own function runs where TRL is
installed; else `TrlChunkedLogProb`, the same arithmetic. Imports torch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from autotune.config import (
    ENTROPY_CHUNK_ROWS,
    FUSED_CHUNK_TOKENS,
    TRITON_DLOGITS_COLUMNS,
    TRITON_VOCAB_SPLIT,
    TRL_TOKEN_TILE,
    TRL_VOCAB_CHUNK,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# An autograd Function's `ctx` is Any, as torch types it (torch/autograd/function.py): each
# Function keeps its own attributes on it between forward and backward.


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Each position's entropy over the vocabulary (verl/utils/torch_functional.py
    entropy_from_logits): logsumexp(logits) - sum(softmax(logits) * logits)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def entropy(logits: torch.Tensor, chunked: bool, checkpointed: bool) -> torch.Tensor:
    """[..., V] logits: [...] fp32 entropy. `chunked`: ENTROPY_CHUNK_ROWS positions at a
    time, each cast to fp32 (verl's entropy_from_logits_with_chunking); `checkpointed`: under
    torch.utils.checkpoint, the softmax recomputed in the backward (verl's
    entropy_checkpointing)."""
    def compute(values: torch.Tensor) -> torch.Tensor:
        if not chunked:
            return entropy_from_logits(values.float())
        flat = values.reshape(-1, values.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.float32, device=values.device)
        for start in range(0, flat.shape[0], ENTROPY_CHUNK_ROWS):
            out[start:start + ENTROPY_CHUNK_ROWS] = entropy_from_logits(
                flat[start:start + ENTROPY_CHUNK_ROWS].float())
        return out.reshape(values.shape[:-1])

    if checkpointed and torch.is_grad_enabled() and logits.requires_grad:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(compute, logits, use_reentrant=False)
    return compute(logits)


class FusedLinearLogProb(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[label] per token, [N] fp32, chunk by chunk, and with
    `with_entropy` each token's entropy from the same chunk's logits (verl's fused forward
    returns both; the entropy carries no gradient here); backward recomputes each chunk's
    logits from the saved hidden states and weight."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_tokens: int, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropies = torch.empty(hidden.shape[0] if with_entropy else 0, dtype=torch.float32,
                                device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits = (hidden[start:end] @ weight.T).float()
            out[start:end] = logits.log_softmax(-1).gather(
                -1, labels[start:end].unsqueeze(-1)).squeeze(-1)
            if with_entropy:
                entropies[start:end] = entropy_from_logits(logits)
            del logits
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_tokens = chunk_tokens
        ctx.mark_non_differentiable(entropies)
        return out, entropies

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_entropies: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            # d log p[label] / d logits = onehot(label) - softmax(logits)
            grad_logits = (hidden[start:end] @ weight.T).float().softmax(-1)
            grad_logits.mul_(-grad_out[start:end].unsqueeze(-1))
            grad_logits.scatter_add_(-1, labels[start:end].unsqueeze(-1),
                                     grad_out[start:end].unsqueeze(-1).float())
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, hidden[start:end])
            del grad_logits
        return grad_hidden, grad_weight, None, None, None


class TritonShapedLogProb(torch.autograd.Function):
    """What verl's Triton linear cross-entropy allocates, for a trace (fake tensors cannot
    run a Triton kernel): [tokens, splits] fp32 partials in the forward, the logits' gradient
    TRITON_DLOGITS_COLUMNS columns wide in the backward (verl/utils/kernel/kernels.py
    efficient_entropy_forward / _backward). The values are not the log-probs."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, splits = hidden.shape[0], -(-weight.shape[0] // TRITON_VOCAB_SPLIT)
        partials = [torch.empty(tokens, splits, dtype=torch.float32, device=hidden.device)
                    for _ in range(3)]  # max, sum, entropy's b per split
        out, entropies = (torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
                          for _ in range(2))
        kept = torch.empty(tokens * 3, dtype=torch.float32, device=hidden.device)
        del partials
        ctx.save_for_backward(hidden, weight, kept)
        return out, entropies

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, grad_entropies: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, _ = ctx.saved_tensors
        columns = min(TRITON_DLOGITS_COLUMNS, weight.shape[0])
        d_logits = torch.empty(hidden.shape[0], columns, dtype=hidden.dtype,
                               device=hidden.device)
        del d_logits
        return torch.zeros_like(hidden), torch.zeros_like(weight), None


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    kind = tensor.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else tensor.dtype


def _trl_tiles(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype
               ) -> Iterator[tuple[slice, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """TRL's tiling: for each TRL_TOKEN_TILE tokens x TRL_VOCAB_CHUNK columns, (the token
    rows, the first column, the tokens' hidden states and the columns' weight in `dtype`,
    their logits) in one reused buffer, 32,768 columns wide whatever the vocabulary."""
    tokens, vocab = hidden.shape[0], weight.shape[0]
    buffer = torch.empty(min(tokens, TRL_TOKEN_TILE), TRL_VOCAB_CHUNK, dtype=dtype,
                         device=hidden.device)
    for first in range(0, tokens, TRL_TOKEN_TILE):
        rows = slice(first, first + TRL_TOKEN_TILE)
        chunk = hidden[rows].to(dtype)
        for start in range(0, vocab, TRL_VOCAB_CHUNK):
            end = min(start + TRL_VOCAB_CHUNK, vocab)
            columns = weight[start:end].to(dtype)
            tile = buffer[:chunk.shape[0], :end - start]
            torch.mm(chunk, columns.t(), out=tile)
            yield rows, start, chunk, columns, tile


class TrlChunkedLogProb(torch.autograd.Function):
    """TRL's ChunkedLogProbFunction (log-probs and entropy, no bias, temperature 1), op for op
    where TRL folds a tile in torch (`_forward_tile`, `_backward_tile`), so it holds what TRL
    holds; `in_place` (a trace of a GPU, where TRL's Triton kernels fold each tile in place)
    skips the fold's temporaries, and the values are not the log-probs."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                in_place: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        tokens, dtype = hidden.shape[0], _compute_dtype(hidden)
        running_max = torch.full((tokens,), float("-inf"), dtype=torch.float32,
                                 device=hidden.device)
        sum_exp, x_sum_exp, target_logit = (
            torch.zeros(tokens, dtype=torch.float32, device=hidden.device) for _ in range(3))
        unused = torch.zeros(3 * tokens, dtype=torch.float32, device=hidden.device)  # TRL
        # makes its three other per-token outputs' accumulators whatever it is asked
        for rows, start, _, _, tile in _trl_tiles(hidden, weight, dtype):
            if in_place:
                continue
            width = tile.shape[1]
            z = tile.float() * 1.0  # TRL's logit scale, then its 1/temperature
            z = z * 1.0
            local = labels[rows] - start
            new_max = torch.maximum(running_max[rows], z.amax(-1))
            rescale = torch.exp(running_max[rows] - new_max)
            e = torch.exp(z - new_max.unsqueeze(-1))
            sum_exp[rows] = sum_exp[rows] * rescale + e.sum(-1)
            x_sum_exp[rows] = x_sum_exp[rows] * rescale + (e * z).sum(-1)
            running_max[rows] = new_max
            inside = (local >= 0) & (local < width)
            picked = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
            target_logit[rows] = torch.where(inside, picked, target_logit[rows])
            del z, e
        del unused
        log_z = running_max + torch.log(sum_exp)
        entropies = log_z - x_sum_exp / sum_exp
        ctx.save_for_backward(hidden, weight, labels, log_z, entropies)
        ctx.in_place, ctx.dtype = in_place, dtype
        return target_logit - log_z, entropies

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None, grad_entropies: torch.Tensor | None
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, log_z, entropies = ctx.saved_tensors
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for rows, start, chunk, w_chunk, tile in _trl_tiles(hidden, weight, ctx.dtype):
            end = start + tile.shape[1]
            if ctx.in_place:  # the Triton fold, and cuBLAS's fp32-out GEMMs: no copies
                continue
            y = tile.float() * 1.0
            z = y * 1.0
            log_p = z - log_z[rows].unsqueeze(-1)
            p = torch.exp(log_p)
            grad = torch.zeros_like(z)
            if grad_out is not None:
                is_target = torch.arange(start, end, device=z.device) \
                    == labels[rows].unsqueeze(-1)
                grad += grad_out[rows].float().unsqueeze(-1) * (is_target.float() - p)
            if grad_entropies is not None:
                grad -= grad_entropies[rows].float().unsqueeze(-1) * p * (
                    log_p + entropies[rows].unsqueeze(-1))
            grad = grad * 1.0
            tile.copy_(grad * 1.0)
            del y, z, log_p, p, grad
            grad_hidden[rows].addmm_(tile.float(), w_chunk.float())
            grad_weight[start:end].addmm_(tile.t().float(), chunk.float())
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None


@functools.cache
def trl_chunked_function() -> type[torch.autograd.Function] | None:
    """TRL's own ChunkedLogProbFunction where TRL is installed, else None (looked up once: a
    missing package is not searched for again at every forward)."""
    try:
        from trl.kernels import ChunkedLogProbFunction
    except ImportError:
        return None
    return ChunkedLogProbFunction


def trl_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                  with_entropy: bool, on_gpu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, H] hidden states (in the forward's dtype), [V, H] weight, [N] labels: TRL's fused
    LM head's [N] fp32 log-probs and entropies, in the autocast dtype if one is on. TRL's own
    function where it is installed and the tensors are real; `on_gpu` (a trace of a GPU)
    folds in place as TRL's Triton kernels do."""
    function = trl_chunked_function()
    if function is None or isinstance(hidden, FakeTensor):
        return TrlChunkedLogProb.apply(hidden, weight, labels, on_gpu)
    outputs = ("log_probs", "entropy") if with_entropy else ("log_probs",)
    log_probs, entropies, *_ = function.apply(hidden, weight, None, labels, 1.0,
                                              TRL_VOCAB_CHUNK, None, 1.0, outputs)
    return log_probs, entropies if entropies is not None else torch.zeros_like(log_probs)


def verl_triton_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """verl's Triton linear cross-entropy (verl/utils/kernel/linear_cross_entropy.py): where
    verl, Triton and a CUDA device are; else a RuntimeError that says what to do."""
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    except ImportError as err:
        raise RuntimeError(f"fused_logprob_kernel=triton: verl's Triton kernel does not "
                           f"import where the probe runs ({err}); install verl there, or "
                           "probe with fused_logprob_kernel=torch") from None
    return linear_cross_entropy


def fused_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_tokens: int = FUSED_CHUNK_TOKENS, with_entropy: bool = False,
                    kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., H] hidden states, [V, H] weight, [...] labels: [...] fp32 log-probs, and with
    `with_entropy` the [...] entropies (else None). `kernel`: torch (chunks of
    `chunk_tokens`), triton (verl's kernel on a CUDA device; its allocations' stand-in under
    a trace's fake tensors)."""
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if kernel == "triton":
        if isinstance(hidden, FakeTensor):
            flat, entropies = TritonShapedLogProb.apply(flat_hidden, weight, flat_labels)
        elif hidden.device.type != "cuda":
            raise RuntimeError("fused_logprob_kernel=triton runs on a CUDA device only; "
                               "probe on a GPU, or with fused_logprob_kernel=torch")
        else:
            flat, entropies = verl_triton_kernel()(flat_hidden, weight, flat_labels, 1.0,
                                                   "none")
    else:
        flat, entropies = FusedLinearLogProb.apply(flat_hidden, weight, flat_labels,
                                                   chunk_tokens, with_entropy)
    return flat.reshape(labels.shape), \
        entropies.reshape(labels.shape) if with_entropy else None


class FusedHead(torch.nn.Module):
    """Stands in for a model's LM head for one forward: from the hidden states of every
    position, the log-prob of the next token (`labels`, [batch, tokens]), not the logits;
    with `with_entropy`, each position's entropy is left in `entropy`."""

    def __init__(self, head: torch.nn.Linear, labels: torch.Tensor, chunk_tokens: int,
                 with_entropy: bool = False, kernel: str = "torch",
                 scored: tuple[int, int] | None = None, on_gpu: bool = False) -> None:
        super().__init__()
        self.head, self.labels, self.chunk_tokens = head, labels, chunk_tokens
        self.with_entropy, self.kernel = with_entropy, kernel
        self.scored, self.on_gpu = scored, on_gpu  # trl: the positions it scores
        self.entropy: torch.Tensor | None = None

    def _trl(self, hidden: torch.Tensor) -> torch.Tensor:
        """TRL's head: positions `scored` (its completion tokens, on a GPU) or every one
        but the last (a CPU), in the autocast's dtype; 0 at the others, as TRL fills them."""
        first, last = self.scored or (0, hidden.shape[1] - 1)
        rows, width = hidden.shape[0], last - first
        part = hidden[:, first:last].reshape(-1, hidden.shape[-1])
        flat, entropies = trl_log_probs(part, self.head.weight,
                                        self.labels[:, first:last].reshape(-1),
                                        self.with_entropy, self.on_gpu)
        pad = (first, hidden.shape[1] - last)
        self.entropy = torch.nn.functional.pad(entropies.view(rows, width), pad) \
            if self.with_entropy else None
        return torch.nn.functional.pad(flat.view(rows, width), pad)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel == "trl":
            return self._trl(hidden)
        weight = self.head.weight  # gathered: the model's forward runs this
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) \
            else weight.dtype  # the dtype the model's own head would compute in
        with torch.autocast(kind, enabled=False):
            log_probs, self.entropy = fused_log_probs(
                hidden.to(dtype), weight.to(dtype), self.labels, self.chunk_tokens,
                self.with_entropy, self.kernel)
        return log_probs


@contextlib.contextmanager
def fused_head(model: PreTrainedModel, labels: torch.Tensor,
               chunk_tokens: int = FUSED_CHUNK_TOKENS, with_entropy: bool = False,
               kernel: str = "torch",
               scored: tuple[int, int] | None = None, on_gpu: bool = False
               ) -> Iterator[FusedHead]:
    """Within: `model(...)`'s `.logits` are the [batch, tokens] log-probs of `labels` (and
    the head it yields holds their entropy, with `with_entropy`); kernel trl scores the
    positions `scored` only (TRL on a GPU), else every one but the last."""
    head = model.get_output_embeddings()
    fused = FusedHead(head, labels, chunk_tokens, with_entropy, kernel, scored, on_gpu)
    model.set_output_embeddings(fused)
    try:
        yield fused
    finally:
        model.set_output_embeddings(head)
