"""Shared fixtures: small real probe requests on the tiny registry models (CPU)."""

from __future__ import annotations

import pytest

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.result import ProbeRequest

# Real servers on loopback: PostgreSQL for the shared-study tests (tests/postgres_server.py),
# a Ray cluster for the Ray runner and multi-node tests (tests/ray_cluster.py), a headless
# Chromium for the report tests (tests/browser.py).
pytest_plugins = ["postgres_server", "ray_cluster", "browser", "vllm_env"]

# A fast, valid GRPO step on the tiny text model: 8 responses of 64 + 32 tokens.
SMALL_CONFIG = ProbeConfig(rollout_batch_size=4, rollout_n=2, global_batch_size=2,
                           micro_batch_size_update=2, micro_batch_size_experience=4,
                           max_prompt_length=64, max_response_length=32, image_size_px=56)


def small_request(model: str = "tiny-qwen2.5", gpu_memory_limit_bytes: int | None = None,
                  **overrides: object) -> ProbeRequest:
    """A small CPU probe; `gpu_memory_limit_bytes` caps its device (--gpu-memory-limit)."""
    config_changes = {k: overrides.pop(k) for k in list(overrides)
                      if k in ProbeConfig.__dataclass_fields__}
    config = ProbeConfig(**{**SMALL_CONFIG.as_dict(), **config_changes})
    fields = {"model": model, "config": config, "device": Device("cpu", None,
                                                                 gpu_memory_limit_bytes),
              "cpu_threads": 2, "warmup_steps": 0, "timed_steps": 1, "timeout_s": 300.0,
              **overrides}
    return ProbeRequest(**fields)  # type: ignore[arg-type]


@pytest.fixture
def make_request():
    return small_request
