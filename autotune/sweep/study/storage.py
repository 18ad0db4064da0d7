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
from typing import TYPE_CHECKING

from autotune.errors import AutotuneError, ConfigError
from autotune.files import JsonObject
from autotune.hardware import host_memory_bytes
from autotune.sweep.study.settings import SweepSettings
from autotune.version import __version__

if TYPE_CHECKING:
    import sqlite3

    from optuna import Study
    from optuna.samplers import BaseSampler
    from optuna.storages import BaseStorage, RDBStorage

URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class StudyStorage:
    """An opened Optuna storage and whether other drivers may share it."""

    storage: BaseStorage  # an optuna storage: SQLite, a database, or a journal file
    shared: bool  # True: several drivers may run this study at once (heartbeats, no lock)
    where: str  # for messages: the file, or the URL without its password


MAX_STUDY_NAME = 100  # a folder name, and a row in Optuna's studies table


def check_study_name(name: str) -> str:
    """A study name is a folder name under results/: letters, digits, '.', '_', '-'."""
    if not name:
        raise ConfigError("--study '': give a name, or leave --study out for MODEL-SPACE")
    if len(name) > MAX_STUDY_NAME:
        raise ConfigError(f"--study {name[:20]}...: {len(name)} characters; use at most "
                          f"{MAX_STUDY_NAME}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(f"--study {name!r}: use letters, digits, '.', '_' and '-', starting "
                          "with a letter or digit")
    return name


def open_storage(spec: str | None, study_dir: Path) -> StudyStorage:
    """The storage `--storage SPEC` names: None is SQLite in study_dir; a URL with a scheme is
    a database (postgresql://...); anything else is the path of a journal file."""
    if spec is None:
        study_dir.mkdir(parents=True, exist_ok=True)
        db_path = study_dir / "study.db"
        check_study_file(db_path)
        use_wal(db_path)
        return StudyStorage(sqlite_storage(db_path), shared=False, where=str(db_path))
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
    check_journal_file(path, spec)
    from optuna.storages.journal import JournalFileBackend

    return StudyStorage(optuna.storages.JournalStorage(JournalFileBackend(str(path))),
                        shared=True, where=str(path))


SQLITE_HEADER = b"SQLite format 3\x00"


def check_study_file(path: Path) -> None:
    """A study.db that is there must be a SQLite database (an empty or foreign file would be
    taken as a new study, and written into); a missing one is a new study."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(SQLITE_HEADER))
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({(exc.strerror or '').lower()})") from None
    if not head:
        raise ConfigError(f"{path}: empty (0 bytes), not a study database; remove it and run "
                          "the sweep again")
    if head != SQLITE_HEADER:
        raise ConfigError(f"{path}: not a study database (not SQLite); it may be damaged: "
                          "keep a copy, and run the sweep again under another --study")


def check_storage(spec: str) -> None:
    """Refuse a bad --storage before anything is made: a database is connected to (and
    closed); a journal path is checked without creating the file."""
    if URL_SCHEME.match(spec):
        close_storage(open_storage(spec, Path(".")))
    else:
        check_journal_file(Path(spec).expanduser(), spec)


def check_journal_file(path: Path, spec: str) -> None:
    """A journal path must be a new file in an existing folder, or an Optuna journal: a text
    file, a device such as /dev/full or a binary file would hang or break Optuna's reader."""
    if path.is_dir():
        raise ConfigError(f"--storage {spec}: is a directory; give a journal file path such as "
                          f"{path / 'study.journal'}")
    if not path.parent.is_dir():
        raise ConfigError(f"--storage {spec}: folder {path.parent} does not exist; create it "
                          "on the shared disk first")
    if not path.exists():
        return
    if not path.is_file():
        raise ConfigError(f"--storage {spec}: not a regular file; give a journal file path "
                          "(a new one is created)")
    try:
        with open(path, "rb") as handle:
            first = handle.readline(1 << 20)
    except OSError as exc:
        raise ConfigError(f"--storage {spec}: cannot read ({(exc.strerror or '').lower()})") \
            from None
    if not first:
        return  # an empty file: Optuna starts the journal there
    try:
        record = json.loads(first)
    except ValueError:
        record = None
    if not isinstance(record, dict) or "op_code" not in record:
        raise ConfigError(f"--storage {spec}: not an Optuna journal (its first line is no "
                          "journal record); give a new file path, or the journal a study "
                          "already uses")


def open_database(url: str, attempts: int = 5) -> RDBStorage:
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


def disk_read_only(folder: Path) -> bool:
    """Whether `folder` is on a file system mounted read-only."""
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def read_only_study(db_path: Path) -> str:
    return (f"{db_path}: read-only here; a sweep records every trial in it: make it and its "
            f"folder writable, or copy the study to another --results-dir (`autotune show` "
            "reads it as it is)")


def foreign_tables(connection: sqlite3.Connection) -> list[str]:
    """Tables of a SQLite file that Optuna's storage does not make (its schema's tables and
    alembic's version table): another program's database, not a study."""
    from optuna.storages._rdb.models import BaseModel

    known = {*BaseModel.metadata.tables, "alembic_version"}
    names = [row[0] for row in connection.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table'")]
    return sorted(n for n in names if n not in known and not n.startswith("sqlite_"))


def sqlite_storage(db_path: Path) -> RDBStorage:
    """Optuna's storage on a local SQLite study, every connection in WAL mode with
    synchronous=NORMAL: a commit is in the log before it returns, so a killed driver (SIGKILL,
    OOM killer) loses nothing it told; only a power cut can lose the last commits, never
    corrupt the file, and no commit waits for an fsync of its own: the writes are most of
    the driver's time per trial."""
    import optuna
    from sqlalchemy import event

    storage = optuna.storages.RDBStorage(f"sqlite:///{db_path}")

    def durable_enough(connection: sqlite3.Connection, _record: object) -> None:
        connection.execute("PRAGMA synchronous=NORMAL")

    event.listen(storage.engine, "connect", durable_enough)
    storage.engine.dispose()  # the connections made from here on get the pragma
    return storage


def use_wal(db_path: Path) -> None:
    """Put a SQLite study in write-ahead-log mode (stored in the file): one fsync per commit
    instead of several, still crash-safe, and readers such as optuna-dashboard never block.
    A damaged study (truncated, overwritten in part) is refused first, by SQLite's own check
    of every page (milliseconds for a study of thousands of trials), and so are another
    program's database and a study this process cannot write: ConfigError."""
    import sqlite3

    read_only_disk = disk_read_only(db_path.parent)  # said as the environment's error
    # (exit 1), where the first write fails
    if not read_only_disk and (not os.access(db_path.parent, os.W_OK) or
                               (db_path.exists() and not os.access(db_path, os.W_OK))):
        raise ConfigError(read_only_study(db_path))
    try:
        with contextlib.closing(sqlite3.connect(db_path)) as connection:
            found = connection.execute("PRAGMA quick_check").fetchone()
            if found is not None and found[0] != "ok":
                raise ConfigError(damaged_study(db_path, str(found[0])))
            foreign = foreign_tables(connection)
            if foreign:
                raise ConfigError(
                    f"{db_path}: holds tables that are not an Optuna study's "
                    f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); a sweep "
                    "would write its own beside them: move that file away, or run under "
                    "another --study or --results-dir")
            connection.execute("PRAGMA journal_mode=WAL")
    except sqlite3.OperationalError as exc:  # the disk's, not the file's: full, locked, ...
        if "readonly" in str(exc) and not read_only_disk:  # ... or a file read-only where
            raise ConfigError(read_only_study(db_path)) from None  # permissions did not say
        raise
    except sqlite3.DatabaseError as exc:  # the file's: malformed, not a database
        raise ConfigError(damaged_study(db_path, str(exc))) from None


def damaged_study(path: Path, problem: str) -> str:
    """What to tell the user about a study.db SQLite cannot read: the line every command
    gives."""
    first = (problem.strip().splitlines() or ["unreadable"])[0]
    return (f"{path}: not a study database ({first}); it may be damaged: keep a copy, and run "
            "the sweep again under another --study")


def private_copy(db: Path, wal: Path) -> Path:
    """A copy of a database and its write-ahead log in a temporary folder removed at exit."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="autotune-read-"))
    atexit.register(shutil.rmtree, folder, True)
    shutil.copyfile(db, folder / db.name)
    shutil.copyfile(wal, folder / wal.name)
    return folder / db.name


def driver_running(study_dir: Path) -> bool:
    """Whether a driver holds the study's lock now (a read never takes it)."""
    try:
        handle = open(study_dir / ".driver.lock")
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


class StudyLock:
    """One driver per study directory, whatever the storage: a lock file the kernel releases
    when the driver dies (drivers that share a study in a journal or a database each write
    their logs, trials.csv and best.yaml in their own folder). The driver's pid is written
    only once the study opened (`claim`): a refused study keeps its lock file as it was, or
    none if it had none."""

    def __init__(self, study_dir: Path, shared: bool = False) -> None:
        self.path = study_dir / ".driver.lock"
        self.shared = shared  # the study is in a --storage several drivers share
        self.created = False
        self.claimed = False

    def __enter__(self) -> StudyLock:
        self.created = not self.path.exists()
        try:
            self.handle = open(self.path, "a+")
        except PermissionError:
            if disk_read_only(self.path.parent):
                raise  # the environment's error: said as such, exit 1
            raise ConfigError(read_only_study(self.path.parent / "study.db")) from None
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.handle.seek(0)
            owner = self.handle.read().strip() or "?"
            self.handle.close()
            advice = ("give each driver of a shared study its own --results-dir" if self.shared
                      else "wait for it or pick another --study")
            raise AutotuneError(f"study {self.path.parent.name} is being run by another "
                                f"autotune (pid {owner}) in {self.path.parent}; {advice}") \
                from None
        return self

    def claim(self) -> None:
        """Say which driver runs the study (another driver's refusal names it)."""
        self.handle.truncate(0)
        self.handle.write(str(os.getpid()))
        self.handle.flush()
        self.claimed = True

    def __exit__(self, *exc: object) -> None:
        self.handle.close()
        if self.created and not self.claimed:
            self.path.unlink(missing_ok=True)


def open_study(settings: SweepSettings) -> tuple[Study, StudyStorage]:
    """Create or load the study of `settings` (a SweepSettings) in its storage; a study that
    exists must have been started with the same identity (what a probe measures)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    opened = open_storage(settings.storage, settings.study_dir)  # a bad --storage: no dirs
    (settings.study_dir / "logs").mkdir(parents=True, exist_ok=True)
    study = load_or_create_study(settings, opened)
    identity = settings.identity()
    stored = study.user_attrs.get("identity")
    if stored is None:
        describe_new_study(study, settings, identity)
    else:
        check_identity(settings, opened, stored, identity)
    # the node the latest run was for (--host-memory, else this machine's): the best config's
    # host-memory verdict is stated for it; not part of the identity
    study.set_user_attr("node", {"host_bytes": settings.node_host_bytes or host_memory_bytes(),
                                 "given": settings.node_host_bytes is not None,
                                 "trainer": settings.node_trainer})
    return study, opened


def study_sampler(settings: SweepSettings) -> BaseSampler:
    """The seeded sampler --sampler names."""
    import optuna

    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    # pending trials are RUNNING: the constant liar keeps parallel asks apart
    return optuna.samplers.TPESampler(seed=settings.seed,
                                      n_startup_trials=settings.n_startup_trials,
                                      constant_liar=True)


def load_or_create_study(settings: SweepSettings, opened: StudyStorage) -> Study:
    """The study `settings` names in `opened`: loaded when it is there (written nothing yet,
    so a refused one stays as it was), else created. A study file of our own that holds
    another study was renamed: refused."""
    import optuna

    from autotune.sweep.study.objective import directions

    sampler = study_sampler(settings)
    names = optuna.get_all_study_names(opened.storage)
    if not opened.shared and names and settings.study_name not in names:
        raise ConfigError(f"{opened.where} holds study {', '.join(names)}, not "
                          f"{settings.study_name} (was its folder renamed?); rename the folder "
                          f"back, or pass --study {names[0]}")
    if settings.study_name in names:  # load, check, and write nothing if refused
        return optuna.load_study(study_name=settings.study_name, storage=opened.storage,
                                 sampler=sampler)
    return optuna.create_study(
        study_name=settings.study_name, storage=opened.storage, sampler=sampler,
        directions=directions(settings.objective), load_if_exists=True)


def describe_new_study(study: Study, settings: SweepSettings, identity: JsonObject) -> None:
    """Store what a new study is: its identity (what a resumed run must share), objectives,
    search space, probe request, the trainer command its probes run, and its version."""
    from autotune.sweep.study.objective import objective_names

    space = settings.space
    study.set_user_attr("identity", identity)
    study.set_user_attr("objective_names", objective_names(settings.objective))
    study.set_user_attr("search_space", {
        "source": space.source, "hash": space.space_hash,
        "params": {k: v.as_dict() for k, v in space.params.items()},
        "fixed": space.fixed})
    study.set_user_attr("request", json.loads(settings.request.to_json()))
    if settings.command is not None:  # a probe is a short run of the user's trainer
        study.set_user_attr("command", {"trainer": settings.command.adapter.name,
                                        "launch": settings.command.launch,
                                        "steps": settings.command.steps})
    study.set_user_attr("autotune_version", __version__)
    study.set_user_attr("created", time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def check_identity(settings: SweepSettings, opened: StudyStorage, stored: JsonObject,
                   identity: JsonObject) -> None:
    """ConfigError (the storage closed) when the study was started with another identity
    than `settings` have: every difference named."""
    # what studies made before topology was asked ran as
    older: JsonObject = {"nnodes": 1, "gpus_per_node": 1, "emulated": False, "probe": "builtin",
                         "full_steps": True}
    if stored.get("device") == "auto":  # made before the device was resolved at start:
        stored = {**stored, "device": identity["device"]}  # it ran on this machine's
    changed = [f"{k} was {stored.get(k, older.get(k))!r}, now {v!r}"
               for k, v in identity.items() if stored.get(k, older.get(k)) != v]
    if changed:
        close_storage(opened)  # SQLite's -wal and -shm go with the last connection
        raise ConfigError(
            f"study {settings.study_name} in {opened.where} was started with a "
            f"different setup ({'; '.join(changed)}); resume it with the original "
            "search space and options, or pick a new --study")


def close_storage(opened: StudyStorage) -> None:
    """Close a database storage's connections now, not when it is collected."""
    engine = getattr(opened.storage, "engine", None)
    if engine is not None:
        engine.dispose()


def load_study(results_dir: str, name: str | None, storage: str | None = None) -> Study:
    """Open a study to read it (show, export, estimate --study), writing nothing into it:
    results/<name>/study.db read-only (default: the most recently changed study there), or
    the study `name` in a shared `--storage` (default: its only study)."""
    import optuna

    if name is not None:
        check_study_name(name)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage is not None:
        if not URL_SCHEME.match(storage) and not Path(storage).expanduser().is_file():
            raise ConfigError(f"--storage {storage}: no such journal file")
        opened = open_storage(storage, Path(results_dir))
        where = opened.where
    else:
        root = Path(results_dir)
        if name is None:
            found = sorted(root.glob("*/study.db"), key=lambda p: p.stat().st_mtime)
            if not found:
                raise ConfigError(f"no study in {root}/: run `autotune run` first, or pass "
                                  "--results-dir")
            name = found[-1].parent.name
        path = root / name / "study.db"
        if not path.is_file():
            known = sorted(p.parent.name for p in root.glob("*/study.db"))
            raise ConfigError(f"--study {name}: no {path}; studies here: "
                              f"{', '.join(known) or 'none'}")
        check_study_file(path)
        opened, where = StudyStorage(read_only_sqlite(path), shared=False, where=str(path)), \
            str(path)
    names = optuna.get_all_study_names(opened.storage)
    if name is None and len(names) == 1:
        name = names[0]
    if name not in names:
        held = f"holds study {', '.join(names)}" if names else "holds no study"
        hint = " (was its folder renamed?); rename it back," if storage is None else ";"
        raise ConfigError(f"{where} {held}, not {name}{hint} or pass --study "
                          f"{names[0] if names else 'NAME'}")
    return optuna.load_study(study_name=name, storage=opened.storage)


def read_only_sqlite(path: Path) -> RDBStorage:
    """An RDBStorage on a SQLite study that never writes to any of its files.

    - No driver running and nothing in the write-ahead log: opened immutable (SQLite then
      makes no -wal or -shm file beside it).
    - A driver running: read-only through its log, as any reader of a live WAL database.
    - No driver, but a log left by one that was killed: the database and its log are read from
      a private copy (reading would otherwise replay the log in the study's own files).
    - A read-only file system (where SQLite cannot open a WAL database read-only, and nobody
      can be writing): immutable.
    """
    import optuna
    from sqlalchemy.exc import DatabaseError

    wal = path.with_name(path.name + "-wal")
    running = driver_running(path.parent)
    if not running and wal.exists() and wal.stat().st_size:
        path = private_copy(path, wal)
        tries: tuple[str, ...] = ("mode=rw",)
    elif running:
        tries = ("mode=ro", "mode=ro&immutable=1")
    else:
        tries = ("mode=ro&immutable=1",)
    last: Exception | None = None
    for flags in tries:
        try:
            return optuna.storages.RDBStorage(f"sqlite:///file:{path.resolve()}?{flags}&uri=true")
        except DatabaseError as exc:
            last = exc
    assert last is not None
    raise ConfigError(damaged_study(path, str(getattr(last, "orig", last)))) from None
