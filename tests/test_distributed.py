"""Real drivers and real probes sharing one study: two `autotune run` processes on a real
PostgreSQL server, and a sweep across a real two-node Ray cluster that loses a node.

These are the slowest tests of the suite (about a minute each): every probe is a real
tiny-model GRPO step in its own process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import psutil
import pytest
from optuna.trial import TrialState
from runner_contract import is_probe

from autotune.sweep.space.params import params_key

pytestmark = pytest.mark.slow



def probe_args(threads: int = 1) -> list[str]:
    return ["--model", "tiny-qwen2.5", "--device", "cpu", "--space", "cpu-demo",
            "--sampler", "random", "--no-prune", "--no-prescreen", "--threads", str(threads),
            "--warmup-steps", "0", "--timed-steps", "1", "--study", "shared"]


def driver(results_dir: Path, *args: str) -> subprocess.Popen:
    log = open(results_dir.parent / f"{results_dir.name}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "autotune", "run", "--finalists", "0",
                             *probe_args(),
                             "--results-dir", str(results_dir), *args],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def probe_processes() -> list[psutil.Process]:
    """This session's probe processes (another test session on the machine runs its own)."""
    from conftest import of_this_session

    return of_this_session([proc for proc in psutil.process_iter() if is_probe(proc)])


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)


def check_no_duplicates_no_losses(study: optuna.Study, trials_budget: int) -> list:
    trials = study.get_trials(deepcopy=False)
    assert not [t.number for t in trials if t.state == TrialState.RUNNING]
    probed = [t for t in trials if t.user_attrs.get("probed")]
    keys = [params_key(t.params) for t in probed]
    assert len(keys) == len(set(keys)), "a config was probed twice"
    assert trials_budget <= len(probed) <= trials_budget + 1
    for cut in (t for t in trials if t.user_attrs.get("status") == "interrupted"):
        # every config cut off was queued again and its probe finished: nothing lost
        assert cut.user_attrs["requeued"]
        assert params_key(cut.params) in keys, f"trial {cut.number}'s config was lost"
    return probed


@pytest.mark.postgres
def test_two_drivers_share_one_postgres_study_through_a_kill_and_restart(fresh_postgres_db,
                                                                          tmp_path):
    """Two machines (two results dirs) on one PostgreSQL study; one is SIGKILLed mid-probe and
    restarted while the other keeps going."""
    url = fresh_postgres_db
    shared = ["--storage", url, "--trials", "6", "--heartbeat", "1s"]
    first = driver(tmp_path / "machine-a", *shared, "--seed", "1")
    second = driver(tmp_path / "machine-b", *shared, "--seed", "2")
    logs = tmp_path / "machine-b" / "shared" / "logs"

    def second_is_probing() -> bool:
        started = {p.name.split(".")[0] for p in logs.glob("trial-*.log")} if logs.exists() \
            else set()
        done = {p.name.split(".")[0] for p in logs.glob("trial-*.result.json")}
        return bool(started - done) and bool(probe_processes())

    wait_for(second_is_probing, 120, "machine b to start a probe")
    time.sleep(2)
    os.killpg(second.pid, signal.SIGKILL)  # the driver and (by PDEATHSIG) its probe
    second.wait()
    restarted = driver(tmp_path / "machine-b", *shared, "--seed", "3")
    assert first.wait(timeout=400) == 0, (tmp_path / "machine-a.log").read_text()[-3000:]
    assert restarted.wait(timeout=400) == 0, (tmp_path / "machine-b.log").read_text()[-3000:]
    wait_for(lambda: not probe_processes(), 10, "no probe process left")

    study = optuna.load_study(study_name="shared", storage=url)
    probed = check_no_duplicates_no_losses(study, 6)
    cut = [t for t in study.trials if t.user_attrs.get("status") == "interrupted"]
    assert len(cut) == 1, "the killed driver's probe is recorded as interrupted"
    by_dir = {d: len(list((tmp_path / d / "shared" / "logs").glob("*.result.json")))
              for d in ("machine-a", "machine-b")}
    assert all(by_dir.values()), by_dir  # both machines probed
    assert sum(by_dir.values()) == len(probed)


def probes_under(root_pid: int) -> list[psutil.Process]:
    """The probe processes running under a process (a Ray node's raylet)."""
    with contextlib.suppress(psutil.Error):
        return [p for p in psutil.Process(root_pid).children(recursive=True) if is_probe(p)]
    return []


def finished_trials(db: Path) -> dict[int, tuple]:
    if not db.exists():
        return {}
    study = optuna.load_study(study_name="shared", storage=f"sqlite:///{db}")
    return {t.number: (t.params, t.values, t.user_attrs.get("status"))
            for t in study.get_trials(deepcopy=False) if t.state.is_finished()}


@pytest.mark.ray
def test_a_sweep_across_two_ray_nodes_survives_losing_one(ray_cluster, tmp_path):
    """A real Ray head (2 CPUs) and a second node process (2 CPUs) on 127.0.0.1; probes take 2
    CPUs each, so one runs on each node. The second node is killed mid-probe: its probe is
    recorded lost and retried on the head, every trial finished before stays as it was."""
    second = ray_cluster.add_node(num_cpus=2)
    raylet_pid = second.all_processes["raylet"][0].process.pid
    results = tmp_path / "results"
    log = open(tmp_path / "driver.log", "ab")
    sweep = subprocess.Popen(
        [sys.executable, "-m", "autotune", "run", "--finalists", "0",
         *probe_args(threads=2), "--executor", "ray",
         "--address", ray_cluster.address, "--trials", "3", "--results-dir", str(results)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: probes_under(raylet_pid), 180, "a probe on the second node")
        time.sleep(3)  # well into the probe
        before = finished_trials(results / "shared" / "study.db")
        ray_cluster.kill_node(second)
        assert sweep.wait(timeout=400) == 0, (tmp_path / "driver.log").read_text()[-3000:]
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    output = (tmp_path / "driver.log").read_text()
    study = optuna.load_study(study_name="shared",
                              storage=f"sqlite:///{results / 'shared' / 'study.db'}")
    after = {t.number: t for t in study.trials}
    for number, (params, values, status) in before.items():  # nothing finished was redone
        assert (after[number].params, after[number].values,
                after[number].user_attrs.get("status")) == (params, values, status)
    lost = [t for t in study.trials if t.user_attrs.get("status") == "lost"]
    assert len(lost) == 1 and lost[0].user_attrs["requeued"], output[-3000:]
    retry = [t for t in study.trials if t.user_attrs.get("requeued_from") == lost[0].number]
    assert len(retry) == 1 and retry[0].params == lost[0].params
    assert retry[0].user_attrs["status"] == "ok"
    ok = [t for t in study.trials if t.user_attrs.get("probed")
          and t.user_attrs.get("status") == "ok"]
    assert len(ok) == 3 and len({params_key(t.params) for t in ok}) == 3
    assert not study.get_trials(states=(TrialState.RUNNING,))
    assert "lost" in output
    wait_for(lambda: not probe_processes(), 15, "no probe process left")


@pytest.mark.ray
def test_a_driver_killed_with_ray_tasks_in_flight_resumes_without_orphans(ray_cluster,
                                                                          tmp_path):
    """SIGKILL the driver while two Ray tasks probe: Ray ends the dead driver's tasks and the
    probes die with them; the same command then finishes the study, redoing only the two
    configs that were cut off."""
    results = tmp_path / "results"
    command = [sys.executable, "-m", "autotune", "run", "--finalists", "0",
               *probe_args(threads=1), "--executor",
               "ray", "--address", ray_cluster.address, "--parallel", "2", "--trials", "4",
               "--results-dir", str(results)]
    log = open(tmp_path / "driver.log", "ab")
    first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    db = results / "shared" / "study.db"
    try:
        wait_for(lambda: len(probe_processes()) == 2 and len(finished_trials(db)) >= 1, 180,
                 "two probes in flight after a first finished trial")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    before = finished_trials(db)
    wait_for(lambda: not probe_processes(), 30, "the dead driver's probes to end")
    second = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=400)
    assert second.returncode == 0, (tmp_path / "driver.log").read_text()[-3000:]
    study = optuna.load_study(study_name="shared", storage=f"sqlite:///{db}")
    after = {t.number: t for t in study.trials}
    for number, (params, values, status) in before.items():
        assert (after[number].params, after[number].values,
                after[number].user_attrs.get("status")) == (params, values, status)
    cut = [t for t in study.trials if t.user_attrs.get("status") == "interrupted"]
    # two were in flight (one may have saved its result just before the kill: then it is kept)
    assert 1 <= len(cut) <= 2, [(t.number, t.user_attrs.get("status")) for t in study.trials]
    check_no_duplicates_no_losses(study, 4)
    assert not probe_processes()
