"""The step-time model the GPU landscapes search (autotune/estimates/throughput.py: its
formulas, its fit to EasyR1's published baselines and what it guesses): prints its constants
and each published row against it.

    python benchmarks/gpu_time_model.py
"""

from __future__ import annotations

from autotune.estimates.throughput import TimeModel

if __name__ == "__main__":
    print(TimeModel.calibrated().describe())
