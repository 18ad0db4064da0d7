"""Where a study lives: Optuna's SQLite storage under results/<study>/, and its driver lock.

SQLite in write-ahead-log mode is the default record of a study; one driver runs a study at a
time, enforced by a lock file the kernel releases when the driver dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from autotune.errors import AutotuneError


def use_wal(db_path: Path) -> None:
    """Put a SQLite study in write-ahead-log mode (stored in the file): one fsync per commit
    instead of several, still crash-safe, and readers such as optuna-dashboard never block."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(db_path)) as connection:
        connection.execute("PRAGMA journal_mode=WAL")


class StudyLock:
    """One driver per study directory: a lock file the kernel releases when the driver dies."""

    def __init__(self, study_dir: Path) -> None:
        self.path = study_dir / ".driver.lock"

    def __enter__(self) -> StudyLock:
        self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            owner = self.handle.read().strip() or "?"
            self.handle.close()
            raise AutotuneError(f"study {self.path.parent.name} is being run by another "
                                f"autotune (pid {owner}); wait for it or pick another --study") \
                from None
        self.handle.truncate(0)
        self.handle.write(str(os.getpid()))
        self.handle.flush()
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.close()
