"""The rollout phase (and validation's generation): the engine wakes, generates `rollout_n`
responses per prompt, always to `max_response_length`, and sleeps.

How it generates is the engine's (engine.py, vllm_engine.py); what the phase records is the
share as it ran (prompts and responses per step). With Ulysses sequence parallelism each rank's
responses are the group's, gathered, as the trained phases see them.
"""

from __future__ import annotations

import contextlib

import torch

from autotune.probe.modeling.models import without_special_ids
from autotune.probe.step.offload import Offload


class RolloutPhase(Offload):
    """The rollout phase and validation's generation."""

    def _generate(self, prompt_rows: torch.Tensor) -> torch.Tensor:
        """Exactly max_response_length tokens for each row (engine.py says how); the trained
        model generating itself computes under its autocast, as its forwards do."""
        with self._autocast() if self.config.actor_generates else contextlib.nullcontext():
            return self.engine.generate(self.prompt_ids, self._vl_inputs, prompt_rows)

    def _rollout(self) -> None:
        config = self.config
        self._wake_engine()
        rows = torch.arange(self.share.prompts_per_step).repeat_interleave(config.rollout_n)
        with torch.no_grad():
            self.responses = without_special_ids(self._generate(rows), self.model_config)
        self.response_rows = rows
        self.response_lengths = self._response_lengths(len(rows))
        self.ran.update(world_size=self.request.world_size,
                        prompts_per_step=len(rows) // config.rollout_n,
                        responses_per_step=len(self.responses))
        if self.sequence_group is not None:  # the group's sequences: each rank's, gathered
            sp = self.sequence_group.size
            self.responses = self.responses.repeat(sp, 1)
            self.response_rows = self.response_rows.repeat(sp)
            self.response_lengths = self.response_lengths.repeat(sp)
        self._sleep_engine()

    def _response_lengths(self, responses: int) -> torch.Tensor:
        """Each response's length: all at max_response_length, the worst case that memory
        verdicts stand on (a benchmark of sampled lengths overrides this)."""
        return torch.full((responses,), self.config.max_response_length, dtype=torch.long)

    def _validate(self) -> None:
        self._wake_engine()
        rows = torch.arange(self.share.val_prompts)
        self.ran["val_prompts"] = len(rows)
        with torch.no_grad():
            self._generate(rows)
        self._sleep_engine()
