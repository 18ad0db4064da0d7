"""estimate: what `autotune estimate` answers, as a library call: the run planned as a probe
would run it (planning.py), the memory model's verdict on it, per phase and for the node's host
(answer.py), with a study's calibration where one is given.

May import batching, config, errors, files, hardware, registry, probe (the trace, inside a
function: `--trace` runs it in this process), memory and sweep (the pre-screen's model arguments,
a study's calibration); never the CLI.
"""
