"""Where a study lives: Optuna's storage, chosen by `--storage`, and the local driver lock.

SQLite in write-ahead-log mode under results/<study>/ is the default record of a study; one
driver runs it at a time, enforced by a lock file the kernel releases when the driver dies.
For a study that several drivers share (several machines, or a restart while another driver
runs) `--storage` names a database URL (PostgreSQL) or an Optuna journal file on a shared disk;
then Optuna's storage is the only arbiter between drivers (sharing.py), never a file of ours.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.errors import AutotuneError, ConfigError

URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class StudyStorage:
    """An opened Optuna storage and whether other drivers may share it."""

    storage: Any  # an optuna storage object, or a URL optuna opens itself
    shared: bool  # True: several drivers may run this study at once (heartbeats, no lock)
    where: str  # for messages: the file, or the URL without its password


def open_storage(spec: str | None, study_dir: Path) -> StudyStorage:
    """The storage `--storage SPEC` names: None is SQLite in study_dir; a URL with a scheme is
    a database (postgresql://...); anything else is the path of a journal file."""
    if spec is None:
        study_dir.mkdir(parents=True, exist_ok=True)
        db_path = study_dir / "study.db"
        use_wal(db_path)
        return StudyStorage(f"sqlite:///{db_path}", shared=False, where=str(db_path))
    import optuna

    if URL_SCHEME.match(spec):
        where = re.sub(r"://([^:/@]+):[^@/]*@", r"://\1:***@", spec)
        if spec.startswith("sqlite:"):
            raise ConfigError(f"--storage {where}: a SQLite file cannot be shared safely between "
                              "machines; leave --storage out for the local default, or give a "
                              "journal file path or a PostgreSQL URL")
        try:
            storage = open_database(spec)
        except ImportError as exc:
            raise ConfigError(f"--storage {where}: its database driver is not installed "
                              f"({exc}); for PostgreSQL: pip install 'autotune[postgres]'") \
                from None
        except Exception as exc:  # sqlalchemy's connection and URL errors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"--storage {where}: cannot open the database: {first}") from None
        return StudyStorage(storage, shared=True, where=where)
    path = Path(spec).expanduser()
    if path.is_dir():
        raise ConfigError(f"--storage {spec}: is a directory; give a journal file path such as "
                          f"{path / 'study.journal'}")
    if not path.parent.is_dir():
        raise ConfigError(f"--storage {spec}: folder {path.parent} does not exist; create it "
                          "on the shared disk first")
    from optuna.storages.journal import JournalFileBackend

    return StudyStorage(optuna.storages.JournalStorage(JournalFileBackend(str(path))),
                        shared=True, where=str(path))


def open_database(url: str, attempts: int = 5) -> Any:
    """Optuna's RDBStorage on `url`. Two drivers opening a fresh database at once race to
    create its tables (a duplicate-key or duplicate-table error for the loser): retry."""
    import random
    import time

    import optuna
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs={"pool_pre_ping": True})
        except (IntegrityError, ProgrammingError):
            if attempt == attempts - 1:
                raise
            time.sleep(random.uniform(0.2, 1.0))
    raise AssertionError("unreachable")


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


def open_study(settings: Any) -> tuple[Any, StudyStorage]:
    """Create or load the study of `settings` (a SweepSettings) in its storage; a study that
    exists must have been started with the same identity (what a probe measures)."""
    import optuna

    from autotune.sweep.objective import directions, objective_names

    space = settings.space
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opened = open_storage(settings.storage, settings.study_dir)  # a bad --storage: no dirs
    (settings.study_dir / "logs").mkdir(parents=True, exist_ok=True)
    if settings.sampler == "random":
        sampler = optuna.samplers.RandomSampler(seed=settings.seed)
    else:  # pending trials are RUNNING: the constant liar keeps parallel asks apart
        sampler = optuna.samplers.TPESampler(
            seed=settings.seed, n_startup_trials=settings.n_startup_trials,
            constant_liar=True)
    study = optuna.create_study(
        study_name=settings.study_name, storage=opened.storage, sampler=sampler,
        directions=directions(settings.objective), load_if_exists=True)
    identity = settings.identity()
    stored = study.user_attrs.get("identity")
    if stored is None:
        study.set_user_attr("identity", identity)
        study.set_user_attr("objective_names", objective_names(settings.objective))
        study.set_user_attr("search_space", {
            "source": space.source, "hash": space.space_hash,
            "params": {k: v.as_dict() for k, v in space.params.items()},
            "fixed": space.fixed})
        study.set_user_attr("request", json.loads(settings.request.to_json()))
        study.set_user_attr("autotune_version", __version__)
        study.set_user_attr("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    else:
        changed = [f"{k} was {stored.get(k)!r}, now {v!r}" for k, v in identity.items()
                   if stored.get(k) != v]
        if changed:
            raise ConfigError(
                f"study {settings.study_name} in {opened.where} was started with a "
                f"different setup ({'; '.join(changed)}); resume it with the original "
                "search space and options, or pick a new --study")
    return study, opened


def load_study(results_dir: str, name: str | None) -> Any:
    """Open a study from results/<name>/study.db (default: the most recently changed one)."""
    from pathlib import Path

    import optuna

    from autotune.errors import ConfigError

    root = Path(results_dir)
    if name is None:
        found = sorted(root.glob("*/study.db"), key=lambda p: p.stat().st_mtime)
        if not found:
            raise ConfigError(f"no study in {root}/: run `autotune run` first, or pass "
                              "--results-dir")
        name = found[-1].parent.name
    path = root / name / "study.db"
    if not path.exists():
        known = sorted(p.parent.name for p in root.glob("*/study.db"))
        raise ConfigError(f"--study {name}: no {path}; studies here: "
                          f"{', '.join(known) or 'none'}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=f"sqlite:///{path}")


