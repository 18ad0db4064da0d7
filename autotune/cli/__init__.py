"""cli: the `autotune` command. Click commands only: parse options, call the library, print.

Owns the commands (main.py: the group, models, probe, show, validate, spaces; run.py;
estimate.py; export.py; report.py), every option, declared once (options.py), and the text
people read (text.py). A command parses its options into the library's typed options, calls
one library function (plan_probe, plan_sweep and run_sweep, plan_estimate, export_best) and
prints. main() is the only place that turns an AutotuneError into one line and an
exit code. May import every other package; torch, transformers and ray only inside a command,
never at import time, so `autotune --help` is instant.
"""

from __future__ import annotations

from autotune.cli.main import main

__all__ = ["main"]
