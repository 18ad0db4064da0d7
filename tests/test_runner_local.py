"""The local runner on real probes and real dying processes: every end is classified."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil

from autotune.result import ProbeStatus
from autotune.runners.local import SubprocessRunner

FAULTY = [sys.executable, str(Path(__file__).parent / "faulty_worker.py")]


def test_ok_probe_reports_speed_and_memory(make_request):
    result = SubprocessRunner().run(make_request())
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


def test_vl_probe_with_validation(make_request):
    result = SubprocessRunner().run(make_request("tiny-qwen2.5-vl", val_batch_size=2))
    assert result.status is ProbeStatus.OK, result.stderr_tail
    assert "validation" in result.phase_peak_mem_bytes and result.phase_s["validation"] > 0


def test_low_host_memory_limit_is_host_oom(make_request):
    result = SubprocessRunner().run(make_request(host_memory_limit_bytes=250 * 2**20))
    assert result.status is ProbeStatus.HOST_OOM, result.message
    assert "watchdog" in result.message


def test_device_limit_on_cpu_is_gpu_oom_with_phase(make_request):
    # 200 MiB of anonymous memory cannot hold the runtime, model and step (~350 MiB) together.
    request = make_request(gpu_memory_limit_bytes=200 * 2**20)
    result = SubprocessRunner().run(request)
    assert result.status is ProbeStatus.GPU_OOM, (result.message, result.stderr_tail)
    assert result.failed_phase in ("rollout", "experience", "update")
    assert "device memory limit exceeded" in result.message


def test_probe_past_its_timeout_is_a_timeout(make_request):
    started = time.monotonic()
    result = SubprocessRunner().run(make_request(timeout_s=1.5))
    assert result.status is ProbeStatus.TIMEOUT
    assert time.monotonic() - started < 15


def test_invalid_config_is_invalid_not_crash(make_request):
    # 224 px makes 64 image tokens: more than a 32-token prompt holds.
    request = make_request("tiny-qwen2.5-vl", image_size_px=224, max_prompt_length=32)
    result = SubprocessRunner().run(request)
    assert result.status is ProbeStatus.INVALID
    assert "image tokens" in result.message


def test_os_exit_is_crash_with_stderr_tail(make_request):
    result = SubprocessRunner(FAULTY + ["exit"]).run(make_request())
    assert result.status is ProbeStatus.CRASH and result.returncode == 3
    assert "probe aborted in update" in result.stderr_tail
    assert "exit code 3" in result.message


def test_signal_is_crash(make_request):
    result = SubprocessRunner(FAULTY + ["segv"]).run(make_request())
    assert result.status is ProbeStatus.CRASH and "SIGSEGV" in result.message
    assert "about to segfault" in result.stderr_tail


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


def test_log_file_is_kept(make_request, tmp_path):
    log = tmp_path / "logs" / "trial-0.log"
    SubprocessRunner(FAULTY + ["exit"]).run(make_request(), log_path=log)
    assert "probe aborted" in log.read_text()
