"""Fault injection: SIGKILL the real `autotune run` and its probes, resume, and check the study.

Runs the CPU demo sweep (tiny-qwen2.5, cpu-demo space, 545 MiB device cap, real probes in
subprocesses) and breaks it on purpose, with kill moments drawn from a seeded random.Random:

1. driver kills: the driver's process group is SIGKILLed at a random moment (0.5-12 s after
   it starts), or the instant a probe's worker has written its result.json (logs/ polled
   every 2 ms), before the driver tells it; then the same command is run again to resume;
2. worker kills: a running probe's worker is sent SIGKILL (expected status `killed`, retried
   once) or SIGSEGV (expected `crash`) from outside, while its driver goes on;
3. a final clean run of the same command to completion, then the study is checked.

How to read the figures (each target is 0):
  lost            a probe that finished (valid result.json for the trial's config) whose trial
                  is not COMPLETE/FAIL with that result: finished work thrown away or redone
  duplicated      a config probed to a finished result more than once (retries after
                  killed/lost and interrupted probes, and a finalist's repeats, excepted)
  stuck           trials still RUNNING or WAITING after the final clean run
  orphaned        processes of the sweep still alive 1 s after a driver kill: its probe
                  workers and ranks, and its trace process (the driver's whole process tree
                  just before the kill, and any worker of the study)
  false host_oom  worker kills recorded as host_oom (an outside kill is no memory evidence)
  misclassified   worker kills recorded as anything but killed (SIGKILL) / crash (SIGSEGV)
  scratch dirs    autotune-probe-<pid>-* temp dirs of our dead drivers left behind
  resume latency  seconds from starting a resumed command to its first `probing trial` line

    python benchmarks/fault_injection.py [--quick] [--out DIR] [--seed 0]

Writes benchmarks/results/fault_injection.txt; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

OUT = Path(__file__).parent / "results"
STUDY = "fi"
POLL_S = 0.002  # how often logs/ is polled for a new result.json
ORPHAN_WAIT_S = 1.0
WORKER = "autotune.probe.worker"
TRACER = "autotune.probe.trace"
TRIAL_RE = re.compile(r"trial-(\d+)\.re(?:quest|sult)\.json")
FORK_SERVER = "autotune.probe.fork_server"  # a CPU probe is forked by one (its command line)
LOG_RE = re.compile(r"trial-(\d+)\.log$")
RESULT_RE = re.compile(r"trial-\d+\.result\.json")


class Driver:
    """One run of the CLI in a session of its own; its stderr lines timestamped."""

    def __init__(self, command: list[str]) -> None:
        self.started_s = time.monotonic()
        self.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines: list[tuple[float, str]] = []  # (seconds after start, line)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic() - self.started_s, line.rstrip()))

    def seconds_to(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.reader.join(timeout=5)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self.reader.join(timeout=5)


def result_files(logs: Path) -> set[str]:
    """The trials' own result files (a finalist's repeats, trial-N.repeat-K.result.json, are
    not a trial's result)."""
    names = os.listdir(logs) if logs.is_dir() else []
    return {n for n in names if RESULT_RE.fullmatch(n)}


def probe_trial(proc: psutil.Process, study_dir: Path) -> int | None:
    """The trial a probe of this study runs, None for any other process: a started worker
    names its request on its command line; a forked one (a child of a fork server, with the
    server's command line) holds its trial's log open as its output."""
    cmdline = " ".join(proc.cmdline())
    if WORKER in cmdline and str(study_dir) in cmdline:
        return int(TRIAL_RE.search(cmdline).group(1))
    parent = proc.parent()
    if FORK_SERVER in cmdline and parent is not None and \
            FORK_SERVER in " ".join(parent.cmdline()):
        for opened in proc.open_files():
            match = LOG_RE.search(opened.path)
            if match and opened.path.startswith(str(study_dir)):
                return int(match.group(1))
    return None


def live_workers(study_dir: Path, parent: int | None = None) -> list[psutil.Process]:
    """Probe processes of this study (under `parent` when given), zombies excluded."""
    procs = psutil.Process(parent).children(recursive=True) if parent else \
        psutil.process_iter()
    found = []
    for proc in procs:
        try:
            if probe_trial(proc, study_dir) is not None and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def sweep_tree(driver_pid: int) -> list[tuple[psutil.Process, str]]:
    """Every process under a driver now, each named worker, trace or other."""
    try:
        procs = psutil.Process(driver_pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for proc in procs:
        try:
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        kind = "worker" if WORKER in cmdline else "trace" if TRACER in cmdline else \
            "fork server or forked probe" if FORK_SERVER in cmdline else "other"
        found.append((proc, kind))
    return found


def trial_state(study_dir: Path, number: int) -> str:
    """A trial's state read from the study (only while no driver runs)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{study_dir / 'study.db'}")
    return study.get_trials(deepcopy=False)[number].state.name


def driver_kills(command, study_dir, plan, rng, runs, report) -> dict:
    """One driver per planned kill ("random" or "result"), SIGKILLed, orphans counted."""
    logs = study_dir / "logs"
    kills = {"random": 0, "result": 0, "untold": 0, "orphaned": 0, "ended_alone": 0,
             "orphaned_traces": 0, "tree": 0, "traces_killed": 0}
    for index, kind in enumerate(plan):
        before = result_files(logs)
        driver = Driver(command)
        runs.append(driver)
        delay_s = rng.uniform(0.5, 12.0)
        new: set[str] = set()
        while driver.alive():
            elapsed_s = time.monotonic() - driver.started_s
            if kind == "random" and elapsed_s >= delay_s:
                break
            if kind == "result":
                new = result_files(logs) - before
                if new or elapsed_s > 600:
                    break
            time.sleep(POLL_S if kind == "result" else 0.05)
        if not driver.alive():
            kills["ended_alone"] += 1
            report(f"driver run {index + 1}: ended by itself (rc {driver.proc.returncode})")
            continue
        tree = sweep_tree(driver.proc.pid)
        kills["tree"] += len(tree)
        kills["traces_killed"] += sum(kind == "trace" for _, kind in tree)
        driver.kill()
        what = f"{driver.lines[-1][1][:70] if driver.lines else '(no output)'}"
        if new:
            kills["result"] += 1
            number = int(TRIAL_RE.search(sorted(new)[0]).group(1))
            state = trial_state(study_dir, number)
            kills["untold"] += state == "RUNNING"
            what = f"right after trial {number} wrote its result (trial still {state})"
        else:
            kills["random"] += 1
        time.sleep(ORPHAN_WAIT_S)
        left = [(proc, kind) for proc, kind in tree if alive(proc)]
        orphans = list({proc.pid: proc for proc in [*live_workers(study_dir),
                                                     *(p for p, _ in left)]}.values())
        kills["orphaned"] += len(orphans)
        kills["orphaned_traces"] += sum(kind == "trace" for _, kind in left)
        report(f"driver kill {index + 1}/{len(plan)} at "
               f"{time.monotonic() - driver.started_s - ORPHAN_WAIT_S:.1f} s: {what}"
               f"{f'; ORPHANS {[p.pid for p in orphans]}' if orphans else ''}")
        for proc in orphans:  # do not let them skew the rest of the run
            with contextlib.suppress(psutil.Error):
                proc.kill()
    return kills


def worker_kills(command, study_dir, plan, rng, runs, report) -> list[tuple[int, str]]:
    """Signal running probe workers from outside, one per planned signal; their trials."""
    sent: list[tuple[int, str]] = []
    seen: set[int] = set()
    driver = Driver(command)
    runs.append(driver)
    while len(sent) < len(plan):
        if not driver.alive():
            if driver.proc.returncode == 0 or len(runs) > 100:
                report(f"worker kills: the driver ended (rc {driver.proc.returncode}) "
                       "before every kill was made")
                break
            driver = Driver(command)
            runs.append(driver)
        fresh = [p for p in live_workers(study_dir, driver.proc.pid) if p.pid not in seen]
        if not fresh:
            time.sleep(0.05)
            continue
        worker = fresh[0]
        seen.add(worker.pid)
        try:
            number = probe_trial(worker, study_dir)
        except psutil.Error:
            continue  # it ended first
        if number is None:
            continue
        time.sleep(rng.uniform(0.3, 1.5))  # mid-probe: a forked CPU probe takes seconds
        result = study_dir / "logs" / f"trial-{number:05d}.result.json"
        if not worker.is_running() or result.exists():
            continue  # it finished first: not a mid-probe kill
        signum = plan[len(sent)]
        worker.send_signal(signum)
        sent.append((number, signal.Signals(signum).name))
        report(f"worker kill {len(sent)}/{len(plan)}: {sent[-1][1]} to trial {number} "
               f"(pid {worker.pid})")
    deadline_s = time.monotonic() + 60
    while sent and driver.alive() and time.monotonic() < deadline_s and not \
            (study_dir / "logs" / f"trial-{sent[-1][0]:05d}.result.json").exists():
        time.sleep(0.1)  # until the driver has written (and told) the last one
    time.sleep(0.5)
    if driver.alive():
        driver.proc.send_signal(signal.SIGTERM)  # a polite stop, not a fault
        driver.wait(timeout_s=120)
    return sent


def check_study(study_dir: Path, sent: list[tuple[int, str]]) -> dict:
    """Lost, duplicated and stuck trials, and how the worker kills were recorded."""
    import optuna
    from optuna.trial import TrialState

    from autotune.sweep.pick.measurements import FINALIST
    from autotune.sweep.space.params import params_key
    from autotune.sweep.space.search_space import load_search_space
    from autotune.sweep.study import trial_files

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = load_search_space("cpu-demo")
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{study_dir / 'study.db'}")
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    status = {n: t.user_attrs.get("status") for n, t in trials.items()}
    lost = []
    for name in sorted(result_files(study_dir / "logs")):
        number = int(TRIAL_RE.search(name).group(1))
        trial = trials.get(number)
        if trial is None or not trial.params:
            lost.append(f"trial {number}: result.json but no such trial in the study")
            continue
        saved = trial_files.read_saved_result(study_dir, number, space.config_for(trial.params))
        if saved is None:
            continue  # torn, or not a probe of this config: not a finished probe
        told = trial.user_attrs.get("result") or {}
        if trial.state not in (TrialState.COMPLETE, TrialState.FAIL) or \
                status[number] != saved.status.value or \
                told.get("tokens_per_s") != saved.tokens_per_s:
            lost.append(f"trial {number}: saved {saved.status.value}, study has "
                        f"{trial.state.name} status={status[number]}")
    finished = collections.defaultdict(list)
    for number, trial in trials.items():
        attrs = trial.user_attrs
        if not attrs.get("probed") or status[number] in (None, "interrupted", "killed", "lost",
                                                        "duplicate"):
            continue
        if attrs.get("origin") == "retry" and \
                status.get(attrs.get("requeued_from")) in ("killed", "lost"):
            continue
        if attrs.get("origin") == FINALIST:  # a finalist's repeat probes its config again
            continue
        finished[params_key(trial.params)].append(number)
    duplicated = [numbers for numbers in finished.values() if len(numbers) > 1]
    stuck = [f"trial {n} {t.state.name}" for n, t in trials.items()
             if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    expected = {"SIGKILL": "killed", "SIGSEGV": "crash"}
    misclassified = [f"trial {n} {name} -> {status.get(n)}" for n, name in sent
                     if status.get(n) != expected[name]]
    false_host_oom = sum(status.get(n) == "host_oom" for n, _ in sent)
    retried = sum(any(t.user_attrs.get("origin") == "retry" and
                      t.user_attrs.get("requeued_from") == n for t in trials.values())
                  for n, name in sent
                  if name == "SIGKILL" and trials[n].user_attrs.get("origin") != "retry")
    to_retry = sum(name == "SIGKILL" and trials[n].user_attrs.get("origin") != "retry"
                   for n, name in sent)
    not_oom = {n for n, s in status.items() if s in ("killed", "lost", "crash")}
    bad_predictions = [f"trial {n} cites trial {m}" for n, t in trials.items()
                       if t.user_attrs.get("predicted")
                       for m in map(int, re.findall(r"trial (\d+)", t.user_attrs.get("reason")
                                                    or "")) if m in not_oom]
    probed = collections.Counter(status[n] for n, t in trials.items()
                                 if t.user_attrs.get("probed"))
    reused = sum("reused_from" in t.user_attrs for t in trials.values())
    not_run = sum(t.user_attrs.get("probed") is False for t in trials.values()) - reused
    summary = (", ".join(f"{k} {v}" for k, v in sorted(probed.items())) +
               f"; not probed: interrupted {list(status.values()).count('interrupted')}, "
               f"reused {reused}, predicted or invalid {not_run}")
    return {"lost": lost, "duplicated": duplicated, "stuck": stuck,
            "misclassified": misclassified, "false_host_oom": false_host_oom,
            "retried": retried, "to_retry": to_retry, "bad_predictions": bad_predictions,
            "trials": len(trials), "summary": summary}


def scratch_dirs_left(driver_pids: set[int]) -> list[str]:
    pattern = re.compile(r"autotune-probe-(\d+)-")
    left = []
    for path in Path(tempfile.gettempdir()).iterdir():
        match = pattern.match(path.name)
        if match and int(match.group(1)) in driver_pids and \
                not psutil.pid_exists(int(match.group(1))):
            left.append(path.name)
    return left


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few kills: a smoke check")
    parser.add_argument("--out", type=Path, help="where the study goes (default: a temp dir, "
                                                 "removed at the end)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    random_kills, result_kills, each_signal = (3, 2, 1) if args.quick else (18, 6, 5)
    rng = random.Random(args.seed)
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="autotune-fault-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    study_dir = out_dir / STUDY
    trials = result_kills + each_signal + (2 if args.quick else 6)
    command = [sys.executable, "-m", "autotune", "run", "--model", "tiny-qwen2.5",
               "--space", "cpu-demo", "--device", "cpu", "--gpu-memory-limit", "545MiB",
               "--warmup-steps", "0", "--timed-steps", "1", "--threads", "2",
               "--study", STUDY, "--results-dir", str(out_dir), "--trials", str(trials),
               "--seed", str(args.seed)]
    started_s = time.monotonic()

    def report(line: str) -> None:
        print(f"[{time.monotonic() - started_s:6.1f} s] {line}", flush=True)

    runs: list[Driver] = []
    plan = ["random"] * random_kills + ["result"] * result_kills
    rng.shuffle(plan)
    kills = driver_kills(command, study_dir, plan, rng, runs, report)
    signals = [signal.SIGKILL] * each_signal + [signal.SIGSEGV] * each_signal
    rng.shuffle(signals)
    sent = worker_kills(command, study_dir, signals, rng, runs, report)
    final = Driver(command)
    runs.append(final)
    final_rc = final.wait(timeout_s=1800)
    report(f"final clean run: rc {final_rc}, {final.lines[-1][1] if final.lines else ''}")
    orphans_end = live_workers(study_dir)
    checked = check_study(study_dir, sent)
    scratch = scratch_dirs_left({run.proc.pid for run in runs})
    latencies_s = [s for s in (run.seconds_to("probing trial") for run in runs[1:])
                   if s is not None]
    total_s = time.monotonic() - started_s

    n_kill = sum(name == "SIGKILL" for _, name in sent)
    n_segv = len(sent) - n_kill
    driver_total = kills["random"] + kills["result"]
    figures = {"lost": len(checked["lost"]), "duplicated": len(checked["duplicated"]),
               "stuck": len(checked["stuck"]), "orphaned": kills["orphaned"] + len(orphans_end),
               "false host_oom": checked["false_host_oom"],
               "scratch dirs left": len(scratch)}
    wanted = {"driver SIGKILLs": (driver_total, len(plan)),
              "right after a result": (kills["result"], result_kills),
              "worker SIGKILLs": (n_kill, each_signal), "worker SIGSEGVs": (n_segv, each_signal)}
    lines = [
        f"fault_injection: `autotune run` of the CPU demo SIGKILLed and resumed "
        f"({time.strftime('%Y-%m-%d')}, {'quick' if args.quick else 'default'} run, "
        f"seed {args.seed}, {total_s / 60:.1f} min)",
        f"machine: {platform.platform()}, {cpu_model()}, {len(os.sched_getaffinity(0))} cores",
        "benchmark: python benchmarks/fault_injection.py "
        f"{' '.join(sys.argv[1:]).replace(str(out_dir), 'DIR')}".rstrip(),
        f"command: {' '.join(['autotune', *command[3:]]).replace(str(out_dir), 'DIR')}",
        "",
        f"driver SIGKILLs {driver_total} ({kills['result']} right after a result was written, "
        f"{kills['untold']} of them before the driver told it), worker SIGKILLs {n_kill}, "
        f"worker SIGSEGVs {n_segv}; driver runs {len(runs)}, "
        f"{kills['ended_alone']} ended before their kill",
        f"processes under the killed drivers {kills['tree']} ({kills['traces_killed']} trace "
        f"processes); alive {ORPHAN_WAIT_S:.0f} s after the kill: {kills['orphaned']} "
        f"({kills['orphaned_traces']} trace processes)",
        "  ".join(f"{name} {value}" for name, value in figures.items()),
        f"misclassified worker kills {len(checked['misclassified'])}, SIGKILLed probes "
        f"retried {checked['retried']}/{checked['to_retry']}, predictions citing a "
        f"killed/crashed trial {len(checked['bad_predictions'])}",
        f"resume latency (start to first `probing trial`, {len(latencies_s)} resumes): "
        + (f"median {statistics.median(latencies_s):.1f} s, max {max(latencies_s):.1f} s"
           if latencies_s else "none measured"),
        f"final clean run: rc {final_rc}; study: {checked['trials']} trials; probed: "
        f"{checked['summary']}",
        "",
    ]
    misses = []
    for name, (got, need) in wanted.items():
        met = got >= need
        misses += [] if met else [name]
        lines.append(f"{name + ':':<24}{got:>4} (target >= {need}) {'met' if met else 'MISSED'}")
    for name, value in [*figures.items(),
                        ("misclassified", len(checked["misclassified"])),
                        ("bad predictions", len(checked["bad_predictions"])),
                        ("final run rc", final_rc)]:
        met = value == 0
        misses += [] if met else [name]
        lines.append(f"{name + ':':<24}{value:>4} (target 0) {'met' if met else 'MISSED'}")
    evidence = [*checked["lost"], *(f"duplicated: trials {d}" for d in checked["duplicated"]),
                *checked["stuck"], *checked["misclassified"], *checked["bad_predictions"],
                *(f"scratch dir left: {s}" for s in scratch),
                *(f"worker alive after the final run: pid {p.pid}" for p in orphans_end)]
    if evidence:
        lines += ["", "evidence:", *(f"  {e}" for e in evidence)]
    lines.append(f"verdict: {'all targets met' if not misses else 'MISSED: ' + ', '.join(misses)}")
    text = "\n".join(lines)
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "fault_injection.txt").write_text(text + "\n")
    if args.out is None:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
