"""The local runner on real probes and real dying processes: every end is classified."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from runner_contract import FAULTY, RunnerContract

from autotune.errors import ConfigError
from autotune.probe.measure.result import ProbeStatus
from autotune.runners import get_runner
from autotune.runners.local import SCRATCH_PREFIX, SubprocessRunner
from autotune.runners.oom_evidence import cgroup_oom_file, kernel_oom_killed_pids, oom_kill_count


class TestLocalRunnerContract(RunnerContract):
    @pytest.fixture
    def make_runner(self):
        return SubprocessRunner


def test_vl_probe_with_validation(make_request):
    result = SubprocessRunner().run(make_request("tiny-qwen2.5-vl", val_batch_size=2))
    assert result.status is ProbeStatus.OK, result.stderr_tail
    assert "validation" in result.phase_peak_mem_bytes and result.phase_s["validation"] > 0


def test_low_host_memory_limit_is_host_oom(make_request):
    result = SubprocessRunner().run(make_request(host_memory_limit_bytes=250 * 2**20))
    assert result.status is ProbeStatus.HOST_OOM, result.message
    assert "watchdog" in result.message


def test_invalid_config_is_invalid_not_crash(make_request):
    # 224 px makes 64 image tokens: more than a 32-token prompt holds.
    request = make_request("tiny-qwen2.5-vl", image_size_px=224, max_prompt_length=32)
    result = SubprocessRunner().run(request)
    assert result.status is ProbeStatus.INVALID
    assert "image tokens" in result.message


def test_hang_kills_the_whole_tree(make_request, tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("FAULTY_CHILD_PID_FILE", str(pid_file))
    result = SubprocessRunner(FAULTY + ["hang"]).run(make_request(timeout_s=3.0))
    assert result.status is ProbeStatus.TIMEOUT
    child = int(pid_file.read_text())
    time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


def test_host_watchdog_stops_a_growing_process(make_request):
    request = make_request(host_memory_limit_bytes=200 * 2**20, timeout_s=60.0)
    result = SubprocessRunner(FAULTY + ["allocate"]).run(request)
    assert result.status is ProbeStatus.HOST_OOM
    assert 200 * 2**20 < result.host_peak_rss_bytes < 400 * 2**20


def test_get_runner_names_the_valid_executors():
    assert isinstance(get_runner("local"), SubprocessRunner)
    assert get_runner("local", worker_argv=FAULTY).worker_argv == FAULTY
    with pytest.raises(ConfigError, match="valid: local, ray"):
        get_runner("slurm")


def test_a_worker_sigkilled_from_outside_is_killed_not_host_oom(make_request, tmp_path,
                                                                monkeypatch):
    """kill -9 of a probe with plenty of memory free: no OOM evidence, so `killed` (which
    teaches the sweep nothing about memory), never `host_oom`."""
    pid_file = tmp_path / "worker.pid"
    monkeypatch.setenv("FAULTY_WORKER_PID_FILE", str(pid_file))
    runner = SubprocessRunner(FAULTY + ["sleep"])
    results = []
    thread = threading.Thread(target=lambda: results.append(runner.run(make_request())))
    thread.start()
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    thread.join(timeout=30)
    assert results[0].status is ProbeStatus.KILLED, results[0].message
    assert results[0].returncode == -signal.SIGKILL and "no sign of memory" in results[0].message


def child_memory_cgroup() -> Path | None:
    """A new memory cgroup under this process's own, capped at 160 MiB (None when this machine
    does not let us make one: not root, or no writable cgroup tree)."""
    oom_file = cgroup_oom_file()
    if oom_file is None:
        return None
    path = oom_file.parent / f"autotune-test-{os.getpid()}"
    limit = "memory.max" if oom_file.name == "memory.events" else "memory.limit_in_bytes"
    try:
        path.mkdir()
        (path / limit).write_text(str(160 * 2**20))
    except OSError:
        with contextlib.suppress(OSError):
            path.rmdir()
        return None
    return path


def test_the_kernels_oom_killer_is_host_oom_with_its_evidence(make_request, monkeypatch):
    """A real kernel OOM kill: the worker moves into a memory cgroup capped at 160 MiB and
    grows until the kernel's OOM killer SIGKILLs it. The kernel log names its pid."""
    cgroup = child_memory_cgroup()
    if cgroup is None:
        pytest.skip("cannot create a memory cgroup here (needs root and a writable cgroup fs)")
    monkeypatch.setenv("FAULTY_CGROUP", str(cgroup))
    try:
        result = SubprocessRunner(FAULTY + ["allocate"]).run(make_request(timeout_s=60.0))
    finally:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
    assert result.status is ProbeStatus.HOST_OOM, result.message
    assert result.returncode == -signal.SIGKILL and "OOM killer" in result.message


def test_oom_evidence_reads_cgroup_counters_and_the_kernel_log(tmp_path):
    v2 = tmp_path / "memory.events"
    v2.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 0\n")
    v1 = tmp_path / "memory.oom_control"
    v1.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    assert oom_kill_count(v2) == 2 and oom_kill_count(v1) == 7
    assert oom_kill_count(tmp_path / "missing") is None
    kmsg = tmp_path / "kmsg"  # records as /dev/kmsg gives them
    kmsg.write_text("6,417,3542630114,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),"
                    "task=python3,pid=5966,uid=0\n"
                    "3,418,3542630139,-;Memory cgroup out of memory: Killed process 5967 "
                    "(python3) total-vm:426168kB\n")
    assert kernel_oom_killed_pids(str(kmsg)) == {5966, 5967}
    assert kernel_oom_killed_pids(str(tmp_path / "none")) is None


def test_probe_files_sit_beside_the_log_and_scratch_dirs_of_dead_processes_go(
        make_request, tmp_path):
    log = tmp_path / "logs" / "trial-00003.log"
    result = SubprocessRunner(FAULTY + ["exit"]).run(make_request(), log_path=log)
    assert result.status is ProbeStatus.CRASH
    assert (tmp_path / "logs" / "trial-00003.request.json").is_file()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = Path(tempfile.gettempdir()) / f"{SCRATCH_PREFIX}{dead.pid}-test"
    live = Path(tempfile.gettempdir()) / f"{SCRATCH_PREFIX}{os.getpid()}-test"
    for path in (stale, live):
        path.mkdir(exist_ok=True)
    try:
        runner = SubprocessRunner()
        assert stale.exists()  # making a runner changes nothing; its first probe cleans up
        runner.start()
        assert not stale.exists() and live.exists()
    finally:
        shutil.rmtree(live, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)


def test_a_symbolic_link_where_a_probes_log_goes_is_never_followed(make_request, tmp_path):
    """A link planted where the probe's log goes (results/<study>/logs/) would have the probe
    truncate and write whatever it points at: the runner refuses it in one line, and the log
    is opened with O_NOFOLLOW wherever it is made (the fork server's child too)."""
    from autotune.files import open_log

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    log = tmp_path / "logs" / "trial-0.log"
    log.parent.mkdir()
    log.symlink_to(victim)
    result = SubprocessRunner().run(make_request(), log)
    assert result.status is ProbeStatus.CRASH and "symbolic link" in result.message
    assert victim.read_text() == "keep me\n" and log.is_symlink()
    with pytest.raises(OSError):
        open_log(log)
    assert victim.read_text() == "keep me\n"
