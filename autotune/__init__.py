"""autotune: find the fastest memory-safe configuration for an RL fine-tuning run."""

from __future__ import annotations

__version__ = "0.1.0"
