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
from torch._subclasses.fake_tensor import FakeTensor

from autotune.config import (
    ENTROPY_CHUNK_ROWS,
    FUSED_CHUNK_TOKENS,
    TRITON_DLOGITS_COLUMNS,
    TRITON_VOCAB_SPLIT,
)


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
    def backward(ctx: Any, grad_out: torch.Tensor, grad_entropies: Any) -> tuple[Any, ...]:
        hidden, weight, _ = ctx.saved_tensors
        columns = min(TRITON_DLOGITS_COLUMNS, weight.shape[0])
        d_logits = torch.empty(hidden.shape[0], columns, dtype=hidden.dtype,
                               device=hidden.device)
        del d_logits
        return torch.zeros_like(hidden), torch.zeros_like(weight), None


def verl_triton_kernel() -> Any:
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

    def __init__(self, head: torch.nn.Module, labels: torch.Tensor, chunk_tokens: int,
                 with_entropy: bool = False, kernel: str = "torch") -> None:
        super().__init__()
        self.head, self.labels, self.chunk_tokens = head, labels, chunk_tokens
        self.with_entropy, self.kernel = with_entropy, kernel
        self.entropy: torch.Tensor | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
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
def fused_head(model: Any, labels: torch.Tensor, chunk_tokens: int = FUSED_CHUNK_TOKENS,
               with_entropy: bool = False, kernel: str = "torch") -> Iterator[FusedHead]:
    """Within: `model(...)`'s `.logits` are the [batch, tokens] log-probs of `labels` (and
    the head it yields holds their entropy, with `with_entropy`)."""
    head = model.get_output_embeddings()
    fused = FusedHead(head, labels, chunk_tokens, with_entropy, kernel)
    model.set_output_embeddings(fused)
    try:
        yield fused
    finally:
        model.set_output_embeddings(head)
