"""Two real processes share one Optuna study on a real PostgreSQL server (RDBStorage).

The shared-study sweep relies on two properties checked here: concurrent ``ask`` calls get
distinct trial numbers, and an enqueued (WAITING) trial is popped by exactly one process, so
no config is run twice by two drivers.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState

# The fixtures (postgres_server, postgres_url, fresh_postgres_db) come from the plugin module
# tests/postgres_server.py, registered in conftest.py.
pytestmark = pytest.mark.postgres

STUDY = "shared"
N_CONFIGS = 30

# One driver process. argv: url, study name, mode ("ask" or "pop"), n.
# Opening the study races with the other process on a fresh database (table creation, version
# row, the study row itself); like Optuna users do, it retries until the winner's rows exist.
# After opening, it prints "ready" and waits for "go" on stdin, so both processes ask at once.
WORKER = r"""
import json, random, sys, time
import optuna
import sqlalchemy.exc
from optuna.trial import TrialState

url, name, mode, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
optuna.logging.set_verbosity(optuna.logging.ERROR)

open_retries = 0
for attempt in range(20):
    try:
        storage = optuna.storages.RDBStorage(url)
        study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True)
        break
    except (optuna.exceptions.DuplicatedStudyError, sqlalchemy.exc.IntegrityError,
            sqlalchemy.exc.ProgrammingError, optuna.exceptions.StorageInternalError):
        open_retries += 1
        time.sleep(random.uniform(0.05, 0.2))
else:
    raise SystemExit("could not open the study")

# Count the pops this process lost (set_trial_state_values(RUNNING) returned False).
lost = 0
set_state = storage.set_trial_state_values
def counting_set_state(trial_id, state, values=None):
    global lost
    ok = set_state(trial_id, state, values)
    if state == TrialState.RUNNING and not ok:
        lost += 1
    return ok
storage.set_trial_state_values = counting_set_state

print("ready", flush=True)
assert sys.stdin.readline().strip() == "go"

asked, extra = [], 0
if mode == "ask":
    for _ in range(n):
        trial = study.ask()
        x = trial.suggest_float("x", -1.0, 1.0)
        study.tell(trial, x * x)
        asked.append(trial.number)
else:
    while study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        trial = study.ask()
        config_id = trial.user_attrs.get("config_id")
        if config_id is None:
            # The other process popped the last WAITING trial between our check and ask().
            study.tell(trial, state=TrialState.FAIL)
            extra += 1
            break
        x = trial.suggest_int("x", 0, 1000)
        assert x == config_id, (x, config_id)
        study.tell(trial, float(x))
        asked.append(config_id)
print(json.dumps({"asked": asked, "extra": extra, "lost": lost, "open_retries": open_retries}))
"""


def run_two_drivers(url: str, mode: str, n: int = 0) -> list[dict]:
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, url, STUDY, mode, str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for proc in procs:
            line = proc.stdout.readline()
            assert line.strip() == "ready", (line, proc.wait(), proc.stderr.read())
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = []
    for proc, (out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def load(url: str) -> optuna.Study:
    return optuna.load_study(study_name=STUDY, storage=optuna.storages.RDBStorage(url))


def test_two_processes_ask_distinct_trials(fresh_postgres_db):
    reports = run_two_drivers(fresh_postgres_db, "ask", 20)
    asked = reports[0]["asked"] + reports[1]["asked"]
    assert len(asked) == 40 and len(set(asked)) == 40

    trials = load(fresh_postgres_db).get_trials(deepcopy=False)
    assert len(trials) == 40
    assert sorted(t.number for t in trials) == list(range(40))
    assert all(t.state == TrialState.COMPLETE for t in trials)
    print(f"study-open retries: {reports[0]['open_retries']} + {reports[1]['open_retries']}")


def test_enqueued_trials_are_popped_exactly_once(fresh_postgres_db):
    study = optuna.create_study(study_name=STUDY,
                                storage=optuna.storages.RDBStorage(fresh_postgres_db))
    for i in range(N_CONFIGS):
        study.enqueue_trial({"x": i}, user_attrs={"config_id": i})

    reports = run_two_drivers(fresh_postgres_db, "pop")
    first, second = reports[0]["asked"], reports[1]["asked"]
    asked = first + second
    assert sorted(asked) == list(range(N_CONFIGS)), (first, second)
    assert not set(first) & set(second)

    trials = load(fresh_postgres_db).get_trials(deepcopy=False)
    extra = reports[0]["extra"] + reports[1]["extra"]
    assert len(trials) == N_CONFIGS + extra
    by_state = {s: [t for t in trials if t.state == s] for s in TrialState}
    assert not by_state[TrialState.WAITING] and not by_state[TrialState.RUNNING]
    completed = by_state[TrialState.COMPLETE]
    assert sorted(t.user_attrs["config_id"] for t in completed) == list(range(N_CONFIGS))
    assert all(t.params == {"x": t.user_attrs["config_id"]} for t in completed)
    assert all("config_id" not in t.user_attrs for t in by_state[TrialState.FAIL])
    print(f"pops: {len(first)} + {len(second)}, lost races: "
          f"{reports[0]['lost']} + {reports[1]['lost']}, extra trials: {extra}")


def test_server_is_real_postgres(postgres_server):
    with contextlib.closing(postgres_server.connect("autotune")) as conn, conn.cursor() as cur:
        cur.execute("SHOW server_version")
        assert cur.fetchone()[0]
        cur.execute("SHOW listen_addresses")
        assert cur.fetchone()[0] == "127.0.0.1"
