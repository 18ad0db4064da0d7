"""Why a probe died of SIGKILL: the kernel's OOM killer, or somebody else.

A SIGKILL by itself says nothing about memory: a user's `kill -9`, a scheduler pre-empting a
job, a node draining. Calling every SIGKILL a host OOM would teach the sweep a memory wall
that is not there (and prune configs by it). So a SIGKILLed probe counts as a host OOM only
with evidence, looked up here:

- the kernel log (/dev/kmsg) names a process of the probe as killed by the OOM killer
  ("Killed process PID" / "oom-kill: ... pid=PID"), or
- the oom_kill counter of the probe's memory cgroup (v2 memory.events, v1 memory.oom_control)
  rose while the probe ran (a container's or a job's memory limit).

Our own watchdog (--host-memory-limit) and Ray's memory monitor say so themselves and never
get here. Without evidence the probe was `killed`: a failure that teaches nothing about the
config. Imports nothing of autotune.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KMSG_PATH = "/dev/kmsg"
_KILLED_PID = re.compile(r"Killed process (\d+)|oom-kill:.*?\bpid=(\d+)")


def cgroup_oom_file(pid: int | str = "self") -> Path | None:
    """The file holding the oom_kill counter of the memory cgroup `pid` lives in."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0" and controllers == "":  # cgroup v2: one unified tree
                candidate = CGROUP_ROOT / path.lstrip("/") / "memory.events"
            elif "memory" in controllers.split(","):  # cgroup v1: the memory controller's tree
                candidate = CGROUP_ROOT / "memory" / path.lstrip("/") / "memory.oom_control"
            else:
                continue
            if candidate.is_file():
                return candidate
    return None


def oom_kill_count(path: Path | None) -> int | None:
    """The `oom_kill N` line of a memory.events or memory.oom_control file."""
    if path is None:
        return None
    with contextlib.suppress(OSError, ValueError):
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return None


def kernel_oom_killed_pids(kmsg_path: str = KMSG_PATH) -> set[int] | None:
    """PIDs the kernel log says the OOM killer killed (None when the log cannot be read:
    not root with dmesg_restrict, or no /dev/kmsg)."""
    try:
        fd = os.open(kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    pids: set[int] = set()
    try:
        while True:
            try:
                record = os.read(fd, 8192)  # one record per read
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
            if not record:
                break
            for match in _KILLED_PID.finditer(record.decode("utf-8", "replace")):
                pids.add(int(match.group(1) or match.group(2)))
    finally:
        os.close(fd)
    return pids


class OOMWitness:
    """Taken when a probe starts; asked, if the probe dies of SIGKILL, for evidence of OOM."""

    def __init__(self, pid: int | str = "self") -> None:
        self.cgroup_file = cgroup_oom_file(pid)
        self.cgroup_kills_before = oom_kill_count(self.cgroup_file)

    def evidence(self, probe_pids: set[int]) -> str | None:
        """One line saying what shows the probe ran out of host memory, or None."""
        killed = kernel_oom_killed_pids()
        hit = sorted(probe_pids & killed) if killed else []
        if hit:
            return (f"the kernel's OOM killer killed the probe's process {hit[0]} "
                    "(kernel log)")
        after = oom_kill_count(self.cgroup_file)
        if after is not None and self.cgroup_kills_before is not None and \
                after > self.cgroup_kills_before:
            return (f"its memory cgroup's oom_kill count rose from {self.cgroup_kills_before} "
                    f"to {after} ({self.cgroup_file})")
        return None
