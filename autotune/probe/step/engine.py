"""The probe's rollout engine: a compute-dtype copy of the actor that wakes, generates, sleeps.

Two memory behaviours, as the trainers have them (`rollout_engine`):

- `hf` (TRL's generate): Hugging Face generation's memory, `max_num_seqs` sequences at a
  time; the KV cache grows by concatenation each step and is freed after the batch.
- `vllm-like` (EasyR1 and verl, which generate with vLLM): at engine start it checks that
  `gpu_memory_utilization` x the device is free (vLLM's start-up check), loads its weights,
  runs a profile forward of one prefill chunk (at most `max_num_batched_tokens` tokens) and
  a sampler of `max_num_seqs` rows, and sizes its KV-cache pool as vLLM does: the reservation
  less the weights and the profiled peak, in 16-token blocks. Each wake-up allocates that pool
  as real tensors; generation runs as many sequences at once as the pool holds (at most
  `max_num_seqs`) with a fixed-length decode loop it owns over static caches that are views
  of the pool, prefill chunked by `max_num_batched_tokens`. With `enable_sleep` the pool and
  weights are freed after each generation (sleep level 1 keeps the weights in host memory,
  level 2 discards them); without, they stay on the device through the other phases.

`policy` (TRL without vLLM, verl's HF rollout): the trained model generates itself
(`PolicyRollout`), HF generation's memory as `hf` but no copy of the weights: nothing to wake,
load or free.

Failures use vLLM's own words, so oom.py classifies them `cache_oom` as it does vLLM's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias

import torch

from autotune.config import ProbeConfig
from autotune.errors import ConfigError
from autotune.hardware import Device
from autotune.probe.measure.meter import Meter
from autotune.probe.measure.unit_loops import DECODE_SAMPLE, decode_blocks
from autotune.probe.modeling.sharding import (
    engine_part,
    fill_storage,
    free_storage,
    local_bytes,
    local_tensor,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.cache_utils import DynamicCache, StaticCache

BLOCK_TOKENS = 16  # vLLM's default KV block
WAVE_SAMPLE = 2  # a short probe's waves: the first, a middle one (and the last full, the last)

# a model's forward inputs beside the token ids (a VL model's image) for some prompt rows,
# and `rows` prompts' whole inputs for the engine's profile run
InputsFor: TypeAlias = "Callable[[torch.Tensor], dict[str, torch.Tensor]]"
ProfileInputs: TypeAlias = "Callable[[int], dict[str, torch.Tensor]]"


class KvCacheError(RuntimeError):
    """The engine cannot start: its words are vLLM's (oom.py reads them as cache_oom)."""


def engine_capacity_bytes(config: ProbeConfig, device: Device) -> int | None:
    """The memory whose gpu_memory_utilization a vLLM engine reserves: what the probe may use
    of its device (its cap, else the device); on a CPU only under a cap. None where nothing
    reserves a share: hf, or a KV pool of kv_cache_memory_bytes (vLLM then ignores the
    utilisation)."""
    if not config.engine_reserves:
        return None
    if config.kv_cache_memory_bytes is not None:
        return device.usable_bytes
    if not device.on_gpu and device.cap_bytes is None:
        raise ConfigError(f"rollout_engine={config.rollout_engine} on the CPU reserves a share "
                          "of the device cap: add --gpu-memory-limit (e.g. 1GiB), set "
                          "kv_cache_memory_bytes, or use --engine hf")
    if device.usable_bytes is None:
        raise ConfigError(f"rollout_engine={config.rollout_engine} needs the device's memory, "
                          "which is not known yet; probe first, or give --gpu-memory-limit")
    return device.usable_bytes


class Rollout(Protocol):
    """A probe's rollout engine: the stand-in here (hf, vllm-like) or the real vLLM
    (vllm_engine.py). `figures` says what a vLLM engine reserved (the result's `engine`)."""

    figures: dict[str, int]

    def start(self, profile_inputs: ProfileInputs) -> None: ...
    def weight_names(self) -> list[str]: ...
    def part(self, name: str, whole: torch.Tensor) -> torch.Tensor: ...
    def held_weight_bytes(self) -> int: ...
    def wake(self, actor_weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...
    def sleep(self) -> None: ...
    def generate(self, prompt_ids: torch.Tensor, inputs_for: InputsFor,
                 rows: torch.Tensor) -> torch.Tensor: ...


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


class RolloutEngine:
    """The rollout engine of one rank; `figures` says what the vllm-like engine reserved."""

    def __init__(self, model: torch.nn.Module, model_config: PretrainedConfig,
                 config: ProbeConfig, device: torch.device, dtype: torch.dtype,
                 tensor_parallel: bool, capacity_bytes: int | None,
                 move: Callable[[torch.Tensor, bool], torch.Tensor], meter: Meter) -> None:
        self.model, self.model_config, self.config = model, model_config, config
        self.device, self.dtype, self.tensor_parallel = device, dtype, tensor_parallel
        self.vllm_like = config.engine_reserves  # else hf (the real vLLM: vllm_engine.py)
        self.capacity_bytes = capacity_bytes
        self.move, self.meter = move, meter  # the meter reads the device and profiles
        text = getattr(model_config, "text_config", model_config)
        self.layers = int(text.num_hidden_layers)
        self.head_dim = int(getattr(text, "head_dim", None)
                            or text.hidden_size // text.num_attention_heads)
        self.kv_heads = int(text.num_key_value_heads) // config.rollout_tensor_parallel
        self.vocab_size = int(text.vocab_size)
        self.element_bytes = torch.empty(0, dtype=dtype).element_size()
        self.kv_bytes_per_token = (2 * self.element_bytes * self.layers * self.kv_heads
                                   * self.head_dim)
        self.params = dict(model.named_parameters())  # the same objects, whatever they hold
        self.shapes = {name: p.shape for name, p in self.params.items()}
        self.host_weights: dict[str, torch.Tensor] = {}
        self.pool: torch.Tensor | None = None
        self.awake = True  # built with its weights; `start` or `sleep` puts it to sleep
        self.figures: dict[str, int] = {}

    # -- start, wake, sleep ---------------------------------------------------------------

    def start(self, profile_inputs: ProfileInputs) -> None:
        """Engine start: vLLM's free-memory check, the profile run and the pool's size
        (vllm-like); then it sleeps, as verl and EasyR1 put it to sleep once built."""
        if self.vllm_like:
            self._size_pool(profile_inputs)
        self._free_weights(keep_on_host=False)
        self.awake = False

    def _size_pool(self, profile_inputs: ProfileInputs) -> None:
        config, capacity = self.config, self.capacity_bytes
        util, kv_bytes = config.gpu_memory_utilization, config.kv_cache_memory_bytes
        weights = local_bytes(self.model.parameters())
        self.meter.release_cache()  # vLLM empties torch's cache before it looks
        used = self.meter.read_device_bytes() - weights  # the trainer's states and the context
        reserved = int(util * capacity) if kv_bytes is None and capacity is not None else 0
        if capacity is not None and capacity - used < reserved:
            raise KvCacheError(
                f"Free memory on device ({_gib(capacity - used)}/{_gib(capacity)}) on startup "
                f"is less than desired GPU memory utilization ({util}, {_gib(reserved)}). "
                "Decrease GPU memory utilization or reduce GPU memory used by other processes.")
        rows = self.prefill_rows()

        def profile() -> None:  # vLLM's profile_run: a prefill chunk, then its sampler
            with torch.no_grad():
                inputs = profile_inputs(rows)
                self.model(**inputs, use_cache=False, logits_to_keep=1)
                del inputs
                torch.empty(config.max_num_seqs, self.vocab_size, dtype=torch.float32,
                            device=self.device).zero_()

        if self.meter.runs(0, 2):  # a warm-up run first: one-time allocations (thread pools,
            profile()  # workspaces) are not the profile's (a trace has none and skips it)
        activation = self.meter.measure_peak_bytes(profile)
        sequence = config.sequence_length
        if kv_bytes is not None:  # vLLM's kv_cache_memory_bytes: the pool, whatever is free
            reserved = weights + activation + kv_bytes
        blocks = (reserved - weights - activation) // (BLOCK_TOKENS * self.kv_bytes_per_token)
        if blocks <= 0:
            raise KvCacheError("No available memory for the cache blocks. Try increasing "
                               "`gpu_memory_utilization` when initializing the engine.")
        pool_tokens = blocks * BLOCK_TOKENS
        per_sequence = -(-sequence // BLOCK_TOKENS) * BLOCK_TOKENS
        if pool_tokens < per_sequence:
            raise KvCacheError(
                f"To serve at least one request with the models's max seq len ({sequence}), "
                f"({_gib(per_sequence * self.kv_bytes_per_token)} KV cache is needed, which "
                "is larger than the available KV cache memory "
                f"({_gib(pool_tokens * self.kv_bytes_per_token)}). Based on the available "
                f"memory, the estimated maximum model length is {pool_tokens}. Try "
                "increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
                "initializing the engine.")
        self.figures = {
            "capacity_bytes": capacity or 0, "reserved_bytes": reserved, "weight_bytes": weights,
            "profile_bytes": activation, "kv_pool_bytes": pool_tokens * self.kv_bytes_per_token,
            "kv_pool_tokens": pool_tokens, "start_used_bytes": used,
            "concurrency": min(config.max_num_seqs, pool_tokens // per_sequence)}

    def prefill_rows(self) -> int:
        """Prompts per prefill forward: as many as `max_num_batched_tokens` holds."""
        per_chunk = self.config.max_num_batched_tokens // self.config.max_prompt_length
        return max(1, min(self.config.max_num_seqs, per_chunk))

    def weight_names(self) -> list[str]:
        """The engine's weights by name, the order they are loaded in."""
        return list(self.shapes)

    def part(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a gathered actor tensor (all of it without tensor parallel)."""
        if not self.tensor_parallel:
            return whole
        return engine_part(whole, self.params[name])

    def held_weight_bytes(self) -> int:
        """The engine's weights held on the device now (this rank's shards)."""
        return local_bytes(self.model.parameters())

    def wake(self, actor_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Allocate the weights (back from host memory after a level-1 sleep) and the pool,
        then load the actor's current weights, one whole tensor at a time."""
        if self.vllm_like:  # what the engine wakes on top of: the trainer's states now
            held = local_bytes(self.model.parameters()) + (
                self.figures["kv_pool_bytes"] if self.pool is not None else 0)
            self.figures["wake_used_bytes"] = self.meter.read_device_bytes() - held
        if not self.awake:
            for name, param in self.model.named_parameters():
                host = self.host_weights.pop(name, None)
                if self.tensor_parallel and host is not None:
                    fill_storage(param, self.move(host, True))
                elif self.tensor_parallel:
                    local = local_tensor(param)
                    local.untyped_storage().resize_(local.numel() * local.element_size())
                else:
                    param.data = self.move(host, True) if host is not None else torch.empty(
                        self.shapes[name], dtype=self.dtype, device=self.device)
            if self.vllm_like:
                self.pool = torch.zeros(self.figures["kv_pool_bytes"] // self.element_bytes,
                                        dtype=self.dtype, device=self.device)
            self.awake = True
        params = dict(self.model.named_parameters())
        for name, whole in actor_weights:
            param = params[name]
            if self.tensor_parallel:
                local_tensor(param).copy_(whole)
            else:
                param.data.copy_(whole)

    def sleep(self) -> None:
        """After generation: vllm-like with enable_sleep frees the pool and the weights (level
        1: weights to host memory); without sleep both stay. hf always frees its weights."""
        if self.vllm_like and not self.config.enable_sleep:
            return
        self.pool = None
        self._free_weights(keep_on_host=self.vllm_like and self.config.sleep_level == 1)
        self.awake = False

    def _free_weights(self, keep_on_host: bool) -> None:
        for name, param in self.model.named_parameters():
            if keep_on_host:
                self.host_weights[name] = self.move(local_tensor(param).data, False)
            if self.tensor_parallel:  # shards keep their shapes, not their memory
                free_storage(param)
            else:
                param.data = torch.empty(0, dtype=self.dtype, device=self.device)

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompt_ids: torch.Tensor, inputs_for: InputsFor,
                 rows: torch.Tensor) -> torch.Tensor:
        """Exactly max_response_length tokens for each prompt row, greedy, on the CPU: HF
        generation's memory (`max_num_seqs` rows at a time) or the pool's (vllm-like)."""
        size = self.figures["concurrency"] if self.vllm_like else self.config.max_num_seqs
        run = self._generate_batch if self.vllm_like else self._generate_growing
        batches = rows.split(size)
        last_full = len(batches) - 1 - (len(batches[-1]) < size)  # runs too: the pool's peak

        def skipped(batch: torch.Tensor) -> torch.Tensor:  # a skipped wave's: the same bytes
            return torch.zeros(len(batch), self.config.max_response_length, dtype=torch.long)

        parts: list[torch.Tensor] = []
        for i in self.meter.iterations("wave", [len(batch) for batch in batches],
                                       also=(last_full,), sample=WAVE_SAMPLE):
            parts += [skipped(batch) for batch in batches[len(parts):i]]
            parts.append(run(prompt_ids, inputs_for, batches[i]))
        return torch.cat(parts + [skipped(batch) for batch in batches[len(parts):]])

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token as HF generation picks it without sampling: an fp32 copy of the last
        position's scores, the min-length processor's copy with EOS masked, the argmax."""
        scores = logits[:, -1].to(torch.float32, copy=True)
        scores = scores.clone()
        scores[:, self.vocab_size - 1] = float("-inf")  # EOS, never picked: fixed length
        return scores.argmax(-1)

    def _generate_growing(self, prompt_ids: torch.Tensor, inputs_for: InputsFor,
                          batch: torch.Tensor) -> torch.Tensor:
        """HF generation's memory with a loop of the engine's own (no stopping checks, which
        fake tensors could not follow): a DynamicCache that grows by concatenation each step,
        freed with the batch. Where steps are skipped (a trace's, a short probe's blocks:
        `_decode`) the cache grows to the next step's length before it runs, so the last step
        holds what it holds in a whole wave (the batch's peak)."""
        from transformers.cache_utils import DynamicCache

        length = self.config.max_response_length
        ids = prompt_ids[batch].to(self.device)
        cache = DynamicCache(config=self.model_config)
        token = self._greedy(self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                                        logits_to_keep=1, **inputs_for(batch)).logits)

        def forward(token: torch.Tensor, step: int) -> torch.Tensor:
            if cache.get_seq_length() < ids.shape[1] + step:  # steps skipped: their growth,
                with self.meter.clock.untimed():  # untimed (and no synchronize a step)
                    self._grow(cache, ids.shape[1] + step)
            return self._greedy(self.model(input_ids=token[:, None], past_key_values=cache,
                                           use_cache=True, logits_to_keep=1).logits)

        tokens = self._decode(token, length - 1, forward)
        return torch.stack(tokens, dim=1).cpu()

    def _decode(self, token: torch.Tensor, steps: int,
                forward: Callable[[torch.Tensor, int], torch.Tensor]) -> list[torch.Tensor]:
        """The wave's first token and its `steps` decode steps' (`forward(token, step)`, the
        next), in blocks (`decode_blocks`: a short probe's timed units, its clock estimating
        the blocks it skips); a block or a step skipped (`meter.runs`: a trace's, a short
        warm-up's middle steps) leaves a token of zeros, the same bytes."""
        sizes = decode_blocks(steps)
        starts = list(itertools.accumulate([0, *sizes[:-1]]))
        tokens = [token]
        for block in self.meter.iterations("decode", sizes, also=(len(sizes) - 1,),
                                           sample=DECODE_SAMPLE, tail=DECODE_SAMPLE,
                                           middle=False):
            tokens += [torch.zeros_like(token) for _ in range(starts[block] + 1 - len(tokens))]
            for step in range(starts[block], starts[block] + sizes[block]):
                token = forward(token, step) if self.meter.runs(step, steps) else \
                    torch.zeros_like(token)
                tokens.append(token)
        return tokens + [torch.zeros_like(token) for _ in range(steps + 1 - len(tokens))]

    def _grow(self, cache: DynamicCache, tokens: int) -> None:
        """Where the cache holds fewer than `tokens` positions (the steps that grow it were
        skipped), every layer's K and V at `tokens` positions: new tensors of the bytes those
        steps would have left, zeros where kernels run (written, as those steps write it, and
        no stale bits for the next step to compute on), unfilled in a trace."""
        from transformers.cache_utils import DynamicLayer

        first = cache.layers[0]
        assert isinstance(first, DynamicLayer) and first.keys is not None  # the prefill's
        if first.keys.shape[2] >= tokens:
            return
        for layer in cache.layers:
            assert isinstance(layer, DynamicLayer) and layer.keys is not None  # the prefill's
            shape = (*layer.keys.shape[:2], tokens, layer.keys.shape[3])
            make = torch.zeros if self.meter.runs_kernels else torch.empty
            layer.keys = make(shape, dtype=layer.keys.dtype, device=self.device)
            layer.values = make(shape, dtype=layer.keys.dtype, device=self.device)

    def _generate_batch(self, prompt_ids: torch.Tensor, inputs_for: InputsFor,
                        batch: torch.Tensor) -> torch.Tensor:
        """One batch of sequences in the pool: chunked prefill, then a fixed-length decode."""
        assert self.pool is not None
        prompt, response = self.config.max_prompt_length, self.config.max_response_length
        views = self._views(len(batch), prompt + response)
        ids = prompt_ids[batch].to(self.device)
        token = torch.empty(len(batch), dtype=torch.long, device=self.device)
        step = self.prefill_rows()
        starts = range(0, len(batch), step)
        for number, start in enumerate(starts):
            part = slice(start, start + step)
            if not self.meter.runs(number, len(starts)):  # a trace: each chunk fills views
                token[part] = 0  # of the pool and frees the rest, the same bytes
                continue
            cache = self._static_cache([(k[part], v[part]) for k, v in views], filled=0)
            logits = self.model(input_ids=ids[part], past_key_values=cache, use_cache=True,
                                logits_to_keep=1, **inputs_for(batch[part])).logits
            token[part] = logits[:, -1].argmax(-1)
            del logits, cache
        cache = self._static_cache(views, filled=prompt)

        def forward(token: torch.Tensor, step: int) -> torch.Tensor:
            logits = self.model(input_ids=token[:, None], past_key_values=cache,
                                use_cache=True, logits_to_keep=1).logits
            return logits[:, -1].argmax(-1)

        tokens = self._decode(token, response - 1, forward)
        return torch.stack(tokens, dim=1).cpu()

    def _views(self, rows: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's K and V for `rows` sequences of `length` tokens, views of the pool."""
        assert self.pool is not None
        shape = (rows, self.kv_heads, length, self.head_dim)
        size = rows * self.kv_heads * length * self.head_dim
        flat = self.pool[:2 * self.layers * size]
        return [(flat[2 * i * size:(2 * i + 1) * size].view(shape),
                 flat[(2 * i + 1) * size:(2 * i + 2) * size].view(shape))
                for i in range(self.layers)]

    def _static_cache(self, views: list[tuple[torch.Tensor, torch.Tensor]],
                      filled: int) -> StaticCache:
        """transformers' StaticCache over `views` (no memory of its own), `filled` tokens in."""
        from transformers.cache_utils import StaticCache, StaticLayer

        rows, heads, length, head_dim = views[0][0].shape
        cache = StaticCache(config=self.model_config, max_cache_len=length)
        cache.early_initialization(rows, heads, head_dim, self.dtype, torch.device("meta"))
        for layer, (keys, values) in zip(cache.layers, views, strict=True):
            assert isinstance(layer, StaticLayer)  # a full-attention model's
            layer.keys, layer.values, layer.device = keys, values, keys.device
            layer.cumulative_length = torch.tensor(filled, device=keys.device)
        return cache


class PolicyRollout(RolloutEngine):
    """The trained model generating itself (TRL's `unwrap_model_for_generation` + `generate`
    without vLLM): HF generation's growing KV cache, no weights of its own to hold, load or
    free; the step runs it under the actor's autocast."""

    def start(self, profile_inputs: ProfileInputs) -> None:
        self.awake = False

    def weight_names(self) -> list[str]:
        return []  # nothing to load: the weights are the actor's

    def held_weight_bytes(self) -> int:
        return 0

    def wake(self, actor_weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.awake = True

    def sleep(self) -> None:
        self.awake = False
