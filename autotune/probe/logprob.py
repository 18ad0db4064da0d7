"""Log-probs of the tokens from the LM head, as the trainers compute them.

Unfused (every trainer's default): the model returns the whole [tokens, vocabulary] logits
and the step takes an fp32 log-softmax of the response positions (probe/step.py).

Fused (`fused_logprob`): the log-probs come from the last hidden states and the LM head's
weight in chunks of FUSED_CHUNK_TOKENS tokens, and the logits of the whole micro-batch never
exist: the arithmetic of verl's `use_fused_kernels` with its torch backend (FusedLinearForPPO,
verl/utils/experimental/torch_functional.py: chunks of 512 tokens, each chunk's logits cast to
fp32, backward keeping only the hidden states, the weight and the labels and recomputing each
chunk's logits). Liger's fused linear losses hold the same order of memory (a chunk's logits
at a time). The head is swapped in for the model's own LM head for one forward (`fused_head`),
so it runs inside the model's forward, where FSDP has the root's parameters (the head's among
them) gathered, as verl's patched forward does. Imports torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from autotune.config import ENTROPY_CHUNK_ROWS, FUSED_CHUNK_TOKENS


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
    def backward(ctx: Any, grad_out: torch.Tensor, grad_entropies: Any) -> tuple[Any, ...]:
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


def fused_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_tokens: int = FUSED_CHUNK_TOKENS, with_entropy: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., H] hidden states, [V, H] weight, [...] labels: [...] fp32 log-probs, and with
    `with_entropy` the [...] entropies (else None)."""
    flat, entropies = FusedLinearLogProb.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                               labels.reshape(-1), chunk_tokens, with_entropy)
    return flat.reshape(labels.shape), \
        entropies.reshape(labels.shape) if with_entropy else None


class FusedHead(torch.nn.Module):
    """Stands in for a model's LM head for one forward: from the hidden states of every
    position, the log-prob of the next token (`labels`, [batch, tokens]), not the logits;
    with `with_entropy`, each position's entropy is left in `entropy`."""

    def __init__(self, head: torch.nn.Module, labels: torch.Tensor, chunk_tokens: int,
                 with_entropy: bool = False) -> None:
        super().__init__()
        self.head, self.labels, self.chunk_tokens = head, labels, chunk_tokens
        self.with_entropy = with_entropy
        self.entropy: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight  # gathered: the model's forward runs this
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) \
            else weight.dtype  # the dtype the model's own head would compute in
        with torch.autocast(kind, enabled=False):
            log_probs, self.entropy = fused_log_probs(
                hidden.to(dtype), weight.to(dtype), self.labels, self.chunk_tokens,
                self.with_entropy)
        return log_probs


@contextlib.contextmanager
def fused_head(model: Any, labels: torch.Tensor, chunk_tokens: int = FUSED_CHUNK_TOKENS,
               with_entropy: bool = False) -> Iterator[FusedHead]:
    """Within: `model(...)`'s `.logits` are the [batch, tokens] log-probs of `labels` (and
    the head it yields holds their entropy, with `with_entropy`)."""
    head = model.get_output_embeddings()
    fused = FusedHead(head, labels, chunk_tokens, with_entropy)
    model.set_output_embeddings(fused)
    try:
        yield fused
    finally:
        model.set_output_embeddings(head)
