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
from typing import IO

from autotune.probe.process_tag import PROBE_TAG_ENV

MAX_IDLE_SERVERS = 4  # idle servers kept (each holds torch and a model class: ~350 MB RSS)
SPAWN_REPLY_S = 30.0  # a ready server answers a fork in milliseconds; past this it is broken


class ForkedProbe:
    """A probe forked by a fork server: the part of Popen's interface the runner uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exited = threading.Event()

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
        for line in replies:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            with self.state:
                if "ready" in message:
                    self.ready = True
                elif "error" in message:
                    self.ready = False
                elif "id" in message:
                    probe = ForkedProbe(message["pid"])
                    self.probes[probe.pid] = probe
                    if message["id"] in self.abandoned:  # nobody waits for it: it must not run
                        with contextlib.suppress(OSError):
                            os.killpg(probe.pid, signal.SIGKILL)
                    else:
                        self.forked[message["id"]] = probe
                elif "exited" in message and message["exited"] in self.probes:
                    self.probes.pop(message["exited"]).finish(message["returncode"])
                self.state.notify_all()
        with self.state:  # the server is gone, and its children with it (parent death)
            self.ready = False
            for probe in self.probes.values():
                probe.finish(-9)
            self.probes.clear()
            self.state.notify_all()

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
        """Fork a probe of `request_path`; None when the server cannot (it is gone)."""
        with self.state:
            if not self.ready or self.proc.stdin is None:
                return None
            request_id, self.next_id = self.next_id, self.next_id + 1
            message = {"id": request_id, "request": str(request_path),
                       "result": str(result_path), "log": str(log_path), "tag": tag}
            try:
                self.proc.stdin.write((json.dumps(message) + "\n").encode())
                self.proc.stdin.flush()
            except (OSError, ValueError):
                return None
            deadline = time.monotonic() + SPAWN_REPLY_S
            try:
                while request_id not in self.forked and self.ready:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.state.wait(left)
            except BaseException:  # a Ctrl-C: the probe must not run on without its caller
                self.abandoned.add(request_id)
                if request_id in self.forked:
                    with contextlib.suppress(OSError):
                        os.killpg(self.forked.pop(request_id).pid, signal.SIGKILL)
                raise
            self.last_used = time.monotonic()
            probe = self.forked.pop(request_id, None)  # it may have exited already: it ran
            if probe is None:  # not forked in time: it must never run later
                self.abandoned.add(request_id)
            return probe

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


ServerKey = tuple[object, ...]
_servers: dict[ServerKey, ForkServer] = {}
_servers_lock = threading.Lock()
_exit_hook: list[object] = []  # close_servers, once registered to run at exit


def can_fork() -> bool:
    return sys.platform == "linux" and hasattr(os, "fork")


def forked_probe(env: dict[str, str], cpu_ids: tuple[int, ...] | None, model: str,
                 model_path: str | None, request_path: Path, result_path: Path,
                 log_path: Path, timeout_s: float,
                 stopping: threading.Event) -> ForkedProbe | None:
    """The probe forked by the server for its kind (its environment less the probe's tag,
    its cores, its model; started now if there is none, and waited for at most `timeout_s`);
    None when it cannot be forked: start it as a process."""
    tag = env.get(PROBE_TAG_ENV, "")
    server_env = {name: value for name, value in env.items() if name != PROBE_TAG_ENV}
    key: ServerKey = (tuple(sorted(server_env.items())), cpu_ids, model, model_path,
                      _server_tag(tag))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.ready is False:
            if server is not None:
                server.close()
            if not _exit_hook:
                _exit_hook.append(atexit.register(close_servers))
            server = _servers[key] = ForkServer(
                {**server_env, PROBE_TAG_ENV: _server_tag(tag)}, cpu_ids, model, model_path)
        server.users += 1
        _close_idle(keep=MAX_IDLE_SERVERS)
    try:
        if not server.wait_ready(timeout_s, stopping):
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


def _close_idle(keep: int) -> None:
    """Close idle servers, least recently used first, until at most `keep` are idle (the
    caller holds the lock)."""
    idle = sorted((s.last_used, key) for key, s in _servers.items() if not s.busy)
    for _, key in idle[:max(0, len(idle) - keep)]:
        _servers.pop(key).close()


def close_idle_servers() -> None:
    """Close every server with no probe in flight (a sweep is over)."""
    with _servers_lock:
        _close_idle(keep=0)


def close_servers() -> None:
    """Close every server; their probes in flight die with them (this process exits)."""
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()
