"""Child processes that take Ctrl-C as a terminal's foreground job does.

A test suite started in the background by a script (as a CI runner may start it) inherits
SIGINT ignored, its children too, and Python keeps an ignored SIGINT: a test that sends SIGINT
to such a child would see it ignored, by design (tests/test_resume.py holds that the sweep says
so). Tests of Ctrl-C start their drivers with `preexec_fn=sigint_as_in_a_terminal`.
"""

from __future__ import annotations

import signal


def sigint_as_in_a_terminal() -> None:
    """In a child before it runs its program: SIGINT back to its default, so Python turns it
    into KeyboardInterrupt, as it does for a command typed at a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
