"""A driver's heartbeat on a shared study, beaten from a thread of its own.

Other drivers take a running trial over once its last sign of life is STALE_AFTER_HEARTBEATS
heartbeats old (sharing.py). A driver can be busy for longer than that between two turns of
its loop: tracing a candidate (18-75 s on a loaded 2-core machine), waiting for a fork server's
imports, probing finalists again. So the trials it holds (probing, waiting for an owner, ready,
the one being asked) are beaten from here every `every_s`, whatever the loop is doing; the loop
only says which trials it holds (`hold`, `add`). Optuna's storages take writes from several
threads (the journal's under its lock, a database's in a session per thread). A trial that was
told or taken over meanwhile refuses the write, which is ignored: its driver learns that when it
tells it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from optuna import Trial
    from optuna.storages import BaseStorage

HEARTBEAT_ATTR = "heartbeat_at"  # a trial's user attr: when its driver last said it is alive


class Heartbeat:
    """Beats `heartbeat_at` of the trials a driver holds, every `every_s`, from a daemon
    thread (started by `start`, ended by `stop`)."""

    def __init__(self, storage: BaseStorage, every_s: float) -> None:
        self.storage = storage
        self.every_s = every_s
        self.held: dict[int, int] = {}  # trial number -> its storage id
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def hold(self, trials: Iterable[Trial]) -> None:
        """Beat for these trials from now on (and no others)."""
        held = {trial.number: trial._trial_id for trial in trials}
        with self.lock:
            self.held = held

    def add(self, trial: Trial) -> None:
        """Beat for this trial too (one being asked: its trace may take a while)."""
        with self.lock:
            self.held[trial.number] = trial._trial_id

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="autotune-heartbeat",
                                       daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=max(5.0, 2 * self.every_s))

    def beat(self) -> None:
        """One beat for every trial held."""
        with self.lock:
            ids = list(self.held.values())
        now_s = time.time()
        for trial_id in ids:
            with contextlib.suppress(Exception):  # told or taken over meanwhile
                self.storage.set_trial_user_attr(trial_id, HEARTBEAT_ATTR, now_s)

    def _run(self) -> None:
        while not self.stopping.wait(self.every_s):
            self.beat()
