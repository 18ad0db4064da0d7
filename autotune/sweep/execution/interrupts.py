"""Ctrl-C and SIGTERM during a sweep: never lost, whatever code they land in.

Python raises a Ctrl-C (and the CLI's SIGTERM, raised as one) as a KeyboardInterrupt wherever
the main thread is. Some code drops it there: an exception raised in a `__del__`, a weakref
callback (a sqlalchemy connection's cleanup) or an at-fork hook (logging's lock release) is
printed as "Exception ignored in ..." and the sweep would go on probing. Two rules stop that:

- `recorded()`, around a whole sweep (run_sweep): each such signal whose handler raises is
  recorded, and the sweep calls `raise_if_interrupted()` at least once a second and before
  it starts a probe, so a dropped KeyboardInterrupt is raised again where it is handled.
- `interrupts_held()`, around a fork: the signals are held inside and raised on the way out.

Code that catches the interrupt, logs it with its traceback and raises it on (a sqlalchemy
pool's cleanup: "Exception during reset or similar", once in 31 Ctrl-Cs an outside run sent)
prints a traceback for a stop the command says in one line: `no_interrupt_tracebacks` drops
such records from a library's logger.

A process started in the background by a script inherits SIGINT ignored (the shell does it, so
that the script's Ctrl-C spares its background jobs) and Python keeps it so: no Ctrl-C reaches
it, by design; SIGTERM does. `unreachable_note()` says so, once a sweep has started.

Both act in the main thread only (the only one signal handlers run in); elsewhere they do
nothing. Imports nothing of autotune's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_received: list[int] = []  # the signals recorded inside recorded(), in order


def _python_handlers() -> dict[signal.Signals, Callable[[int, FrameType | None], Any]]:
    """The handlers Python code set for SIGNALS (not SIG_DFL or SIG_IGN), by signal."""
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}
    return {signum: handler for signum, handler in handlers.items() if callable(handler)}


def _restore(handlers: dict[signal.Signals, Callable[[int, FrameType | None], Any]]) -> None:
    """Put `handlers` back as one step: SIGNALS are blocked meanwhile (one that arrives is
    delivered, to its restored handler, once all are back), so a Ctrl-C mid-way never leaves
    the other signal on a handler of this module's."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


@contextlib.contextmanager
def recorded() -> Iterator[None]:
    """Inside, SIGINT and SIGTERM (where Python handles them) are handled as before, and
    one whose handler raised (Ctrl-C's KeyboardInterrupt, the CLI's SIGTERM) is recorded;
    `raise_if_interrupted` raises again for it. A handler that does not raise (a library
    user's own) is left to do what it does. Nothing recorded outlives the block; blocks do
    not nest (one sweep at a time in a process)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _python_handlers()

    def record(number: int, frame: FrameType | None) -> None:
        try:
            previous[signal.Signals(number)](number, frame)
        except BaseException:
            _received.append(number)
            raise

    _received.clear()
    for signum in previous:
        signal.signal(signum, record)
    try:
        yield
    finally:
        _restore(previous)
        _received.clear()


def unreachable_note() -> str | None:
    """The line a sweep says when it starts in a process that ignores SIGINT (a script's
    background job): Ctrl-C cannot stop it, and what does; None where Ctrl-C reaches it."""
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        return None
    return ("Ctrl-C does not reach this sweep (started in the background by a script, which "
            f"ignores it): stop it with `kill {os.getpid()}`")


def raise_if_interrupted() -> None:
    """KeyboardInterrupt if a signal was recorded (its own raise may have been dropped)."""
    if _received:
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM (where a Python handler takes them: Ctrl-C, the CLI's SIGTERM) held
    inside: recorded, then raised by their own handler on the way out. A fork runs Python's
    at-fork hooks (logging's lock release), and an exception raised inside one is printed and
    dropped ("Exception ignored in _releaseLock"): a Ctrl-C that lands in a fork would be lost
    and the sweep would go on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = _python_handlers()
    for signum in previous:
        signal.signal(signum, lambda number, _frame: held.append(number))
    try:
        yield
    finally:
        _restore(previous)
        for number in held[:1]:  # the first one: its handler raises (KeyboardInterrupt)
            previous[signal.Signals(number)](number, None)


class _NoInterrupts(logging.Filter):
    """Passes a record unless it carries a KeyboardInterrupt's traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def no_interrupt_tracebacks(logger_name: str) -> None:
    """Records of `logger_name` (and its children) that carry a KeyboardInterrupt are dropped;
    the rest are printed to stderr as Python prints an unconfigured logger's warnings. For a
    command's process only: the logger stops passing its records to the root's handlers."""
    logger = logging.getLogger(logger_name)
    if any(isinstance(f, _NoInterrupts) for h in logger.handlers for f in h.filters):
        return
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.addFilter(_NoInterrupts())
    logger.addHandler(handler)
    logger.propagate = False
