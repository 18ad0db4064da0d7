"""The Runner contract, as tests every runner must pass (subclass RunnerContract).

A subclass named Test... overrides the ``make_runner`` fixture: a function
``make_runner(worker_argv=None) -> Runner`` whose runner runs each probe with the given worker
command (None: the real ``python -m autotune.probe.worker``; otherwise the faulty worker in
tests/).
Every case runs real processes: a real tiny probe, a real OOM, real deaths.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from autotune.probe.measure.result import ProbeStatus
from autotune.runners import Runner

FAULTY = [sys.executable, str(Path(__file__).parent / "faulty_worker.py")]

MakeRunner = Callable[..., Runner]


def processes_mentioning(marker: str) -> list[psutil.Process]:
    """Live processes whose command line has `marker` in it (zombies are dead)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(
                proc.info["cmdline"] or ()):
            found.append(proc)
    return found


def is_probe(proc: psutil.Process) -> bool:
    """Whether `proc` is a probe: a started worker, or a child a fork server forked (it shows
    the server's command line; the server itself is no probe)."""
    try:
        cmdline = " ".join(proc.cmdline())
        if "autotune.probe.worker" in cmdline:
            return True
        parent = proc.parent()
        return ("autotune.probe.fork_server" in cmdline and parent is not None
                and "autotune.probe.fork_server" in " ".join(parent.cmdline()))
    except psutil.Error:
        return False


def wait_until(condition: Callable[[], object], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class RunnerContract:
    """Every end of a probe is classified, and the probe's log is kept."""

    @pytest.fixture
    def make_runner(self) -> MakeRunner:
        raise NotImplementedError("a RunnerContract subclass provides make_runner")

    @pytest.fixture
    def runner(self, make_runner: MakeRunner) -> Runner:
        return make_runner()

    def test_ok_probe_reports_speed_and_memory(self, runner, make_request):
        result = runner.run(make_request())
        assert result.status is ProbeStatus.OK, result.stderr_tail
        assert result.tokens_per_s > 0 and result.samples_per_s > 0
        assert set(result.phase_peak_mem_bytes) == {"rollout", "experience", "update"}
        assert all(v > 0 for v in result.phase_peak_mem_bytes.values())
        assert result.peak_mem_bytes == max(result.phase_peak_mem_bytes.values())
        assert result.host_peak_rss_bytes >= result.peak_mem_bytes
        assert result.device_name.startswith("cpu") and result.device_capacity_bytes > 0
        assert result.num_params > 1e6
        assert result.versions["torch"] and result.fixed_cost_s > 0
        assert result.probe_wall_s >= result.fixed_cost_s

    def test_device_limit_on_cpu_is_gpu_oom_with_phase(self, runner, make_request):
        # 200 MiB of anonymous memory cannot hold the runtime, model and step (~350 MiB).
        result = runner.run(make_request(gpu_memory_limit_bytes=200 * 2**20))
        assert result.status is ProbeStatus.GPU_OOM, (result.message, result.stderr_tail)
        assert result.failed_phase in ("rollout", "experience", "update")
        assert "device memory limit exceeded" in result.message

    def test_probe_past_its_timeout_is_a_timeout(self, runner, make_request):
        started = time.monotonic()
        result = runner.run(make_request(timeout_s=1.5))
        assert result.status is ProbeStatus.TIMEOUT
        assert time.monotonic() - started < 15

    def test_os_exit_is_crash_with_stderr_tail(self, make_runner, make_request):
        result = make_runner(FAULTY + ["exit"]).run(make_request())
        assert result.status is ProbeStatus.CRASH and result.returncode == 3
        assert "probe aborted in update" in result.stderr_tail
        assert "exit code 3" in result.message

    def test_signal_is_crash(self, make_runner, make_request):
        result = make_runner(FAULTY + ["segv"]).run(make_request())
        assert result.status is ProbeStatus.CRASH and "SIGSEGV" in result.message
        assert "about to segfault" in result.stderr_tail

    def test_log_file_is_kept(self, make_runner, make_request, tmp_path):
        log = tmp_path / "logs" / "trial-0.log"
        make_runner(FAULTY + ["exit"]).run(make_request(), log_path=log)
        assert "probe aborted" in log.read_text()

    def test_stop_kills_the_probe_in_flight(self, make_runner, make_request, tmp_path):
        pid_file = tmp_path / "child.pid"  # its path also marks the worker's command line
        runner = make_runner(FAULTY + ["hang", str(pid_file)])
        results = []
        thread = threading.Thread(target=lambda: results.append(
            runner.run(make_request(timeout_s=300.0))), daemon=True)
        thread.start()
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), 60), results
        child = int(pid_file.read_text())
        assert processes_mentioning(str(pid_file)) and not is_gone(child)
        runner.stop()
        thread.join(timeout=30)
        assert not thread.is_alive() and results[0].status is not ProbeStatus.OK
        assert wait_until(lambda: is_gone(child), 10)
        assert wait_until(lambda: not processes_mentioning(str(pid_file)), 10)
