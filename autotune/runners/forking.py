"""CPU probes forked from a process that has imported torch once (probe/fork_server.py).

`forked_probe(...)` hands a built-in CPU probe to a fork server made for its environment, its
cores, its model and its scope, started on first use and kept for the next probe of the same
kind; None when the probe must start as a process of its own (the runner then starts it as
always). A ForkedProbe answers what the runner asks of a Popen: `pid`, `poll`, `wait`,
`returncode`. Servers are closed when idle at the end of a sweep (`close_idle_servers`) and
all of them when this process exits; a server whose driver is gone kills its children and
exits by itself. Torch-free: the driver never imports what the server does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from autotune.process_tag import PROBE_TAG_ENV

MAX_IDLE_SERVERS = 4  # idle servers kept (each holds torch and a model class: ~350 MB RSS)
SPAWN_REPLY_S = 30.0  # a ready server answers a fork in milliseconds; past this it is broken


class ForkedProbe:
    """A probe forked by a fork server: the part of Popen's interface the runner uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exited = threading.Event()
        self.server_died = False  # ended because its fork server did (killed with it)

    def finish(self, returncode: int) -> None:
        self.returncode = returncode
        self.exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"forked probe {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


class ForkServer:
    """One `python -m autotune.probe.fork_server` process and the probes it forked."""

    def __init__(self, env: dict[str, str], cpu_ids: tuple[int, ...] | None, model: str,
                 model_path: str | None) -> None:
        def pin() -> None:
            if cpu_ids:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(0, cpu_ids)

        self.proc = subprocess.Popen(  # no preexec_fn unless pinned: no Python runs mid-fork
            [sys.executable, "-m", "autotune.probe.fork_server", model, model_path or ""],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True, preexec_fn=pin if cpu_ids else None)
        self.state = threading.Condition()
        self.ready: bool | None = None  # None until the server says; False: it cannot serve
        self.error: str | None = None  # why it could not import what a probe needs
        self.forked: dict[int, ForkedProbe] = {}  # request id -> its probe, until spawn
        self.probes: dict[int, ForkedProbe] = {}  # pid -> its probe, until it exits
        self.users = 0  # threads between finding this server and forking their probe
        self.abandoned: set[int] = set()  # request ids whose caller was interrupted
        self.next_id = 0
        self.last_used = time.monotonic()
        self.reader = threading.Thread(target=self._read, args=(self.proc.stdout,),
                                       name="autotune-fork-server", daemon=True)
        self.reader.start()

    def _read(self, replies: IO[bytes]) -> None:
        try:
            for line in replies:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    with self.state:
                        self._take(message)
                        self.state.notify_all()
        finally:  # the server is gone (or speaks nonsense), and its children with it
            with self.state:
                self.ready = False
                for probe in self.probes.values():
                    kill_probe(probe.pid)
                    probe.server_died = True
                    probe.finish(-9)
                self.probes.clear()
                self.state.notify_all()

    def _take(self, message: dict[str, Any]) -> None:
        """One message of the server's (the caller holds the state lock)."""
        if "ready" in message:
            self.ready = True
        elif "id" in message:
            request_id = message["id"]
            if "pid" not in message:  # the fork failed: the caller starts a process
                self.abandoned.add(request_id)
            elif request_id in self.abandoned:  # nobody waits for it: it must never run
                self.abandoned.discard(request_id)
                kill_probe(message["pid"])
                self.probes[message["pid"]] = ForkedProbe(message["pid"])  # to be reaped
            else:
                probe = self.forked[request_id] = ForkedProbe(message["pid"])
                self.probes[probe.pid] = probe
        elif "error" in message:
            self.ready, self.error = False, str(message["error"])
        elif "exited" in message and message["exited"] in self.probes:
            self.probes.pop(message["exited"]).finish(message["returncode"])

    def wait_ready(self, timeout_s: float, stopping: threading.Event) -> bool:
        """Whether the server has its imports done (False: it failed, or it was not ready
        within `timeout_s`, or `stopping` was set while waiting)."""
        deadline = time.monotonic() + timeout_s
        with self.state:
            while self.ready is None and not stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.state.wait(min(left, 0.05))
            return bool(self.ready)

    @property
    def busy(self) -> bool:
        return bool(self.probes or self.users)

    def spawn(self, request_path: Path, result_path: Path, log_path: Path,
              tag: str) -> ForkedProbe | None:
        """Fork a probe of `request_path`, run in this process's working directory as a
        started worker would be; None when the server cannot (it is gone, or broken: then
        it is closed, and a probe it forks too late dies with it)."""
        with self.state:
            if not self.ready or self.proc.stdin is None:
                return None
            request_id, self.next_id = self.next_id, self.next_id + 1
            message = {"id": request_id, "request": str(request_path),
                       "result": str(result_path), "log": str(log_path), "tag": tag,
                       "cwd": os.getcwd()}
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
            except (OSError, ValueError):
                return None
            deadline = time.monotonic() + SPAWN_REPLY_S
            try:
                while request_id not in self.forked and request_id not in self.abandoned \
                        and self.ready:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.state.wait(left)
            except BaseException:  # a Ctrl-C: the probe must not run on without its caller
                self.abandoned.add(request_id)
                if request_id in self.forked:
                    kill_probe(self.forked.pop(request_id).pid)
                raise
            self.last_used = time.monotonic()
            probe = self.forked.pop(request_id, None)  # it may have exited already: it ran
            if probe is not None or request_id in self.abandoned:  # forked, or fork failed
                self.abandoned.discard(request_id)
                return probe
            self.abandoned.add(request_id)
            self.ready = False  # no answer in SPAWN_REPLY_S: broken
        self.close()
        return None

    def close(self) -> None:
        """End the server (its children, if any, die with it) and its reader."""
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(timeout=5)
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def kill_probe(pid: int) -> None:
    """SIGKILL a forked probe by its pid and its group (until it has called setsid, its
    group is not there yet)."""
    for kill in (os.kill, os.killpg):
        with contextlib.suppress(OSError):
            kill(pid, signal.SIGKILL)


ServerKey = tuple[object, ...]
_servers: dict[ServerKey, ForkServer] = {}
_servers_lock = threading.Lock()
_failed: set[ServerKey] = set()  # kinds whose server could not import what a probe needs


def can_fork() -> bool:
    return sys.platform == "linux" and hasattr(os, "fork")


def forked_probe(env: dict[str, str], cpu_ids: tuple[int, ...] | None, model: str,
                 model_path: str | None, request_path: Path, result_path: Path,
                 log_path: Path, timeout_s: float,
                 stopping: threading.Event) -> ForkedProbe | None:
    """The probe forked by the server for its kind (its environment less the probe's tag,
    its cores, its model; started now if there is none, and waited for at most `timeout_s`);
    None when it cannot be forked: start it as a process. A kind whose server failed to
    import is never tried again in this process."""
    if stopping.is_set():
        return None
    tag = env.get(PROBE_TAG_ENV, "")
    server_env = {name: value for name, value in env.items() if name != PROBE_TAG_ENV}
    model_path = str(Path(model_path).resolve()) if model_path else None
    key: ServerKey = (tuple(sorted(server_env.items())), cpu_ids, model, model_path,
                      _server_tag(tag))
    closing: list[ForkServer] = []
    with _servers_lock:
        if key in _failed:
            return None
        server = _servers.get(key)
        if server is not None and server.ready is False:
            if server.error is not None:
                _failed.add(key)
            closing.append(_servers.pop(key))
            server = None
        if server is None and key not in _failed:
            server = _servers[key] = ForkServer(
                {**server_env, PROBE_TAG_ENV: _server_tag(tag)}, cpu_ids, model, model_path)
        if server is not None:
            server.users += 1
        closing += _pop_idle(keep=MAX_IDLE_SERVERS)
    for old in closing:  # outside the lock: a close waits for the server to exit
        old.close()
    if server is None:
        return None
    try:
        if not server.wait_ready(timeout_s, stopping):
            if server.error is not None:
                with _servers_lock:
                    _failed.add(key)
            return None
        return server.spawn(request_path, result_path, log_path, tag)
    finally:
        with _servers_lock:
            server.users -= 1


def _server_tag(probe_tag: str) -> str:
    """The server's own tag: the probe's driver and scope (process_tag.new_tag), with "server"
    for the id. Its children show it in /proc (their environment block is the server's), and
    pass on their probe's own to the processes they start."""
    return probe_tag.rsplit(".", 1)[0] + ".server" if probe_tag else ""


def _pop_idle(keep: int) -> list[ForkServer]:
    """Take idle servers out of the pool, least recently used first, until at most `keep`
    are idle; the caller holds the lock, and closes them once it has let it go."""
    idle = sorted((key for key, server in _servers.items() if not server.busy),
                  key=lambda key: _servers[key].last_used)
    return [_servers.pop(key) for key in idle[:max(0, len(idle) - keep)]]


def close_idle_servers() -> None:
    """Close every server with no probe in flight (a sweep is over)."""
    with _servers_lock:
        idle = _pop_idle(keep=0)
    for server in idle:
        server.close()


def close_servers() -> None:
    """Close every server; their probes in flight die with them (this process exits)."""
    with _servers_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.close()


atexit.register(close_servers)  # at this process's exit (an empty pool: nothing to do)
