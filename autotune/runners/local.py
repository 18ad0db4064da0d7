"""SubprocessRunner: each probe in a process group of its own, watched, and killed whole.

The worker runs as `python -m autotune.probe.worker` in a new session, pinned to its GPUs with
CUDA_VISIBLE_DEVICES (or to CPU threads), its output in a log file; a built-in CPU probe is
forked instead, by a fork server that has imported torch (forking.py), into the same. A
watchdog polls the process tree: past `timeout_s` or past the host-memory limit it kills every
process of the probe. Whatever happened, `run` returns a classified ProbeResult and leaves no
process behind.

Files: with a log path (a sweep's `logs/trial-00007.log`) the request and the worker's result
go beside it (probe_files: `trial-00007.request.json`, `trial-00007.result.json`, written
atomically), so a result written just before the driver died is found when the sweep resumes.
Without one, they go in a scratch directory named after this process, removed when the probe
ends; one left by a process that was SIGKILLed is removed by the next runner made on the
machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import psutil

from autotune.files import open_log, write_text_atomic
from autotune.probe.measure.oom import classify_exit, classify_text
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus, probe_files
from autotune.process_tag import (
    PROBE_TAG_ENV,
    ProcessTree,
    die_with_parent,
    kill_orphaned,
    kill_tagged,
    new_tag,
)
from autotune.runners.forking import can_fork, close_idle_servers, forked_probe
from autotune.runners.oom_evidence import OOMWitness

SCRATCH_PREFIX = "autotune-probe-"  # + the owning process's pid + "-"
STDERR_TAIL_CHARS = 4000
POLL_INTERVAL_S = 0.02


def probe_env(request: ProbeRequest, tag: str = "") -> dict[str, str]:
    """The worker's environment: its GPUs, its threads, a heap that returns freed memory, the
    trainer's worker settings (request.env), and the probe's tag (process_tag.py), inherited
    by every process the probe starts."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error")
    env.update(request.env)  # the trainer's own worker settings (its CUDA allocator's)
    if tag:
        env[PROBE_TAG_ENV] = tag
    # Blocks of 256 KiB and more come from mmap and go back to the OS when freed, so a CPU
    # probe's RSS tracks its live tensors, not its heap's fragments (the threshold and its
    # cost in step time: benchmarks/cpu_heap.py).
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 << 10))
    if not request.device.on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif request.gpu_ids is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in request.gpu_ids)
    if request.cpu_threads:
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[name] = str(request.cpu_threads)
    return env


def forkable(request: ProbeRequest) -> bool:
    """Whether a probe may be forked from a fork server: a built-in probe on the CPU in one
    process (a GPU probe initialises CUDA in its own process, as the trainer's does; a command
    probe runs the user's trainer; a real multi-rank probe's launcher imports no torch, and
    its ranks start as processes of their own)."""
    return (not request.device.on_gpu and request.command is None
            and (request.world_size == 1 or request.emulated))


def prepare_child(parent_pid: int, cpu_ids: tuple[int, ...] | None) -> None:
    """In the child before exec: pin it to its cores, and die with the driver."""
    if cpu_ids:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpu_ids)
    die_with_parent(parent_pid)


class ProbeProcess(Protocol):
    """What the runner asks of a probe's process: a Popen, or a probe forked by a server."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def kill_tree(proc: ProbeProcess, tag: str = "") -> None:
    """SIGKILL the probe's process group, any descendant that left it, and any process that
    carries the probe's tag (a Ray worker the trainer's run started is no descendant)."""
    descendants: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):
        descendants = psutil.Process(proc.pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.poll() is None:  # a forked probe that has not made its group yet
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    if tag:
        kill_tagged(tag)


def remove_stale_scratch_dirs() -> None:
    """Remove scratch directories whose owning process is gone (it was SIGKILLed)."""
    pattern = re.compile(re.escape(SCRATCH_PREFIX) + r"(\d+)-")
    with contextlib.suppress(OSError):
        for path in Path(tempfile.gettempdir()).iterdir():
            match = pattern.match(path.name)
            if match and not psutil.pid_exists(int(match.group(1))):
                shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def scratch_dir() -> Iterator[Path]:
    """A directory for one probe's files, named after this process and removed after it."""
    path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def read_tail(path: Path, max_chars: int = STDERR_TAIL_CHARS) -> str:
    with contextlib.suppress(OSError):
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_chars * 4))
            return handle.read().decode("utf-8", "replace")[-max_chars:]
    return ""


class SubprocessRunner:
    """Runs each probe as `python -m autotune.probe.worker` in its own process group (a
    built-in CPU probe forked by a fork server, unless `fork` is False)."""

    def __init__(self, worker_argv: list[str] | None = None, scope: str = "",
                 fork: bool = True) -> None:
        # The command that runs a probe; it gets REQUEST.json RESULT.json appended.
        self.worker_argv = worker_argv or [sys.executable, "-m", "autotune.probe.worker"]
        # Built-in CPU probes of the real worker are forked from a server that has imported
        # torch (forking.py); a Ray task's runner starts each probe as a process.
        self.fork = fork and worker_argv is None and can_fork()
        self.stopping = threading.Event()  # set by stop(): every probe in flight is killed
        self.scope = scope  # its probes' tag scope: the study's (process_tag.tag_scope)
        self.started = False  # whether the first probe cleaned up after a killed driver
        self.starting = threading.Lock()

    def start(self) -> None:
        """Before the first probe (once; making the runner changes nothing): remove the
        scratch folders of drivers that are gone and kill the processes of this scope's
        probes whose driver was SIGKILLed."""
        with self.starting:
            if not self.started:
                remove_stale_scratch_dirs()
                if self.scope:
                    kill_orphaned(self.scope)
                self.started = True

    def stop(self) -> None:
        """Kill every probe in flight (from any thread); their `run` calls return at once."""
        self.stopping.set()

    def close(self) -> None:
        """Close the idle fork servers (the sweep is over); every probe's processes ended
        with its `run`."""
        if self.fork:
            close_idle_servers()

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult:
        self.start()
        if log_path is None:
            with scratch_dir() as scratch:
                return self.run(request, scratch / "probe.log")
        log_path = Path(log_path)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        request_path, result_path = probe_files(log_path)
        result_path.unlink(missing_ok=True)  # only this probe's result may be read back
        if log_path.is_symlink():
            return ProbeResult(status=ProbeStatus.CRASH, probe_wall_s=0.0, message=(
                f"{log_path}: a symbolic link where the probe's log goes; autotune never "
                "follows one there: remove it and run again"))
        write_text_atomic(request_path, request.to_json())
        return self._run(request, request_path, result_path, log_path)

    def _run(self, request: ProbeRequest, request_path: Path, result_path: Path,
             log_path: Path) -> ProbeResult:
        started = time.monotonic()
        timed_out = host_limit_exceeded = False
        host_peak_rss_bytes = 0
        driver_pid = os.getpid()
        witness = OOMWitness()  # the worker starts in this process's memory cgroup
        tag = new_tag(self.scope)
        env = probe_env(request, tag)
        proc: ProbeProcess | None = None
        if self.fork and forkable(request):
            proc = forked_probe(env, request.cpu_ids, request.model, request.model_path,
                                request_path, result_path, log_path, request.timeout_s,
                                self.stopping)
        if proc is None:
            with os.fdopen(open_log(log_path), "wb") as log:
                proc = subprocess.Popen(
                    [*self.worker_argv, str(request_path), str(result_path)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=env, start_new_session=True,
                    preexec_fn=(lambda: prepare_child(driver_pid, request.cpu_ids))
                    if sys.platform == "linux" else None)
        tree = None
        try:
            with contextlib.suppress(psutil.NoSuchProcess):  # a forked probe may be reaped
                tree = ProcessTree(psutil.Process(proc.pid), tag)
            while proc.poll() is None:
                rss = tree.rss_bytes() if tree else 0
                host_peak_rss_bytes = max(host_peak_rss_bytes, rss)
                limit = request.host_memory_limit_bytes
                if limit is not None and rss > limit:
                    host_limit_exceeded = True
                    break
                if time.monotonic() - started > request.timeout_s:
                    timed_out = True
                    break
                if self.stopping.is_set():
                    break
                time.sleep(POLL_INTERVAL_S)
        finally:
            kill_tree(proc, tag)  # also on KeyboardInterrupt: no probe outlives the call
        wall_s = time.monotonic() - started
        tail = read_tail(log_path)
        result = None
        if timed_out or host_limit_exceeded:  # a result written as it was killed is not it
            result_path.unlink(missing_ok=True)
        elif result_path.exists():
            with contextlib.suppress(ValueError, TypeError, KeyError):
                result = ProbeResult.from_json(result_path.read_text())
        if result is None:
            evidence = None
            sigkill = proc.returncode == -signal.SIGKILL or \
                classify_text(tail) is ProbeStatus.KILLED  # the probe, or a child of it
            if sigkill and not self.stopping.is_set() and not (timed_out or host_limit_exceeded):
                evidence = witness.evidence(tree.seen_pids if tree else {proc.pid})
            status, message = classify_exit(proc.returncode, tail, timed_out=timed_out,
                                            host_limit_exceeded=host_limit_exceeded,
                                            oom_evidence=evidence)
            if host_limit_exceeded:
                message += f" ({host_peak_rss_bytes} bytes > {request.host_memory_limit_bytes})"
            if getattr(proc, "server_died", False) and status is ProbeStatus.KILLED:
                message = ("its fork server (the process that forks this sweep's CPU probes) "
                           "died, from outside autotune, and the probe with it: nothing "
                           "about the config")
            result = ProbeResult(status=status, message=message)
        return result.replace(
            returncode=proc.returncode, probe_wall_s=wall_s,
            stderr_tail="" if result.ok else tail,
            host_peak_rss_bytes=max(result.host_peak_rss_bytes or 0, host_peak_rss_bytes))
