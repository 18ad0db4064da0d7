"""estimates: what `autotune estimate` answers, as a library call: the run planned as a probe
would run it (planning.py), the memory model's verdict on it, per phase and for the node's host
(answer.py; tracing.py for `--trace`), with a study's calibration where one is given; and for a
colocated GPU run, what the best split would give (split.py), its step from the time model
fitted to EasyR1's published baselines (throughput.py, which the GPU landscapes' benchmarks
read too).

May import batching, config, errors, files, hardware, registry, probe (the trace, inside a
function: `--trace` runs it in this process), trainers (the split answer's trainer rules,
inside a function), memory and sweep (the pre-screen's model arguments,
a study's calibration); never the CLI.
"""

from autotune.estimates.answer import Estimate, estimate
from autotune.estimates.planning import EstimatePlan, plan_estimate
from autotune.estimates.tracing import TracedEstimate

__all__ = ["Estimate", "EstimatePlan", "TracedEstimate", "estimate", "plan_estimate"]
