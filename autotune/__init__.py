"""autotune: find the fastest memory-safe configuration for an RL fine-tuning run.

The library face, for a notebook or a script (the CLI is a thin layer over the same calls):

    import autotune

    plan = autotune.plan_sweep(autotune.RunOptions(probe=autotune.ProbeOptions(
        model="tiny-qwen2.5", device="cpu"), space="cpu-demo", trials=4))
    outcome = autotune.run_sweep(plan)               # a SweepOutcome: the study, best.yaml
    answer = autotune.estimates(autotune.ProbeOptions(model="qwen2.5-7b", gpus_per_node=8))
    print(answer.text())                              # an Estimate: every figure, typed
    exported = autotune.export_study("verl", outcome.study.study_name)

Names load on first use (PEP 562), so `import autotune` and `autotune --help` import neither
torch nor Optuna.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from autotune.version import __version__

# name -> the module that defines it: the one table of the library face
_FACE = {
    "ProbeOptions": "autotune.sweep.plan", "RunOptions": "autotune.sweep.plan",
    "SweepPlan": "autotune.sweep.plan", "plan_sweep": "autotune.sweep.plan",
    "run_sweep": "autotune.sweep.driver", "SweepOutcome": "autotune.sweep.driver",
    "estimate": "autotune.estimates", "Estimate": "autotune.estimates",
    "export_study": "autotune.sweep.pick.best_export",
    "TrainerExport": "autotune.sweep.pick.best_export",
    "load_study": "autotune.sweep.study.storage",
    "ProbeConfig": "autotune.config", "Topology": "autotune.config",
    "ProbeRequest": "autotune.probe.measure.result",
    "ProbeResult": "autotune.probe.measure.result",
    "ProbeStatus": "autotune.probe.measure.result",
    "AutotuneError": "autotune.errors", "ConfigError": "autotune.errors",
}
__all__ = ["__version__", *_FACE]

if TYPE_CHECKING:  # the face's types for a type checker; at run time __getattr__ loads them
    from autotune.config import ProbeConfig, Topology  # noqa: F401
    from autotune.errors import AutotuneError, ConfigError  # noqa: F401
    from autotune.estimates import Estimate, estimate  # noqa: F401
    from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus  # noqa: F401
    from autotune.sweep.driver import SweepOutcome, run_sweep  # noqa: F401
    from autotune.sweep.pick.best_export import TrainerExport, export_study  # noqa: F401
    from autotune.sweep.plan import ProbeOptions, RunOptions, SweepPlan, plan_sweep  # noqa: F401
    from autotune.sweep.study.storage import load_study  # noqa: F401


def __getattr__(name: str) -> object:
    """Load a name of the face from its module on first use."""
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
