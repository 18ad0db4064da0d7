"""A loaded machine for the tests that must hold on one: a user's machine is rarely quiet.

`busy_processes()`, around a block: one spinning process per core, each with a bounded life
(it ends by itself even if the test that started it dies), killed and reaped after it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

BUSY_S = 300.0  # a competing process's longest life


@contextlib.contextmanager
def busy_processes(life_s: float = BUSY_S) -> Iterator[list[subprocess.Popen]]:
    """One spinning process per core for the block (or `life_s`, whichever ends first)."""
    spin = f"import time\nend = time.time() + {life_s}\nwhile time.time() < end: pass"
    busy = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        yield busy
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
