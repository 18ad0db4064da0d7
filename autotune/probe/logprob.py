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

from autotune.config import FUSED_CHUNK_TOKENS


class FusedLinearLogProb(torch.autograd.Function):
    """log_softmax(hidden @ weight.T)[label] per token, [N] fp32, chunk by chunk; backward
    recomputes each chunk's logits from the saved hidden states and weight."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                chunk_tokens: int) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits = (hidden[start:end] @ weight.T).float()
            out[start:end] = logits.log_softmax(-1).gather(
                -1, labels[start:end].unsqueeze(-1)).squeeze(-1)
            del logits
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_tokens = chunk_tokens
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
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
        return grad_hidden, grad_weight, None, None


def fused_log_probs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    chunk_tokens: int = FUSED_CHUNK_TOKENS) -> torch.Tensor:
    """[..., H] hidden states, [V, H] weight, [...] labels: [...] fp32 log-probs."""
    flat = FusedLinearLogProb.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                    labels.reshape(-1), chunk_tokens)
    return flat.reshape(labels.shape)


class FusedHead(torch.nn.Module):
    """Stands in for a model's LM head for one forward: from the hidden states of every
    position, the log-prob of the next token (`labels`, [batch, tokens]), not the logits."""

    def __init__(self, head: torch.nn.Module, labels: torch.Tensor, chunk_tokens: int) -> None:
        super().__init__()
        self.head, self.labels, self.chunk_tokens = head, labels, chunk_tokens

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight  # gathered: the model's forward runs this
        kind = hidden.device.type
        dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) \
            else weight.dtype  # the dtype the model's own head would compute in
        with torch.autocast(kind, enabled=False):
            return fused_log_probs(hidden.to(dtype), weight.to(dtype), self.labels,
                                   self.chunk_tokens)


@contextlib.contextmanager
def fused_head(model: Any, labels: torch.Tensor,
               chunk_tokens: int = FUSED_CHUNK_TOKENS) -> Iterator[None]:
    """Within: `model(...)`'s `.logits` are the [batch, tokens] log-probs of `labels`."""
    head = model.get_output_embeddings()
    model.set_output_embeddings(FusedHead(head, labels, chunk_tokens))
    try:
        yield
    finally:
        model.set_output_embeddings(head)
