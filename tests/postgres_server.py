"""A real PostgreSQL server on loopback for the shared-study tests (pytest plugin).

Fixtures:

- ``postgres_server`` (session): starts a throwaway cluster in a temporary directory and
  stops it (``pg_ctl -m immediate stop``) and removes the directory at the end of the session;
  it fails if a server process outlived the stop (killed first).
- ``postgres_url`` (session): ``postgresql://postgres@127.0.0.1:PORT/autotune``.
- ``fresh_postgres_db`` (function): a new empty database per test, so tests never see each
  other's studies; dropped after the test.

The server binaries (``initdb``, ``pg_ctl``, ``postgres``) are taken from PATH or from
``/usr/lib/postgresql/*/bin`` (newest version first). Where they are missing and we are root
with apt-get (a fresh Debian CI machine), ``postgresql`` is installed with apt-get; if that
fails the test fails with apt's output. Without root or apt-get the tests are skipped.

PostgreSQL refuses to run as root: as root, initdb and pg_ctl run as the ``postgres`` system
user (created if missing) on a data directory that user owns. Authentication is ``trust`` and
the server listens on 127.0.0.1 only, on a free port, with its socket in the temporary
directory; fsync is off (the data is thrown away).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SERVER_PROGRAMS = ("initdb", "pg_ctl", "postgres")
PG_USER = "postgres"
APT_TIMEOUT_S = 900
START_TIMEOUT_S = 60


@dataclasses.dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    root: Path
    bin_dir: Path

    def url(self, database: str = "autotune") -> str:
        """The SQLAlchemy URL Optuna's RDBStorage takes."""
        return f"postgresql://{self.user}@{self.host}:{self.port}/{database}"  # what users type

    def connect(self, database: str = "postgres"):
        """An autocommit connection (CREATE/DROP DATABASE cannot run in a transaction)."""
        import psycopg

        return psycopg.connect(host=self.host, port=self.port, user=self.user, dbname=database,
                               connect_timeout=10, autocommit=True)

    def create_database(self, name: str) -> str:
        with contextlib.closing(self.connect()) as conn, conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        with contextlib.closing(self.connect()) as conn, conn.cursor() as cur:
            # Engines of the test process may still hold pooled connections to it.
            cur.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = %s AND pid <> pg_backend_pid()", (name,))
            cur.execute(f'DROP DATABASE IF EXISTS "{name}"')


# --- finding or installing the binaries -----------------------------------------------------


def _has_programs(directory: Path) -> bool:
    return all(os.access(directory / name, os.X_OK) for name in SERVER_PROGRAMS)


def _version_key(path: str) -> tuple[int, ...]:
    match = re.search(r"/postgresql/([\d.]+)/bin$", path)
    return tuple(int(p) for p in match.group(1).split(".") if p) if match else ()


def find_bin_dir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres, or None."""
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name)
        if found:
            # /usr/local/bin/initdb may be a symlink into /usr/lib/postgresql/N/bin.
            directory = Path(found).resolve().parent
            if _has_programs(directory):
                return directory
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key,
                            reverse=True):
        if _has_programs(Path(candidate)):
            return Path(candidate)
    return None


def apt_get(args: list[str], log: list[str]) -> bool:
    """Run apt-get non-interactively, appending what it printed to `log`; whether it worked."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "-o", "DPkg::Lock::Timeout=300", *args]
    log.append("$ " + " ".join(command))
    try:
        proc = subprocess.run(command, env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=APT_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        log.append(out if isinstance(out, str) else out.decode(errors="replace"))
        log.append(f"(timed out after {APT_TIMEOUT_S} s)")
        return False
    log.append(proc.stdout)
    log.append(f"(exit status {proc.returncode})")
    return proc.returncode == 0


def install_with_apt() -> tuple[bool, str]:
    """apt-get install postgresql (apt-get update first only if needed); (ok, output)."""
    log: list[str] = []
    # Keep the package's own cluster from starting (the Debian docker image ships this file;
    # a VM may not): we run our own throwaway server and leave nothing running.
    policy = Path("/usr/sbin/policy-rc.d")
    added_policy = False
    if not policy.exists():
        with contextlib.suppress(OSError):
            policy.write_text("#!/bin/sh\nexit 101\n")
            policy.chmod(0o755)
            added_policy = True
    try:
        install = ["install", "-y", "--no-install-recommends", "postgresql"]
        ok = apt_get(install, log) or (apt_get(["update"], log) and apt_get(install, log))
    finally:
        if added_policy:
            with contextlib.suppress(OSError):
                policy.unlink()
    return ok, "\n".join(log)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def require_bin_dir() -> Path:
    """The server binaries, installed if we can; skips or fails the test otherwise."""
    found = find_bin_dir()
    if found is not None:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("PostgreSQL server binaries (initdb, pg_ctl) not found, and cannot "
                    "apt-get install them (needs root and apt-get)")
    ok, output = install_with_apt()
    found = find_bin_dir()
    if found is None:
        pytest.fail("could not install PostgreSQL with apt-get "
                    f"({'installed, but no initdb/pg_ctl found' if ok else 'apt-get failed'}):"
                    f"\n{_tail(output)}", pytrace=False)
    return found


# --- running the server ---------------------------------------------------------------------


def _ensure_pg_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        pass
    proc = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                           "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", PG_USER],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        pytest.fail(f"useradd {PG_USER} failed: {proc.stderr.strip()}", pytrace=False)
    return pwd.getpwnam(PG_USER)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Runner:
    """Runs the server programs, as the postgres user when we are root."""

    def __init__(self, bin_dir: Path, root: Path, as_root: bool) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.prefix: list[str] = []
        if as_root:
            runuser = shutil.which("runuser")
            if runuser is None:
                pytest.fail("running as root but runuser (util-linux) is missing", pytrace=False)
            self.prefix = [runuser, "-u", PG_USER, "--"]
        # The caller's PG* variables (PGDATA, PGPORT, PGHOST...) must not steer our server.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        self.env.update(LC_ALL="C", LANG="C")

    def __call__(self, program: str, *args: str, timeout: float = 120) -> tuple[int, str]:
        command = [*self.prefix, str(self.bin_dir / program), *args]
        try:
            proc = subprocess.run(command, cwd=self.root, env=self.env, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or ""
            return 124, (out if isinstance(out, str) else out.decode(errors="replace"))
        return proc.returncode, proc.stdout


def _postmaster_pid(data_dir: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((data_dir / "postmaster.pid").read_text().splitlines()[0])
    return None


def _still_running(postmaster: int | None, timeout_s: float = 10.0) -> list[int]:
    """The postmaster and its server processes still alive `timeout_s` after its stop (killed
    before they are returned)."""
    import psutil

    if postmaster is None:
        return []
    with contextlib.suppress(psutil.Error):
        procs = [psutil.Process(postmaster)]
        procs += procs[0].children(recursive=True)
        alive = psutil.wait_procs(procs, timeout=timeout_s)[1]
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        return [proc.pid for proc in alive]
    return []


def _kill_postmaster(data_dir: Path) -> None:
    """Last resort if pg_ctl stop failed: kill the postmaster this fixture started."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int((data_dir / "postmaster.pid").read_text().splitlines()[0])
        os.kill(pid, signal.SIGQUIT)
        for _ in range(100):
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def run_postgres_server() -> Iterator[PostgresServer]:
    """Start a throwaway PostgreSQL server; stop it and remove its files on exit."""
    pytest.importorskip("psycopg", reason="psycopg (the postgres extra) is not installed")
    bin_dir = require_bin_dir()
    as_root = os.geteuid() == 0
    # Not pytest's tmp_path: as root that lives under a 0700 directory postgres cannot enter.
    root = Path(tempfile.mkdtemp(prefix="autotune-pg-", dir="/tmp" if as_root else None))
    data_dir = root / "data"
    log_file = root / "server.log"
    started = False
    try:
        if as_root:
            user = _ensure_pg_user()
            os.chown(root, user.pw_uid, user.pw_gid)
        run = _Runner(bin_dir, root, as_root)
        rc, out = run("initdb", "-D", str(data_dir), "-U", PG_USER, "-A", "trust",
                      "--no-locale", "-E", "UTF8", "--no-sync")
        if rc != 0:
            pytest.fail(f"initdb failed (exit status {rc}):\n{_tail(out)}", pytrace=False)
        conf = data_dir / "postgresql.conf"
        base_conf = conf.read_text()
        for attempt in range(3):
            port = _free_port()
            settings = {"listen_addresses": "'127.0.0.1'", "port": str(port),
                        "unix_socket_directories": f"'{root}'", "fsync": "off",
                        "synchronous_commit": "off", "full_page_writes": "off",
                        "max_connections": "100"}
            # Written by us (root), read by the server: keep the file readable by postgres.
            conf.write_text(base_conf + "\n# autotune tests\n"
                            + "".join(f"{k} = {v}\n" for k, v in settings.items()))
            rc, out = run("pg_ctl", "-D", str(data_dir), "-l", str(log_file), "-w",
                          "-t", str(START_TIMEOUT_S), "start", timeout=START_TIMEOUT_S + 30)
            if rc == 0:
                started = True
                break
            log = log_file.read_text(errors="replace") if log_file.exists() else ""
            run("pg_ctl", "-D", str(data_dir), "-m", "immediate", "-w", "stop", timeout=60)
            if "already in use" not in log or attempt == 2:
                pytest.fail(f"pg_ctl start failed (exit status {rc}):\n{_tail(out)}\n"
                            f"--- server log ---\n{_tail(log)}", pytrace=False)
        server = PostgresServer(host="127.0.0.1", port=port, user=PG_USER, root=root,
                                bin_dir=bin_dir)
        server.create_database("autotune")
        yield server
    finally:
        left: list[int] = []
        if started:
            postmaster = _postmaster_pid(data_dir)
            rc, _ = run("pg_ctl", "-D", str(data_dir), "-m", "immediate", "-w", "stop",
                        timeout=60)
            if rc != 0:
                _kill_postmaster(data_dir)
            left = _still_running(postmaster)
        shutil.rmtree(root, ignore_errors=True)
    assert not left, f"PostgreSQL processes outlived the server's stop: {left}"


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL server on 127.0.0.1, shared by the whole test session."""
    with run_postgres_server() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """SQLAlchemy URL of the session server's ``autotune`` database."""
    return postgres_server.url("autotune")


@pytest.fixture
def fresh_postgres_db(postgres_server: PostgresServer) -> Iterator[str]:
    """SQLAlchemy URL of a new, empty database for this test only."""
    name = f"test_{uuid.uuid4().hex}"
    url = postgres_server.create_database(name)
    yield url
    with contextlib.suppress(Exception):
        postgres_server.drop_database(name)
