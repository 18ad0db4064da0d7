"""The trained phases: the actor's update and PPO's critic update.

Each runs the actor's mini-batches cut into its own micro-batches or token budget, with
gradient accumulation weighted by each micro-batch's share of the mini-batch (verl's scaling
with dynamic batching), and an AdamW step per mini-batch; the first step brings AdamW's state
into being, which is the update's peak. The actor's loss is GRPO's clipped ratio with the k3
KL estimator and verl's entropy bonus; the critic's is verl's clipped value loss. Each counts
this rank's params, grads and AdamW state as its update holds them.

A short probe's warm-up step runs each update's last mini-batch and each mini-batch's last
micro-batch beside the first (`warm_last`): where a full step's update peaks on a GPU depends on
what the caching allocator holds when the next mini-batch makes its gradients anew beside
AdamW's state, which a warm-up of the first mini-batch alone never reaches. On the H200 a
1.5B FSDP1 rank of 8 with four optimizer steps an update (held-out grid 4's row 07) reserved
7.71 GiB in its update under the first-only warm-up; the same probe's allocations replayed
through the caching allocator give 7.89 GiB for that schedule, 8.51 for a probe of every
unit, and 8.51 with this warm-up (the H200 then reserved 8.21; grid 4's row 02, two
optimizer steps: 35.47 -> 36.28 replayed, 35.25 -> 35.92 on the H200).
A GPU's trace runs both anyway (each loop's first and last); a CPU's trace's first step runs
the first alone (its peaks are live tensors, the second step's).
"""

from __future__ import annotations

import torch

from autotune.probe.measure.unit_loops import UPDATE_WARMS_LAST
from autotune.probe.modeling.critic import value_loss
from autotune.probe.modeling.sharding import local_bytes, reshard_gathered
from autotune.probe.step.forwards import Forwards
from autotune.probe.step.offload import Offload

_CLIP_EPS = 0.2
_KL_COEF = 0.01


class UpdatePhase(Forwards, Offload):
    """The actor's update and the critic's update."""

    def _update(self) -> None:
        config = self.config
        self._place_actor(params_on_device=True, optimizer_on_device=True)
        self.model.train()
        per_minibatch = self.train_share.responses_per_minibatch
        minibatches = torch.randperm(len(self.responses)).split(per_minibatch)
        self.ran.update(minibatches=len(minibatches),
                        responses_per_minibatch=max(len(m) for m in minibatches))
        # the meter's units: a trace runs the first (grads, AdamW's state made) and the last,
        # a short probe its first few and the last, timed, and its warm-up the first and the
        # last too (module docstring)
        for i in self.meter.iterations("minibatch", [self._tokens(m) for m in minibatches],
                                       warm_last=UPDATE_WARMS_LAST):
            minibatch = minibatches[i]
            micros = self._micro_batches(minibatch, "update")
            for j in self.meter.iterations("micro_batch", [self._tokens(m) for m in micros],
                                           warm_last=UPDATE_WARMS_LAST):
                micro = micros[j]
                entropies = None
                if config.entropy_coeff:
                    log_probs, entropies = self._log_probs_and_entropy(self.model, micro)
                else:
                    log_probs = self._log_probs(self.model, micro)
                # token-mean over each response's own tokens; a micro-batch weighs as its
                # share of the mini-batch (verl's scaling with dynamic batching, and the
                # 1/accumulation of fixed micro-batches)
                valid = self._valid(micro)
                old = self.old_log_probs[micro].to(self.device) \
                    if config.runs_old_logprob_pass \
                    else log_probs.detach()
                advantage = self.advantages[micro].to(self.device)
                if advantage.dim() == 1:  # GRPO: one advantage per response
                    advantage = advantage.unsqueeze(-1)
                ratio = torch.exp(log_probs - old)
                clipped = torch.clamp(ratio, 1 - _CLIP_EPS, 1 + _CLIP_EPS)
                loss = -torch.min(ratio * advantage, clipped * advantage)
                if config.use_kl:
                    delta = self.ref_log_probs[micro].to(self.device) - log_probs
                    loss = loss + _KL_COEF * (torch.exp(delta) - delta - 1)  # k3 estimator
                if entropies is not None:  # verl's entropy bonus: policy_loss - coeff * H
                    loss = loss - config.entropy_coeff * entropies
                weight = len(micro) / len(minibatch)
                ((loss * valid).sum() / valid.sum() * weight).backward()
            self.optimizer.step()
            self._count_model_states(self.model, self.optimizer)
            self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        reshard_gathered(self.model)
        self._place_actor(params_on_device=not config.offload_params,
                          optimizer_on_device=not config.offload_optimizer)

    def _update_critic(self) -> None:
        """PPO's critic update: the actor's mini-batches in the critic's micro-batches (or
        token budget), verl's clipped value loss, an AdamW step each."""
        config = self.config
        assert self.critic is not None
        self._place_states(self.critic, self.critic_optimizer, True, True)
        self.critic.train()
        minibatches = torch.randperm(len(self.responses)).split(
            self.train_share.responses_per_minibatch)
        for i in self.meter.iterations("minibatch", [self._tokens(m) for m in minibatches],
                                       warm_last=UPDATE_WARMS_LAST):  # as the actor's
            minibatch = minibatches[i]
            micros = self._micro_batches(minibatch, "critic_update")
            for j in self.meter.iterations("micro_batch", [self._tokens(m) for m in micros],
                                           warm_last=UPDATE_WARMS_LAST):
                micro = micros[j]
                values = self._values(micro)
                loss = value_loss(values, self.old_values[micro].to(self.device),
                                  self.returns[micro].to(self.device), self._valid(micro))
                (loss * len(micro) / len(minibatch)).backward()
            self.critic_optimizer.step()
            self._count_model_states(self.critic, self.critic_optimizer, "critic_")
            self.critic_optimizer.zero_grad(set_to_none=True)
        self.critic.eval()
        self._place_states(self.critic, self.critic_optimizer, not config.critic_offload_params,
                           not config.critic_offload_optimizer)

    def _count_model_states(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                            prefix: str = "") -> None:
        """This rank's fp32 params, grads and AdamW state of `model`, as its update holds
        them (the critic's under critic_*)."""
        params = list(model.parameters())
        state = [value for entry in optimizer.state.values()
                 for value in entry.values() if torch.is_tensor(value) and value.dim() > 0]
        self.model_state_bytes.update({f"{prefix}params": local_bytes(params),
                                       f"{prefix}grads": local_bytes(p.grad for p in params),
                                       f"{prefix}optimizer": local_bytes(state)})
