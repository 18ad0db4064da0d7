"""What the phases of one training step share: the request, the model's config, this rank's
share of the batch, what `build` makes and the tensors each phase hands the next.

StepState holds the actor, its AdamW, the reference, the critic, the engine and the prompts
(made by build.py), and each step's responses, log-probs, values and advantages (made by
rollout.py and experience.py, read by update.py). The phases are its subclasses' methods;
TrainingProbe (training.py) composes them and runs them in order. The CUDA caching
allocator's settings a probe runs under are read here too: its process's
PYTORCH_CUDA_ALLOC_CONF at start-up, then expandable segments per phase.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from autotune.config import KnobValue, ProbeConfig, compute_dtype, device_share, image_tokens
from autotune.memory.replay import AllocatorSettings
from autotune.probe.measure.meter import MemoryMeter, Meter, torch_device
from autotune.probe.measure.result import ProbeRequest
from autotune.probe.modeling.critic import ValueModel
from autotune.probe.modeling.models import is_vl_config, load_model_config
from autotune.probe.modeling.sharding import RankGroup
from autotune.probe.modeling.ulysses import SequenceGroup
from autotune.probe.step.engine import Rollout

if TYPE_CHECKING:
    from transformers import PreTrainedModel


ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_AVOID_RECORD_STREAMS")


def allocator_settings(request: ProbeRequest) -> AllocatorSettings:
    """The CUDA caching allocator's settings the request's probe runs under: its process's
    PYTORCH_CUDA_ALLOC_CONF at start-up (the trainer's, request.env, else this environment's),
    then expandable segments per phase as the step switches them (the knob, never in the
    rollout)."""
    conf = request.env.get("PYTORCH_CUDA_ALLOC_CONF",
                           os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    return AllocatorSettings.from_env(conf, request.config.expandable_segments)


def allocator_record(settings: AllocatorSettings, phases: list[str]) -> dict[str, str]:
    """What a result records of the allocator it ran under: the trainer's environment
    variables as this process had them, and the phases with expandable segments on."""
    record = {name: os.environ[name] for name in ALLOCATOR_ENV if name in os.environ}
    on = [phase for phase in phases if settings.expandable_in(phase)]
    record["expandable_segments_in"] = " ".join(on) if on else "none"
    return record


class StepState:
    """The step's state: what build() makes and what each phase hands the next."""

    def __init__(self, request: ProbeRequest, meter: Meter | None = None) -> None:
        self.request = request
        self.config: ProbeConfig = request.config
        # the knobs as batching.py reads them, by name (the config stays the working form);
        # a token budget is per GPU, a sequence-parallel group's sp times it (verl's rule)
        self.batching_knobs: Mapping[str, KnobValue] = self.config.batching_knobs()
        self.meter = meter or MemoryMeter(torch_device(request.device.kind),
                                          short=request.short)
        self.device = self.meter.device  # the CPU for a trace (trace.py), whatever it models
        self.on_gpu = self.device.type == "cuda"
        self.gpu_kernels = self.meter.gpu_kernels  # a GPU's dtype and AdamW's foreach step
        wanted = compute_dtype(request.dtype, self.gpu_kernels)
        self.compute_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[wanted]
        self.share = device_share(self.config, request.world_size)  # this GPU's part
        # the trained phases' share: an SP group trains the same sequences (ProbeConfig)
        self.train_share = self.config.trained_share(request.world_size)
        self.sequence_group: SequenceGroup | None = None  # made by build() when sp > 1
        self.allocator = allocator_settings(request)  # the CUDA allocator's, per phase
        self.ran: dict[str, int] = {}  # the share as it ran: counted from the tensors
        self.host_offload_bytes = 0  # bytes of actor/ref tensors in host memory now
        self.peak_host_offload_bytes = 0
        self.group: RankGroup | None = None  # the FSDP ranks when world_size > 1
        self.model_state_bytes: dict[str, int] = {}  # this rank's params, grads, AdamW
        self.model_config = load_model_config(request.model, request.model_path)
        self.is_vl = is_vl_config(self.model_config)
        self.text_config = getattr(self.model_config, "text_config", self.model_config)
        self.vocab_size = int(self.text_config.vocab_size)
        self.image_tokens = image_tokens(self.config) if self.is_vl else 0
        # made by build(): the actor, its AdamW, the reference, the engine, the prompts
        self.model: PreTrainedModel  # FSDP-sharded when world_size > 1 (sharding.py)
        self.num_params = 0
        self.optimizer: torch.optim.Optimizer
        self.ref_model: PreTrainedModel | None = None  # with use_kl
        self.critic: ValueModel | None = None  # PPO's value model, and its AdamW
        self.critic_optimizer: torch.optim.Optimizer  # made with the critic
        self.mean_entropy: torch.Tensor | None = None  # entropy_metric: the last experience's
        self.engine: Rollout
        self.engine_weight_bytes = 0
        self.prompt_ids = torch.empty(0, dtype=torch.long)
        self.pixel_values: torch.Tensor | None = None
        self.grid_side = 0
        # made by each step's phases: the responses, their log-probs and advantages
        self.responses = torch.empty(0, dtype=torch.long)
        self.response_lengths = torch.empty(0, dtype=torch.long)  # tokens before each EOS
        self.response_rows = torch.empty(0, dtype=torch.long)
        self.old_log_probs = torch.empty(0)
        self.ref_log_probs = torch.empty(0)
        self.advantages = torch.empty(0)  # [responses] (GRPO) or [responses, tokens] (PPO)
        self.old_values = torch.empty(0)  # PPO: the critic's values and the returns
        self.returns = torch.empty(0)

    @contextmanager
    def _autocast(self) -> Iterator[None]:
        if self.compute_dtype != torch.float32:
            with torch.autocast(self.device.type, dtype=self.compute_dtype):
                yield
        else:
            yield

    def _vl_inputs(self, prompt_rows: torch.Tensor) -> dict[str, torch.Tensor]:
        if not self.is_vl:
            return {}
        assert self.pixel_values is not None  # made with the prompts
        pixels = self.pixel_values[prompt_rows].reshape(-1, self.pixel_values.shape[-1])
        grid = torch.tensor([[1, self.grid_side, self.grid_side]] * len(prompt_rows))
        return {"pixel_values": pixels.to(self.device, self.compute_dtype),
                "image_grid_thw": grid.to(self.device)}
