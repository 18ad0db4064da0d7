"""A driver killed at the worst moments: nothing finished is lost, nothing is left behind.

The driver is a real process running a real Sweep with the real local runner; the worker is
tests/faulty_worker.py, which writes an ok result and then hangs, so the driver can be
SIGKILLed exactly between the worker's write and its own tell (the moment a real probe's
process is still exiting). The next run must tell that result, not probe the config again.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import optuna
from load import busy_processes
from optuna.trial import TrialState
from runner_contract import FAULTY, processes_mentioning, wait_until
from scripted_runner import ScriptedRunner
from terminal import sigint_as_in_a_terminal

from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.local import SCRATCH_PREFIX
from autotune.sweep.space.search_space import load_search_space
from autotune.sweep.study import trial_files
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.tuner import Sweep

DRIVER = """
import sys
from pathlib import Path
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest
from autotune.runners.local import SubprocessRunner
from autotune.sweep.space.search_space import load_search_space
from autotune.sweep.study.settings import SweepSettings
from autotune.sweep.tuner import Sweep

study_dir, worker = Path(sys.argv[1]), sys.argv[2:]
settings = SweepSettings(study_name="s", study_dir=study_dir,
                         space=load_search_space("cpu-demo"),
                         request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                         max_trials=2, storage=os.environ.get("DRIVER_STORAGE"))
Sweep(settings, SubprocessRunner(worker)).run()
""".replace("import sys\n", "import os\nimport sys\n", 1)


def settings(study_dir: Path, **changes) -> SweepSettings:
    return SweepSettings(study_name="s", study_dir=study_dir, space=load_search_space("cpu-demo"),
                         request=ProbeRequest(model="tiny-qwen2.5", device=Device("cpu")),
                         **changes)


def test_a_result_written_just_before_the_driver_died_is_told_on_resume(tmp_path):
    study_dir = tmp_path / "s"
    driver = subprocess.Popen([sys.executable, "-c", textwrap.dedent(DRIVER), str(study_dir),
                               *FAULTY, "result-then-hang"], start_new_session=True)
    saved = trial_files.result_path(study_dir, 0)
    assert wait_until(saved.exists, 60), "the worker never wrote its result"
    os.kill(driver.pid, signal.SIGKILL)  # the driver only: its worker dies by PDEATHSIG
    driver.wait()
    assert wait_until(lambda: not processes_mentioning(str(study_dir)), 10), "orphaned worker"
    leftovers = list(Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}{driver.pid}-*"))
    assert leftovers == []  # a sweep's probes keep their files under logs/, no scratch dirs

    runner = ScriptedRunner()
    study = Sweep(settings(study_dir, max_trials=2), runner).run()
    first = study.trials[0]
    assert first.state == TrialState.COMPLETE and first.user_attrs["probed"]
    assert first.user_attrs["result"]["tokens_per_s"] == 1234.5  # the saved result, told
    assert len(runner.calls) == 1  # only the second trial was probed, never the first again
    assert any(runner.calls[0][k] != v for k, v in first.params.items())


def test_a_torn_or_foreign_result_is_probed_again(tmp_path):
    study_dir = tmp_path / "s"
    Sweep(settings(study_dir, max_trials=1), ScriptedRunner()).run()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{study_dir / 'study.db'}")
    space = load_search_space("cpu-demo")
    torn, foreign = study.ask(space.distributions()), study.ask(space.distributions())
    trial_files.result_path(study_dir, torn.number).write_text('{"status": "ok", "tok')
    other = dict(foreign.params, offload_params=not foreign.params["offload_params"])
    trial_files.request_path(study_dir, foreign.number).write_text(
        ProbeRequest(model="m", config=space.config_for(other)).to_json())
    trial_files.result_path(study_dir, foreign.number).write_text(
        trial_files.result_path(study_dir, 0).read_text())
    partial = study_dir / "logs" / f".trial-{torn.number:05d}.result.json.abc.tmp"
    partial.write_text("half")
    study = Sweep(settings(study_dir, max_trials=1), ScriptedRunner()).run()
    for number in (torn.number, foreign.number):
        assert study.trials[number].user_attrs["status"] == "interrupted"
        assert any(t.user_attrs.get("requeued_from") == number for t in study.trials)
    assert not partial.exists()


def test_a_probe_killed_from_outside_is_retried_once_and_prunes_nothing(tmp_path):
    """`killed` says nothing about memory: no config is predicted from it, and it runs again."""
    safe = load_search_space("cpu-demo").safe_params()

    class KillFirstRun(ScriptedRunner):
        def run(self, request, log_path=None):
            from autotune.probe.measure.result import ProbeResult, ProbeStatus

            self.calls.append(request.config.as_dict())
            if len(self.calls) == 1:
                return ProbeResult(status=ProbeStatus.KILLED, message="killed by SIGKILL",
                                   returncode=-9, probe_wall_s=0.5)
            return super().run(request, log_path)

    runner = KillFirstRun()
    study = Sweep(settings(tmp_path / "s", max_trials=6, seed=1), runner).run()
    first = study.trials[0]
    assert first.params == safe and first.user_attrs["status"] == "killed"
    retry = [t for t in study.trials if t.user_attrs.get("requeued_from") == 0]
    assert len(retry) == 1 and retry[0].params == safe and retry[0].user_attrs["status"] == "ok"
    for trial in study.trials:  # what is predicted is predicted from a measured OOM only
        if trial.user_attrs.get("predicted_by") == "dominance":
            cause = int(re.search(r"of trial (\d+)", trial.user_attrs["reason"]).group(1))
            assert study.trials[cause].user_attrs["status"] in ("gpu_oom", "host_oom")


def test_a_second_driver_on_one_results_folder_is_refused_whatever_the_storage(tmp_path):
    """Two real drivers on one results folder, the study in a journal file (which two drivers
    may share, each in its own folder): the second is refused before it writes anything; it
    once rewrote the first's request, truncated its log and rewrote its trials.csv."""
    study_dir, pid_file = tmp_path / "s", tmp_path / "worker.pid"
    env = {**os.environ, "DRIVER_STORAGE": str(tmp_path / "study.journal"),
           "FAULTY_WORKER_PID_FILE": str(pid_file)}
    command = [sys.executable, "-c", textwrap.dedent(DRIVER), str(study_dir), *FAULTY, "sleep"]
    first = subprocess.Popen(command, env=env, start_new_session=True)
    try:
        assert wait_until(pid_file.exists, 60), "the first driver's probe never started"
        before = {p: p.read_bytes() for p in study_dir.rglob("*") if p.is_file()}
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert re.search(r"study s is being run by another autotune \(pid \d+\) in .*; give "
                         r"each driver of a shared study its own --results-dir", second.stderr)
        assert {p: p.read_bytes() for p in study_dir.rglob("*") if p.is_file()} == before
        assert first.poll() is None  # the first goes on
    finally:
        os.kill(first.pid, signal.SIGKILL)  # its worker dies by PDEATHSIG
        first.wait()
    assert wait_until(lambda: not processes_mentioning(str(study_dir)), 10), "orphaned worker"


INTERRUPTED = "Interrupted; nothing is lost. Resume with the same command (study S)."


def test_ctrl_c_at_a_resumed_sweeps_first_trace_stops_it_every_time(tmp_path):
    """A sweep that reached --trials traces nothing more (the nothing-fits check, which traces
    an untried config, ran before the stop rule). Its calibrated study is then resumed 5 times,
    each time Ctrl-C'd (SIGINT to the process group, as a terminal sends it) when `tracing ...`
    first shows, at delays from 0 to 3 s (in the trace process's fork, its start-up, its
    trace), beside one busy process per core. Every stop: rc 130, the one line, no traceback,
    within 10 s; the trace process gone with the driver; the finished trials as they were, the
    one asked queued again (none left RUNNING). An outside run saw 8 of 8 such Ctrl-Cs
    swallowed, the sweep probing on 30-40 s later. Last, a driver started as a script's
    background job, which ignores SIGINT, says how to stop it, and SIGTERM does."""
    import psutil

    base = [sys.executable, "-m", "autotune", "run", "--results-dir", str(tmp_path),
            "--study", "S", "--finalists", "0", "--timed-steps", "1", "--warmup-steps", "0"]
    first = subprocess.run([*base, "--trials", "1"], capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    lines = first.stderr.splitlines()
    probed = {line.split("probing trial 0: ")[1] for line in lines if "probing trial 0: " in line}
    traced = {line.split("  tracing ")[1] for line in lines if "  tracing " in line}
    assert probed and traced <= probed, first.stderr  # nothing traced once --trials is reached
    storage = f"sqlite:///{tmp_path / 'S' / 'study.db'}"
    before = [(t.state, t.params) for t in optuna.load_study(study_name="S",
                                                               storage=storage).trials]
    assert [state for state, _ in before] == [TrialState.COMPLETE]
    with busy_processes():
        for delay_s in (0.0, 0.05, 0.5, 1.5, 3.0):  # the fork, its start-up, its trace
            driver = subprocess.Popen([*base, "--trials", "4"], stderr=subprocess.PIPE,
                                      text=True, start_new_session=True,
                                      preexec_fn=sigint_as_in_a_terminal)
            assert driver.stderr is not None
            shown = []
            for line in driver.stderr:
                shown.append(line)
                if "tracing" in line:
                    break
            assert shown and "tracing" in shown[-1], "".join(shown)[-2000:]
            time.sleep(delay_s)
            tree = psutil.Process(driver.pid).children(recursive=True)
            os.killpg(driver.pid, signal.SIGINT)
            sent_s = time.monotonic()
            rest = driver.stderr.read()
            rc = driver.wait(timeout=60)
            took_s = time.monotonic() - sent_s
            said = f"delay {delay_s} s: rc {rc} after {took_s:.1f} s:\n{rest[-2000:]}"
            assert rc == 130, said
            assert rest.strip().splitlines()[-1] == INTERRUPTED, said
            assert "Traceback" not in rest and "Exception ignored" not in rest, said
            assert took_s < 10, said
            assert wait_until(lambda tree=tree: not [
                p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 10), \
                f"delay {delay_s} s: left running: {tree}"
            after = optuna.load_study(study_name="S", storage=storage).trials
            assert [(t.state, t.params) for t in after if t.state == TrialState.COMPLETE] \
                == before, said
            cut = [t for t in after if t.state not in (TrialState.COMPLETE, TrialState.WAITING)]
            assert all(t.state == TrialState.FAIL and t.user_attrs["status"] == "interrupted"
                       and t.user_attrs["requeued"] for t in cut), said  # none left RUNNING
            assert len([t for t in after if t.state == TrialState.WAITING]) <= 1, said
    background = subprocess.Popen(
        [*base, "--trials", "4"], stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `cmd &` in a script
    assert background.stderr is not None
    for line in background.stderr:
        if "Ctrl-C" in line:
            break
    assert line.rstrip().endswith(
        "Ctrl-C does not reach this sweep (started in the background by a script, which "
        f"ignores it): stop it with `kill {background.pid}`"), line
    for line in background.stderr:
        if "tracing" in line:
            break
    background.terminate()
    rest = background.stderr.read()
    assert background.wait(timeout=60) == 130, rest[-2000:]
    assert rest.strip().splitlines()[-1] == INTERRUPTED, rest[-2000:]
