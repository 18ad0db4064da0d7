"""The step's forwards over responses: log-probs, entropies and values, micro-batch by
micro-batch, with the padding removed where dynamic batching removes it.

The experience, the update and the critic's update all run these (experience.py, update.py).
Fixed micro-batches pad every sequence to the full length, as the trainers do without padding
removal; with dynamic batching each sequence runs at its own length. Log-probs come from the
whole logits in fp32, or fused with the LM head (modeling/logprob.py); with Ulysses sequence
parallelism each rank forwards its slice of every sequence and the results are gathered
(modeling/ulysses.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from autotune.batching import micro_batches
from autotune.probe.modeling.logprob import entropy, fused_head
from autotune.probe.modeling.ulysses import gather_positions, padded_length
from autotune.probe.step.state import StepState

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Forwards(StepState):
    """Log-probs, entropies and values of responses, as the trained phases run them."""

    def _micro_batches(self, index: torch.Tensor, phase: str) -> list[torch.Tensor]:
        """`index` (responses) cut into `phase`'s micro-batches (batching.py), recording the
        largest as it ran."""
        lengths = (self.response_lengths[index] + self.config.max_prompt_length).tolist()
        groups = [index[group] for group in
                  micro_batches(lengths, self.batching_knobs, phase)]
        key = f"{phase}_micro_batch_rows"
        self.ran[key] = max(self.ran.get(key, 0), max(len(group) for group in groups))
        return groups

    def _tokens(self, index: torch.Tensor) -> float:
        """Prompt and response tokens of sequences `index`: a unit's work (unit_loops.py)."""
        return float(sum(self.response_lengths[index].tolist())
                     + len(index) * self.config.max_prompt_length)

    def _chunked(self, forward: Callable[[torch.Tensor], torch.Tensor],
                 chunks: list[torch.Tensor], unit: str) -> torch.Tensor:
        """`forward` (log-probs or values) of every response, micro-batch by micro-batch: the
        meter's units of `unit` (a short probe runs some, a trace the first and the last)."""
        out = torch.zeros(len(self.responses), self.responses.shape[1])
        for i in self.meter.iterations(unit, [self._tokens(chunk) for chunk in chunks]):
            out[chunks[i]] = forward(chunks[i]).cpu()
        return out

    def _valid(self, index: torch.Tensor) -> torch.Tensor:
        """[len(index), response length]: whether each position is in its response."""
        return (torch.arange(self.responses.shape[1], device=self.device)
                < self.response_lengths[index].to(self.device).unsqueeze(-1))

    def _log_probs_and_entropy(self, model: PreTrainedModel, index: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and each position's entropy from the same logits (as `_log_probs`;
        entropy_chunking and entropy_checkpointing say how the entropy is taken)."""
        both = self._padding_removed(
            index, lambda rows, tokens: self._forward_log_probs(model, rows, tokens, True))
        return both[..., 0], both[..., 1]

    def _log_probs(self, model: PreTrainedModel, index: torch.Tensor) -> torch.Tensor:
        """Log-probs of the response tokens of sequences `index`, [len(index), response
        length]. Fixed micro-batches pad every sequence to the full length, as the trainers do
        without padding removal; with dynamic batching the padding is removed: each sequence
        runs at its own length (the tokens, activations and logits a packed flash-attention
        varlen forward holds, without a packed mask) and positions past its end are 0."""
        return self._padding_removed(
            index, lambda rows, tokens: self._forward_log_probs(model, rows, tokens))

    def _values(self, index: torch.Tensor) -> torch.Tensor:
        """The critic's values of the response tokens of sequences `index`, batched as the
        log-probs are (fp32, [len(index), response length])."""
        return self._padding_removed(index, self._forward_values)

    def _padding_removed(self, index: torch.Tensor,
                         forward: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
        """`forward(index, tokens)` over the full response, or with dynamic batching each
        sequence at its own length, padded with 0 past its end."""
        lengths = self.response_lengths[index]
        full = self.responses.shape[1]
        if not self.config.dynamic_batching or bool((lengths == full).all()):
            return forward(index, full)
        rows = [forward(index[i:i + 1], int(n)) for i, n in enumerate(lengths.tolist())]
        # pad the token dimension (the second; a trailing one, [..., 2], is left as it is)
        return torch.cat([torch.nn.functional.pad(row, (0, 0) * (row.dim() - 2)
                                                  + (0, full - row.shape[1])) for row in rows])

    def _sequences(self, index: torch.Tensor, tokens: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prompt rows, token ids (on the device) and response tokens of sequences `index`
        cut to `tokens` response tokens, and where the response's predictions start."""
        rows = self.response_rows[index]
        prompt = self.prompt_ids[rows]
        response = self.responses[index][:, :tokens]
        ids = torch.cat([prompt, response], dim=1).to(self.device)
        return rows, ids, response, prompt.shape[1] - 1

    def _forward_values(self, index: torch.Tensor, tokens: int) -> torch.Tensor:
        """The critic's value of each of the first `tokens` response tokens (verl slices
        values[:, -response_length - 1:-1])."""
        rows, ids, response, start = self._sequences(index, tokens)
        assert self.critic is not None  # PPO's
        with self._autocast():
            values = self.critic(ids, **self._vl_inputs(rows))
        return values[:, start:start + response.shape[1]].to(torch.float32)

    def _forward_log_probs(self, model: PreTrainedModel, index: torch.Tensor, tokens: int,
                           with_entropy: bool = False) -> torch.Tensor:
        """Log-probs of the first `tokens` response tokens of sequences `index` (fp32 over
        the vocabulary): from the whole logits, or fused (modeling/logprob.py); `with_entropy`:
        [..., 2], each position's entropy beside its log-prob."""
        if self.sequence_group is not None:
            return self._sequence_parallel_log_probs(model, index, tokens, with_entropy)
        rows, ids, response, start = self._sequences(index, tokens)
        end = start + response.shape[1]
        config = self.config
        if config.fused_logprob:  # every position's next token, as verl's fused forward
            trl = config.fused_logprob_kernel == "trl"  # TRL's head: the policy's entropy
            # always, the completion tokens alone where its Triton kernels run (a GPU)
            with self._autocast(), fused_head(
                    model, torch.roll(ids, -1, dims=1),
                    with_entropy=with_entropy or (trl and model is self.model),
                    kernel=config.fused_logprob_kernel,
                    scored=(start, end) if trl and self.gpu_kernels else None,
                    on_gpu=self.gpu_kernels) as head:
                log_probs = model(input_ids=ids, use_cache=False, **self._vl_inputs(rows)).logits
            if not with_entropy:
                return log_probs[:, start:end]
            assert head.entropy is not None
            return torch.stack([log_probs[:, start:end], head.entropy[:, start:end]], dim=-1)
        with self._autocast():
            logits = model(input_ids=ids, use_cache=False, **self._vl_inputs(rows)).logits
        # an fp32 copy of the response positions (a CPU kernel would copy the slice unseen)
        response_logits = logits[:, start:end].to(torch.float32, copy=True)
        del logits
        entropies = entropy(response_logits, config.entropy_chunking,
                            config.entropy_checkpointing) if with_entropy else None
        log_probs = torch.log_softmax(response_logits, dim=-1).gather(
            -1, response.to(self.device).unsqueeze(-1)).squeeze(-1)
        if entropies is None:
            return log_probs
        return torch.stack([log_probs, entropies], dim=-1)

    def _sequence_parallel_log_probs(self, model: PreTrainedModel, index: torch.Tensor,
                                     tokens: int, with_entropy: bool) -> torch.Tensor:
        """`_forward_log_probs` on this rank's slice of each sequence (ulysses.py): the
        slice's logits, every local position's fp32 log-prob (and entropy), gathered over the
        group into the response's, as verl's padding-removed path computes them."""
        group = self.sequence_group
        assert group is not None  # sp > 1
        _, ids, response, start = self._sequences(index, tokens)
        end, length = start + response.shape[1], ids.shape[1]
        pad = (0, padded_length(length, group.size) - length)
        labels = torch.nn.functional.pad(torch.roll(ids, -1, dims=1), pad)[:, group.local_slice(
            length)]
        local = group.local_slice(length)
        positions = torch.arange(local.start, local.stop, device=self.device)
        with self._autocast():  # the phase runs inside sequence_parallel (step)
            logits = model(input_ids=torch.nn.functional.pad(ids, pad)[:, local],
                           position_ids=positions.expand(len(ids), -1), use_cache=False).logits
        local_logits = logits.to(torch.float32, copy=True)
        del logits
        log_probs = torch.log_softmax(local_logits, dim=-1).gather(
            -1, labels.unsqueeze(-1)).squeeze(-1)
        whole = gather_positions(log_probs, group)[:, start:end]
        if not with_entropy:
            return whole
        entropies = entropy(local_logits, self.config.entropy_chunking,
                            self.config.entropy_checkpointing)
        return torch.stack([whole, gather_positions(entropies, group)[:, start:end]], dim=-1)
