"""The exceptions autotune raises for bad input, each with a message that says what to do."""

from __future__ import annotations


class AutotuneError(Exception):
    """Root of every error autotune reports to the user as one line (exit code 2 for usage)."""

    exit_code = 1


class ConfigError(AutotuneError):
    """Bad user input: an unknown key, a bad value, a file that does not parse.

    Holds every problem found, so one run reports them all.
    """

    exit_code = 2

    def __init__(self, problems: list[str] | str) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class UnknownModelError(ConfigError):
    """A model name that is not in the registry."""


class RunnerError(AutotuneError):
    """The runner itself is broken (not a probe failure: those are ProbeResults)."""
