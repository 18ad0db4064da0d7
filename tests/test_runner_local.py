"""The local runner on real probes and real dying processes: every end is classified."""

from __future__ import annotations

import time

import psutil
import pytest
from runner_contract import FAULTY, RunnerContract

from autotune.errors import ConfigError
from autotune.probe.result import ProbeStatus
from autotune.runners import get_runner
from autotune.runners.local import SubprocessRunner


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
