"""CPU probes forked from a fork server (runners/forking.py, probe/fork_server.py): they
measure what a started worker measures, and they are stopped, timed out and killed with their
driver as a started one is. Real processes throughout: the server imports the real torch and
transformers, each probe trains the tiny model."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from runner_contract import is_gone, is_probe, wait_until

from autotune.hardware import Device
from autotune.probe.measure.result import ProbeStatus
from autotune.runners.local import SubprocessRunner, forkable

SERVER_MARK = "autotune.probe.fork_server"


def forked_children(root: psutil.Process) -> list[psutil.Process]:
    """Probes forked by the fork servers under `root` (they show the server's command line)."""
    return [proc for proc in root.children(recursive=True)
            if is_probe(proc) and SERVER_MARK in " ".join(proc.cmdline())]


def test_a_forked_probe_measures_what_a_started_one_does(make_request):
    started = SubprocessRunner(fork=False).run(make_request())
    runner = SubprocessRunner()
    runner.run(make_request())  # the first starts the server for this kind of probe
    forked = runner.run(make_request())
    for result in (started, forked):
        assert result.status is ProbeStatus.OK, result.stderr_tail
    # A started worker spends about a second importing torch before it can say its age; a
    # forked one starts with everything imported.
    assert started.startup_s > 0.5 and forked.startup_s < 0.3, (started.startup_s,
                                                                 forked.startup_s)
    # The device figure on a CPU (anonymous RSS) holds the same imports either way.
    assert set(forked.phase_peak_mem_bytes) == set(started.phase_peak_mem_bytes)
    for phase, started_bytes in started.phase_peak_mem_bytes.items():
        assert abs(forked.phase_peak_mem_bytes[phase] - started_bytes) < 8 * 2**20, phase


def test_a_stopped_forked_probe_returns_at_once_and_leaves_no_process(make_request):
    runner = SubprocessRunner()
    runner.run(make_request())  # the server is ready: the next probe is forked
    results = []
    thread = threading.Thread(target=lambda: results.append(
        runner.run(make_request(timed_steps=200))), daemon=True)
    thread.start()
    me = psutil.Process()
    assert wait_until(lambda: forked_children(me), 60), "no probe was forked"
    child = forked_children(me)[0]
    time.sleep(1.0)  # well inside its steps
    runner.stop()
    thread.join(timeout=15)
    assert not thread.is_alive() and results[0].status is not ProbeStatus.OK
    assert wait_until(lambda: is_gone(child.pid), 10)


def test_a_forked_probe_past_its_timeout_is_a_timeout(make_request):
    runner = SubprocessRunner()
    runner.run(make_request())
    started = time.monotonic()
    result = runner.run(make_request(timed_steps=200, timeout_s=3.0))
    assert result.status is ProbeStatus.TIMEOUT, result.message
    assert time.monotonic() - started < 15


DRIVER = """
import sys
sys.path.insert(0, {tests!r})
from conftest import small_request
from autotune.runners.local import SubprocessRunner
runner = SubprocessRunner()
runner.run(small_request())
print("ready", flush=True)
runner.run(small_request(timed_steps=200))
"""


def test_the_server_and_its_probe_die_with_a_killed_driver():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER.format(
        tests=str(Path(__file__).parent))], stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout is not None and driver.stdout.readline().strip() == "ready"
        root = psutil.Process(driver.pid)
        assert wait_until(lambda: forked_children(root), 60), "no probe was forked"
        left = [*root.children(recursive=True)]
        assert len(left) == 2  # the server and the probe it forked
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    # A zombie has ended: reaping it is up to whoever adopted it (PID 1, or a subreaper).
    assert wait_until(lambda: all(is_gone(proc.pid) for proc in left), 10), \
        "a fork server or its probe outlived its killed driver"


def test_only_a_built_in_cpu_probe_in_one_process_is_forked(make_request):
    request = make_request()
    assert forkable(request)
    assert forkable(make_request(gpus_per_node=2, emulated=True))  # one process: fake ranks
    assert not forkable(make_request(gpus_per_node=2))  # a launcher and two rank processes
    assert not forkable(dataclasses.replace(request, device=Device("cuda", None, None)))


def test_a_forked_probe_runs_where_its_driver_is_now(make_request, tmp_path, monkeypatch):
    """Relative paths (a sweep's default `results/`) mean the driver's directory at the probe,
    not the one its fork server was started in."""
    runner = SubprocessRunner()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    assert runner.run(make_request(), Path("logs/trial-00000.log")).ok
    monkeypatch.chdir(tmp_path / "b")
    result = runner.run(make_request(), Path("logs/trial-00001.log"))
    assert result.ok and result.startup_s < 0.3, result.stderr_tail  # forked, not started
    assert (tmp_path / "b" / "logs" / "trial-00001.result.json").is_file()
    assert (tmp_path / "b" / "logs" / "trial-00001.log").is_file()
    assert not (tmp_path / "a" / "logs" / "trial-00001.log").exists()


def test_a_probe_its_server_cannot_prepare_fails_as_a_started_one_does(make_request):
    """A model the fork server cannot import (here: no such model) is started as a process,
    and ends as the started worker says."""
    started = SubprocessRunner(fork=False).run(make_request(model="no-such-model"))
    forked = SubprocessRunner().run(make_request(model="no-such-model"))
    assert forked.status is started.status and started.status is not ProbeStatus.OK
    assert forked.message == started.message
    assert forked.startup_s is None or forked.startup_s > 0.3  # it was started, not forked


IMPORTING_DRIVER = """
import os, sys, time
from autotune.runners.forking import ForkServer
server = ForkServer(dict(os.environ, CUDA_VISIBLE_DEVICES=""), None, "tiny-qwen2.5", None)
print(server.proc.pid, flush=True)
time.sleep(120)
"""


def test_a_server_still_importing_ends_at_once_with_its_killed_driver():
    """Its imports take seconds; a driver SIGKILLed meanwhile must not leave it running them."""
    driver = subprocess.Popen([sys.executable, "-c", IMPORTING_DRIVER], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert driver.stdout is not None
        server = psutil.Process(int(driver.stdout.readline()))
        time.sleep(0.3)  # it is importing torch
        assert server.is_running()
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    # Its imports take 3 s or more; a zombie has ended (its adopter reaps it).
    assert wait_until(lambda: is_gone(server.pid), 2.0), \
        "the fork server went on importing after its driver died"
