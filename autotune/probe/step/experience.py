"""The experience phase: the old log-probs (unless `old_logprob_pass` is off, as TRL runs
one optimizer step a generation), the reference's, and the advantages.

GRPO's advantages are each response against its group; PPO's come from the critic's values
and GAE (verl's compute_values loads the critic's params, not its optimizer). Params offloaded
between phases are loaded for the forwards and put back after them.
"""

from __future__ import annotations

import torch

from autotune.probe.modeling.critic import gae_advantages
from autotune.probe.modeling.lora import adapters_off
from autotune.probe.step.forwards import Forwards
from autotune.probe.step.offload import Offload


class ExperiencePhase(Forwards, Offload):
    """The experience phase: old and reference log-probs, values, advantages."""

    def _old_log_probs(self, index: torch.Tensor) -> torch.Tensor:
        """The actor's log-probs before the update, with entropy_metric each position's
        entropy from the same logits too (verl's compute_log_prob, calculate_entropy: its
        actor/entropy metric, the token-mean over the responses)."""
        if not self.config.entropy_metric:
            return self._log_probs(self.model, index)
        log_probs, entropies = self._log_probs_and_entropy(self.model, index)
        valid = self._valid(index)
        self.mean_entropy = (entropies * valid).sum() / valid.sum()  # a tensor: a trace's
        return log_probs

    def _experience(self) -> None:
        config = self.config
        total = len(self.responses)
        if config.offload_params:
            self._place_module(self.model, True)
        with torch.no_grad():
            chunks = self._micro_batches(torch.arange(total), "experience")
            if config.runs_old_logprob_pass:  # off: the update's own, detached (TRL)
                self.old_log_probs = self._chunked(self._old_log_probs, chunks, "old_log_prob")
            ref = self.ref_model
            if ref is not None:
                if config.ref_on_host:
                    self._place_module(ref, True)
                self.ref_log_probs = self._chunked(lambda c: self._log_probs(ref, c), chunks,
                                                  "ref_log_prob")
                if config.ref_on_host:
                    self._place_module(ref, False)
            elif config.use_kl:  # LoRA: the reference is the actor with its adapters off
                with adapters_off(self.model):
                    self.ref_log_probs = self._chunked(
                        lambda c: self._log_probs(self.model, c), chunks, "ref_log_prob")
        if config.offload_params:
            self._place_module(self.model, False)
        rewards = torch.randn(total // config.rollout_n, config.rollout_n)
        if self.critic is None:  # GRPO: each response against its group
            advantages = (rewards - rewards.mean(1, keepdim=True)) / (
                rewards.std(1, keepdim=True) + 1e-6)
            self.advantages = advantages.reshape(-1)
            return
        # PPO: the critic's values (verl's compute_values loads its params, not its
        # optimizer), then GAE
        if config.critic_offload_params:
            self._place_module(self.critic, True)
        with torch.no_grad():
            chunks = self._micro_batches(torch.arange(total), "critic_update")
            self.old_values = self._chunked(self._values, chunks, "values")
        if config.critic_offload_params:
            self._place_module(self.critic, False)
        valid = (torch.arange(self.responses.shape[1])  # on the host, as the trainers
                 < self.response_lengths.unsqueeze(-1)).float()  # compute advantages
        self.advantages, self.returns = gae_advantages(rewards.reshape(-1), self.old_values,
                                                       valid)
