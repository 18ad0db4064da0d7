"""A sweep driver killed mid-sweep: `autotune run` as a subprocess, SIGKILLed once some of its
trials have finished (the resume tests of test_sweep_e2e.py and test_ppo.py)."""

from __future__ import annotations

import csv
import signal
import subprocess
import time
from pathlib import Path

import psutil


def kill_after_trials(command: list[str], trials_csv: Path, count: int, settle_s: float = 0.0,
                      timeout_s: float = 300.0) -> list[psutil.Process]:
    """Run `command`, SIGKILL it `settle_s` after `count` trials finished (trials.csv says
    so), and return its probes still alive 10 s after the kill."""
    driver = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, finished = time.monotonic() + timeout_s, 0
    while finished < count and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.5)
        if trials_csv.exists():
            finished = sum(1 for r in csv.DictReader(open(trials_csv))
                           if r["state"] in ("complete", "fail"))
    assert finished >= count, driver.stderr.read().decode()[-2000:]
    time.sleep(settle_s)
    probes = psutil.Process(driver.pid).children(recursive=True)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    return psutil.wait_procs(probes, timeout=10)[1]
