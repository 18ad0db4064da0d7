"""Shared fixtures: small real probe requests on the tiny registry models (CPU), and the check
that the session leaves nothing running.

`nothing_left_running` (session, autouse) marks this session's processes with SESSION_ENV in
the environment every process it starts inherits (Ray's nodes and workers, PostgreSQL started
through runuser, playwright's Chromium, vLLM's engine), and at the end fails if a process that
carries the mark or descends from this one is still alive (it kills them first, so the machine
is clean), or if a thread it knows of is: any non-daemon thread but the main one, and the Ray
runner's cancel threads (a thread left in a Ray call when Ray shuts down can abort the
process dozens of tests later).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from autotune.config import ProbeConfig
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.forking import close_servers

# Real servers on loopback: PostgreSQL for the shared-study tests (tests/postgres_server.py),
# a Ray cluster for the Ray runner and multi-node tests (tests/ray_cluster.py), a headless
# Chromium for the report tests (tests/browser.py).
pytest_plugins = ["postgres_server", "ray_cluster", "browser", "vllm_env"]

# A fast, valid GRPO step on the tiny text model: 8 responses of 64 + 32 tokens.
SMALL_CONFIG = ProbeConfig(rollout_batch_size=4, rollout_n=2, global_batch_size=2,
                           micro_batch_size_update=2, micro_batch_size_experience=4,
                           max_prompt_length=64, max_response_length=32, image_size_px=56)


def small_request(model: str = "tiny-qwen2.5", gpu_memory_limit_bytes: int | None = None,
                  **overrides: object) -> ProbeRequest:
    """A small CPU probe; `gpu_memory_limit_bytes` caps its device (--gpu-memory-limit)."""
    config_changes = {k: overrides.pop(k) for k in list(overrides)
                      if k in ProbeConfig.__dataclass_fields__}
    config = ProbeConfig(**{**SMALL_CONFIG.as_dict(), **config_changes})
    fields = {"model": model, "config": config, "device": Device("cpu", None,
                                                                 gpu_memory_limit_bytes),
              "cpu_threads": 2, "warmup_steps": 0, "timed_steps": 1, "timeout_s": 300.0,
              **overrides}
    return ProbeRequest(**fields)  # type: ignore[arg-type]


@pytest.fixture
def make_request():
    return small_request


SESSION_ENV = "AUTOTUNE_TEST_SESSION"  # in every process the test session starts
LEFTOVER_GRACE_S = 15.0  # how long processes may take to exit once the session is over
# Daemon threads that must have ended too: the Ray runner's cancels, a fork server's reader.
KNOWN_THREADS = ("autotune-ray-cancel", "autotune-fork-server")


def alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


def session_processes(mark: str) -> list[psutil.Process]:
    """Live processes this session started: descendants of this one, and any process that
    carries the session's mark (a daemon that left the tree: a postmaster, an orphan)."""
    me = psutil.Process()
    found = {proc.pid: proc for proc in me.children(recursive=True) if alive(proc)}
    for proc in psutil.process_iter():
        if proc.pid == me.pid or proc.pid in found:
            continue
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(SESSION_ENV) == mark and alive(proc):
                found[proc.pid] = proc
    return list(found.values())


def of_this_session(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of `procs` this session started (they carry its mark): another test session on
    the same machine runs probes of its own."""
    mine = []
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(SESSION_ENV) == os.environ.get(SESSION_ENV):
                mine.append(proc)
    return mine


def describe(proc: psutil.Process) -> str:
    with contextlib.suppress(psutil.Error):
        return f"{proc.pid} {' '.join(proc.cmdline())[:160]}"
    return str(proc.pid)


def leftover_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate()
            if thread is not threading.main_thread() and thread.is_alive()
            and (not thread.daemon or thread.name in KNOWN_THREADS)]


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running() -> Iterator[None]:
    """Fail the session if a process or thread it started outlives it (module docstring)."""
    mark = f"{os.getpid()}.{int(time.time())}"
    os.environ[SESSION_ENV] = mark
    before = {proc.pid for proc in psutil.Process().children(recursive=True)}
    yield
    close_servers()  # the probes' fork servers live as long as the process that made them
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = [p for p in session_processes(mark) if p.pid not in before]
    while (left or leftover_threads()) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [p for p in session_processes(mark) if p.pid not in before]
    threads = leftover_threads()
    named = [describe(proc) for proc in left]
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not (named or threads), ("the tests left running: processes "
                                    f"{named or 'none'}; threads {threads or 'none'}")
