"""cli: the `autotune` command. Click commands only: parse options, call the library, print.

Owns the commands (main.py: the group, models, probe, show, validate; run.py; estimate.py;
export.py; report.py), the options the probing commands share (options.py) and the text people
read (text.py). main() is the only place that turns an AutotuneError into one line and an
exit code. May import every other package; torch, transformers and ray only inside a command,
never at import time, so `autotune --help` is instant.
"""

from __future__ import annotations

from autotune.cli.main import main

__all__ = ["main"]
