"""The Ray runner on a real loopback Ray cluster: the runner contract, lost nodes, Ray's OOM.

One cluster per module (the ray_cluster fixture of tests/ray_cluster.py): a 2-CPU head, plus
nodes a test adds with a custom resource of their own, so that its probe runs there alone.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from runner_contract import (
    FAULTY,
    RunnerContract,
    is_gone,
    is_probe,
    processes_mentioning,
    wait_until,
)
from terminal import sigint_as_in_a_terminal

from autotune.probe.measure.result import ProbeStatus
from autotune.runners import get_runner
from autotune.runners.ray_runner import RayRunner  # imports ray only when a runner is made

pytest.importorskip("ray")
pytestmark = pytest.mark.ray


class TestRayRunnerContract(RunnerContract):
    @pytest.fixture
    def make_runner(self, ray_cluster):
        def make(worker_argv=None):
            return RayRunner(ray_cluster.address, worker_argv=worker_argv)

        return make


def test_stop_does_not_wait_on_a_ray_cancel_that_blocks(ray_cluster, make_request, tmp_path,
                                                        monkeypatch):
    """`ray.cancel` is a call to the task's owner and node that can block under load (a full CI
    run once saw a stopped probe's `run` still waiting 30 s after `stop`). Here every
    ray.cancel blocks: `stop` still kills the probe (on this machine, by its tag) and `run`
    returns, and the cancel threads end once Ray answers."""
    import ray

    from autotune.runners.ray_runner import wait_for_cancels

    answer = threading.Event()
    cancels = []

    def blocking_cancel(probe, force=False, recursive=True):
        cancels.append(force)
        answer.wait(60)

    monkeypatch.setattr(ray, "cancel", blocking_cancel)
    pid_file = tmp_path / "child.pid"
    runner = RayRunner(ray_cluster.address, worker_argv=FAULTY + ["hang", str(pid_file)])
    results = []
    thread = threading.Thread(target=lambda: results.append(
        runner.run(make_request(timeout_s=300.0))), daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: pid_file.exists() and pid_file.read_text(), 60), results
        child = int(pid_file.read_text())
        stopped_at = time.monotonic()
        runner.stop()
        assert time.monotonic() - stopped_at < 10, "stop waited"
        thread.join(timeout=15)
        assert not thread.is_alive(), "run waited on a blocked ray.cancel"
        assert results[0].status is not ProbeStatus.OK and cancels
        assert wait_until(lambda: is_gone(child), 10)
        assert wait_until(lambda: not processes_mentioning(str(pid_file)), 10)
    finally:
        answer.set()
    assert not wait_for_cancels(10)


WITHOUT_RAY = """
import runpy, sys
sys.modules["ray"] = None  # as where Ray is not installed: `import ray` fails, no spec found
sys.argv = ["autotune", *sys.argv[1:]]
runpy.run_module("autotune", run_name="__main__")
"""


def test_ray_executor_without_ray_is_one_line(monkeypatch, tmp_path):
    """Where Ray is not installed, asking for it is a ConfigError (the library) and one line
    with exit 2 (`autotune run --executor ray`), before anything is written."""
    from autotune.errors import ConfigError
    from autotune.runners import ray_cluster_gpus

    monkeypatch.setitem(sys.modules, "ray", None)
    for ask in (lambda: get_runner("ray"), lambda: ray_cluster_gpus(None)):
        with pytest.raises(ConfigError, match=r"Ray is not installed; pip install"):
            ask()
    monkeypatch.undo()
    results = tmp_path / "results"
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, "run", "--finalists", "0", "--model",
         "tiny-qwen2.5", "--device", "cpu", "--space", "cpu-demo", "--executor", "ray",
         "--trials", "1", "--results-dir", str(results)],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        "Error: --executor ray: Ray is not installed; pip install 'autotune[ray]'"], out.stderr
    assert not results.exists()


def test_get_runner_makes_a_ray_runner(ray_cluster):
    runner = get_runner("ray", address=ray_cluster.address, num_cpus_per_probe=2)
    assert isinstance(runner, RayRunner) and runner.probe_slots() == 1


def test_probe_slots_count_the_cluster(ray_cluster):
    assert RayRunner(ray_cluster.address).probe_slots() == 2
    assert RayRunner(ray_cluster.address, num_cpus_per_probe=0.5).probe_slots() == 4
    assert RayRunner(ray_cluster.address, num_cpus_per_probe=4).probe_slots() == 1
    assert RayRunner(ray_cluster.address, resources={"nowhere": 1}).probe_slots() == 1


def probe_on_own_node(ray_cluster, make_request, tmp_path):
    """A new node and, on a thread, a probe that sleeps on it: (node, the probe's marker, the
    thread, the list its result goes into)."""
    name = tmp_path.name  # a resource only this node has
    node = ray_cluster.add_node(num_cpus=1, resources={name: 1})
    marker = str(tmp_path / "sleeping-probe")
    runner = RayRunner(ray_cluster.address, resources={name: 1},
                       worker_argv=FAULTY + ["sleep", marker])
    results: list = []
    thread = threading.Thread(target=lambda: results.append(runner.run(make_request())),
                              daemon=True)
    thread.start()
    return node, marker, thread, results


def test_lost_node_is_lost(ray_cluster, make_request, tmp_path):
    """A node SIGKILLed mid-probe: the probe is LOST (not a crash: it says nothing about the
    config), soon, and its worker process died with the node."""
    node, marker, thread, results = probe_on_own_node(ray_cluster, make_request, tmp_path)
    assert wait_until(lambda: processes_mentioning(marker), 60), "the probe never started"
    killed_at = time.monotonic()
    ray_cluster.kill_node(node)
    thread.join(timeout=60)
    detect_s = time.monotonic() - killed_at
    assert not thread.is_alive(), "run did not return after its node died"
    result = results[0]
    assert result.status is ProbeStatus.LOST, result.message
    assert "node lost" in result.message and "NodeDiedError" in result.message
    assert detect_s < 20, f"node death took {detect_s:.1f} s to surface"
    assert wait_until(lambda: not processes_mentioning(marker), 10), "probe outlived its node"


def test_memory_monitor_kill_is_host_oom(ray_cluster, make_request, tmp_path):
    """Ray's memory monitor kills the task for real: a node whose threshold sits 1.5 GiB above
    the machine's memory use now runs a worker that grows until the monitor steps in."""
    memory = psutil.virtual_memory()
    if memory.available < 6 * 2**30:
        pytest.skip("needs 6 GiB of free memory")
    threshold = (memory.total - memory.available + 1.5 * 2**30) / memory.total
    node = ray_cluster.add_node(num_cpus=1, resources={"low_memory": 1},
                                env={"RAY_memory_usage_threshold": f"{threshold:.4f}",
                                     "RAY_memory_monitor_refresh_ms": "100"})
    marker = str(tmp_path / "allocating-probe")
    try:
        runner = RayRunner(ray_cluster.address, resources={"low_memory": 1},
                           worker_argv=FAULTY + ["allocate", marker])
        # The local watchdog is only a backstop, 3 GiB past the threshold.
        result = runner.run(make_request(host_memory_limit_bytes=int(4.5 * 2**30)))
        assert result.status is ProbeStatus.HOST_OOM, result.message
        assert "Ray's memory monitor" in result.message
        assert wait_until(lambda: not processes_mentioning(marker), 10)
    finally:
        ray_cluster.kill_node(node)


def test_frozen_node_is_lost(ray_cluster, make_request, tmp_path):
    """A node that stops answering (SIGSTOP: no connection breaks, as a hung machine or a
    network partition) leaves Ray waiting on its worker; the runner sees the GCS mark the node
    dead and calls the probe LOST."""
    node, marker, thread, results = probe_on_own_node(ray_cluster, make_request, tmp_path)
    try:
        assert wait_until(lambda: processes_mentioning(marker), 60), "the probe never started"
        frozen_at = time.monotonic()
        ray_cluster.freeze_node(node)
        thread.join(timeout=60)
        detect_s = time.monotonic() - frozen_at
    finally:
        ray_cluster.kill_node(node)
    assert not thread.is_alive(), "run did not return after its node froze"
    assert results[0].status is ProbeStatus.LOST, results[0].message
    assert "marked the probe's node dead" in results[0].message
    assert detect_s < 20, f"node death took {detect_s:.1f} s to surface"
    assert wait_until(lambda: not processes_mentioning(marker), 10), "probe outlived its node"


LOCAL_RAY_SCRIPT = """
import sys, time, psutil
from autotune.runners.ray_runner import RayRunner
from conftest import small_request
runner = RayRunner(num_cpus_per_probe=0.5, worker_argv=sys.argv[1:])
print(runner.probe_slots(), runner.run(small_request()).status.value)
started = psutil.Process().children(recursive=True)
runner.close()
deadline = time.monotonic() + 15
while time.monotonic() < deadline and any(p.is_running() and p.status() != "zombie"
                                          for p in started):
    time.sleep(0.1)
print(sum(p.is_running() and p.status() != "zombie" for p in started))
"""


def test_runner_without_address_starts_and_stops_its_own_ray(tmp_path):
    """address=None: the runner starts a local Ray (in a process of its own here: this one
    is already a driver; with a Ray temp dir of its own, so that it does not join the module's
    cluster), and close() stops every process of it."""
    ray_tmp = tempfile.mkdtemp(prefix="rt-", dir="/tmp")  # Ray's socket paths must be short
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": ray_tmp,
           "RAY_AUTH_MODE": "disabled",  # else Ray writes a token to ~/.ray
           "PYTHONPATH": str(Path(__file__).parent)}
    try:
        done = subprocess.run([sys.executable, "-c", LOCAL_RAY_SCRIPT, *FAULTY, "exit"],
                              env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    slots_and_status, left = done.stdout.split("\n")[-3:-1]
    assert slots_and_status == "4 crash"  # 2 CPUs / 0.5
    assert left == "0", "processes of the local Ray outlived close()"


def probe_processes() -> list[psutil.Process]:
    """This session's probe processes (another session's on the machine do not count): they
    carry its mark (conftest.SESSION_ENV), inherited through the Ray nodes it started."""
    from conftest import of_this_session

    return of_this_session([proc for proc in psutil.process_iter() if is_probe(proc)])


def ray_cpus_in_use(address: str) -> float:
    """CPUs the cluster's tasks hold now (this process connected to the cluster)."""
    import ray

    from autotune.runners.ray_runner import connect

    connect(address)
    return ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)


def clean_after(address: str, what: str) -> None:
    assert wait_until(lambda: not probe_processes(), 15), f"a probe outlived {what}"
    assert wait_until(lambda: ray_cpus_in_use(address) == 0, 15), f"a Ray task outlived {what}"


@pytest.mark.slow
def test_a_ray_sweep_stopped_by_ctrl_c_or_its_timeout_leaves_nothing_and_resumes(ray_cluster,
                                                                               tmp_path):
    """`autotune run --executor ray` on the loopback cluster, with real tiny probes: a SIGINT
    mid-probe ends the driver promptly (exit 130); the resumed run starts a probe and
    reaches --timeout during it (which ends; nothing new starts); each time no probe process
    and no Ray task is left. The last run finishes the study: the config cut by the SIGINT
    probed again, nothing twice."""
    import optuna
    from optuna.trial import TrialState

    from autotune.sweep.space.params import params_key

    results = tmp_path / "results"
    command = [sys.executable, "-m", "autotune", "run", "--finalists", "0", "--model",
               "tiny-qwen2.5", "--device", "cpu", "--space", "cpu-demo", "--sampler", "random",
               "--no-prune", "--no-prescreen", "--no-trace", "--threads", "1",
               "--warmup-steps", "0", "--timed-steps", "1", "--study", "s",
               "--executor", "ray", "--address", ray_cluster.address,
               "--results-dir", str(results)]
    log = tmp_path / "driver.log"
    with open(log, "ab") as out:
        first = subprocess.Popen([*command, "--trials", "2"], stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 preexec_fn=sigint_as_in_a_terminal)
    try:
        assert wait_until(probe_processes, 180), log.read_text()[-3000:]
        time.sleep(1)  # into the probe
        stopped_at = time.monotonic()
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 130, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert time.monotonic() - stopped_at < 45, "the driver took long to stop"
    clean_after(ray_cluster.address, "a Ctrl-C")

    timed = subprocess.run([*command, "--trials", "3", "--timeout", "1s"], capture_output=True,
                           text=True, timeout=400)
    assert timed.returncode == 0, timed.stderr[-3000:]
    assert re.search(r"reached --timeout 1 s\. ok [12] ", timed.stderr), timed.stderr[-3000:]
    # a probe at least (two slots: two if both start within the second), however long
    # opening the study and connecting to Ray took
    clean_after(ray_cluster.address, "a --timeout")

    last = subprocess.run([*command, "--trials", "2"], capture_output=True, text=True,
                          timeout=400)
    assert last.returncode == 0, last.stderr[-3000:]
    clean_after(ray_cluster.address, "the last run")
    study = optuna.load_study(study_name="s",
                              storage=f"sqlite:///{results / 's' / 'study.db'}")
    assert not study.get_trials(states=(TrialState.RUNNING,))
    cut = [t for t in study.trials if t.user_attrs.get("status") == "interrupted"]
    assert study.trials[0] in cut  # the probe the SIGINT cut (a stop also gives back trials
    # asked but not started: interrupted too)
    ok = [t for t in study.trials if t.user_attrs.get("probed")
          and t.user_attrs.get("status") == "ok"]
    keys = [params_key(t.params) for t in ok]
    assert len(ok) == 2 and len(set(keys)) == 2, [t.user_attrs for t in study.trials]
    for trial in cut:  # queued again and probed: nothing lost
        assert trial.user_attrs["requeued"] and params_key(trial.params) in keys
