"""config: a run's knobs and everything that reads them as text or checks them.

Owns the knob schema and the rules that are properties of one config (schema.py: ProbeConfig,
Topology, a GPU's share of the batches), the rules every config must pass (rules.py), knob
values from `--set` and files (parsing.py), units people type and read and the headroom budget
(units.py), the kernel tiling constants the probe and the memory model share
(kernels.py), and a step's seconds from its phases' by where the engine runs (pipeline.py,
imported as autotune.config.pipeline). Re-exports the names the rest of autotune uses.
May import batching, errors and files; never torch.
"""

from __future__ import annotations

from autotune.config.kernels import (
    ENTROPY_CHUNK_ROWS,
    FUSED_CHUNK_TOKENS,
    IMAGE_FRAME_TOKENS,
    IMAGE_TOKEN_PX,
    TRITON_DLOGITS_COLUMNS,
    TRITON_VOCAB_SPLIT,
    TRL_TOKEN_TILE,
    TRL_VOCAB_CHUNK,
)
from autotune.config.parsing import (
    describe_params,
    engine_choices,
    load_knob_file,
    parse_assignments,
    parse_knob_value,
    parse_share,
    unknown_key_message,
)
from autotune.config.rules import (
    algorithm_defaults,
    critic_problems,
    device_problems,
    engine_problems,
    make_probe_config,
    model_problems,
    old_pass_problem,
    sequence_parallel_problems,
    torch_adamw_problem,
    validate_probe_config,
)
from autotune.config.schema import (
    ALGORITHMS,
    ALL_LINEAR,
    COEFFICIENT_KNOBS,
    CRITIC_KNOBS,
    DECODER_LINEARS,
    DTYPE_BYTES,
    DTYPE_CHOICES,
    ENGINE_PHASES,
    KNOB_NAMES,
    LORA_KNOBS,
    MAX_KNOB_VALUE,
    MEMORY_DIRECTION,
    PHASES,
    SYNC_PHASE,
    VLLM_ENGINES,
    DeviceShare,
    Knobs,
    KnobValue,
    ProbeConfig,
    Topology,
    autocast_casts_weights,
    compute_bytes,
    compute_dtype,
    describe_engine,
    device_share,
    engine_reserves,
    image_tokens,
    old_pass_runs,
    trains_critic,
)
from autotune.config.units import (
    DEFAULT_HEADROOM,
    MAX_BYTES,
    budget_bytes,
    format_bytes,
    parse_bytes,
    parse_duration_s,
    parse_headroom,
)

__all__ = [
    "ALL_LINEAR", "ALGORITHMS", "COEFFICIENT_KNOBS", "CRITIC_KNOBS", "DECODER_LINEARS",
    "LORA_KNOBS",
    "DEFAULT_HEADROOM", "DTYPE_BYTES",
    "DTYPE_CHOICES", "ENTROPY_CHUNK_ROWS", "FUSED_CHUNK_TOKENS", "IMAGE_FRAME_TOKENS",
    "IMAGE_TOKEN_PX", "KNOB_NAMES", "MAX_BYTES", "MAX_KNOB_VALUE", "MEMORY_DIRECTION", "PHASES",
    "SYNC_PHASE", "ENGINE_PHASES",
    "TRITON_DLOGITS_COLUMNS", "TRITON_VOCAB_SPLIT", "TRL_TOKEN_TILE", "TRL_VOCAB_CHUNK",
    "VLLM_ENGINES", "DeviceShare", "KnobValue", "Knobs", "ProbeConfig", "Topology",
    "algorithm_defaults", "autocast_casts_weights",
    "budget_bytes", "compute_bytes", "compute_dtype", "critic_problems", "describe_engine",
    "describe_params", "device_problems", "device_share", "engine_choices", "engine_problems",
    "format_bytes", "image_tokens", "load_knob_file", "make_probe_config", "model_problems",
    "old_pass_problem", "sequence_parallel_problems", "old_pass_runs", "parse_assignments",
    "parse_bytes",
    "parse_duration_s", "parse_headroom", "parse_knob_value", "parse_share",
    "torch_adamw_problem", "trains_critic", "engine_reserves", "unknown_key_message",
    "validate_probe_config",
]
