"""Ctrl-C at a resumed sweep's first trace, 8 times in a row, beside one busy process per core.

Issue 65: an outside run saw 8 of 8 such Ctrl-Cs swallowed. A calibrated study (one probe) is
resumed 8 times; each time SIGINT goes to the driver's process group (as a terminal sends it)
when `tracing ...` first shows, after 0 to 3 s. Each stop is scored: rc 130, the one line, no
traceback, how long it took, whether the trace process outlived the driver, and whether any
trial was left RUNNING. A swallowed Ctrl-C is killed with SIGTERM after 60 s and counted.

    python benchmarks/ctrl_c_resume.py

Writes benchmarks/results/ctrl_c_resume.{txt,json}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import optuna
import psutil

OUT = Path(__file__).parent / "results"
DELAYS_S = (0.0, 0.05, 0.2, 0.5, 1.0, 1.5, 2.0, 3.0)
SPIN = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end: pass\n"
LINE = "Interrupted; nothing is lost. Resume with the same command (study S)."


def sigint_as_in_a_terminal() -> None:
    """SIGINT at its default in the driver, as for a command typed at a terminal: run in the
    background by a script, this benchmark and its drivers inherit SIGINT ignored, and Python
    keeps it so (the sweep then says Ctrl-C cannot reach it; tests/test_resume.py)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop_once(base: list[str], delay_s: float, storage: str) -> dict:
    driver = subprocess.Popen([*base, "--trials", "4"], stderr=subprocess.PIPE, text=True,
                              start_new_session=True, preexec_fn=sigint_as_in_a_terminal)
    assert driver.stderr is not None
    for line in driver.stderr:
        if "tracing" in line:
            break
    time.sleep(delay_s)
    tree = psutil.Process(driver.pid).children(recursive=True)
    os.killpg(driver.pid, signal.SIGINT)
    sent = time.monotonic()
    try:
        rc = driver.wait(timeout=60)
    except subprocess.TimeoutExpired:
        driver.terminate()
        rc = driver.wait()
    took_s = time.monotonic() - sent
    rest = driver.stderr.read()
    time.sleep(2)
    left = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    running = [t.number for t in optuna.load_study(study_name="S", storage=storage).trials
               if t.state.name == "RUNNING"]
    lines = rest.strip().splitlines()
    return {"delay_s": delay_s, "rc": rc, "took_s": round(took_s, 2),
            "one_line": bool(lines) and lines[-1] == LINE, "traceback": "Traceback" in rest,
            "left_running": left, "trials_running": running,
            "stopped": rc == 130 and took_s < 10 and not left and not running}


def main() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        base = [sys.executable, "-m", "autotune", "run", "--results-dir", folder, "--study",
                "S", "--finalists", "0", "--timed-steps", "1", "--warmup-steps", "0"]
        subprocess.run([*base, "--trials", "1"], check=True, capture_output=True)
        storage = f"sqlite:///{Path(folder) / 'S' / 'study.db'}"
        busy = [subprocess.Popen([sys.executable, "-c", SPIN, "900"])
                for _ in range(os.cpu_count() or 1)]
        try:
            rows = [stop_once(base, delay, storage) for delay in DELAYS_S]
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
    stopped = sum(row["stopped"] for row in rows)
    text = "\n".join([f"ctrl_c_resume ({date.today()}, {os.cpu_count()} cores, one busy "
                      f"process per core): {stopped} of {len(rows)} Ctrl-Cs stopped the sweep",
                      *(json.dumps(row) for row in rows)])
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "ctrl_c_resume.txt").write_text(text + "\n")
    (OUT / "ctrl_c_resume.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
