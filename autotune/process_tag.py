"""The lifetime of every process a probe starts: it dies with its parent, and it carries a tag
in its environment by which it is found and ended.

A child started by the driver (a probe's worker, the sweep's trace process) or by a probe's
launcher (its ranks) gets its parent's death as a SIGKILL (`die_with_parent`), so nothing
outlives a driver killed with SIGKILL.

A trainer's run leaves processes that are not its children: Ray's raylet and its workers, a
vLLM engine, anything that called setsid. Killing a process group misses them. So the runner
gives each probe an environment variable, PROBE_TAG_ENV =
`<driver pid>.<driver start>.<scope>.<id>`,
that every process it starts inherits (Ray passes its driver's environment to the workers it
spawns), and after the probe every process of this user that carries that value is killed.
A driver killed with SIGKILL cannot clean up: the next sweep of the same study, when its first
probe starts, kills the processes tagged with its scope whose driver is gone. On the ground
floor, torch-free: the runners, the sweep and the probe's processes all use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import secrets
import signal
import time
from collections.abc import Iterator

import psutil

PROBE_TAG_ENV = "AUTOTUNE_PROBE_TAG"
KILL_WAIT_S = 5.0
TREE_REFRESH_S = 0.25  # how often a watchdog looks for new processes in the probe's tree
TAG_SCAN_S = 1.0  # how often it looks for the probe's processes outside its tree


def die_with_parent(parent_pid: int) -> None:
    """In a child before exec: SIGKILL it when its parent (the driver, or a probe's launcher)
    dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)


def tag_scope(name: str) -> str:
    """The scope a study's probes are tagged with: a short digest of its name."""
    return hashlib.sha256(name.encode()).hexdigest()[:12]


def new_tag(scope: str = "") -> str:
    """A tag for one probe, naming the driver that owns it (pid and start time) and the scope
    it runs in (tag_scope of its study; "" for a probe of its own)."""
    me = psutil.Process()
    return f"{me.pid}.{int(me.create_time())}.{scope}.{secrets.token_hex(6)}"


def tag_owner_alive(tag: str) -> bool:
    """Whether the driver named in `tag` still runs (the same process, not a reused pid)."""
    try:
        pid_text, started_text = tag.split(".")[:2]
        owner = psutil.Process(int(pid_text))
        return int(owner.create_time()) == int(started_text)
    except (ValueError, psutil.Error):
        return False


def tagged_processes(tag: str | None = None) -> Iterator[tuple[psutil.Process, str]]:
    """This user's processes that carry a probe tag (`tag` only, when given), with the tag.
    A process whose environment cannot be read (another user's, or gone) is skipped."""
    me = os.getpid()
    uid = os.getuid()
    for proc in psutil.process_iter(["pid", "uids"]):
        if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
            continue
        try:
            found = proc.environ().get(PROBE_TAG_ENV)
        except (psutil.Error, OSError):
            continue
        if found and (tag is None or found == tag):
            yield proc, found


def kill_processes(procs: list[psutil.Process]) -> int:
    """SIGKILL `procs` and wait until they are gone (at most KILL_WAIT_S); how many there were."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=KILL_WAIT_S)
    return len(procs)


def kill_tagged(tag: str, spare: tuple[int, ...] = ()) -> int:
    """Kill every process carrying `tag` (but the pids in `spare`); how many were killed.
    Looks twice: a process starting a child as it is killed leaves the child behind."""
    killed = 0
    for _ in range(2):
        procs = [proc for proc, _ in tagged_processes(tag) if proc.pid not in spare]
        if not procs:
            break
        killed += kill_processes(procs)
        time.sleep(0.05)
    return killed


def kill_orphaned(scope: str) -> int:
    """Kill the processes tagged in `scope` whose driver is gone (it was SIGKILLed mid-probe):
    a study's own leftovers, never another study's."""
    orphans = [proc for proc, tag in tagged_processes()
               if tag.split(".")[2:3] == [scope] and not tag_owner_alive(tag)]
    return kill_processes(orphans) if orphans else 0


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def read_statm_bytes(pid: int | str = "self") -> tuple[int, int]:
    """(resident, anonymous) bytes of one process, from /proc/PID/statm.

    Anonymous, the resident pages less the file-backed and shared ones, is what every probe
    on a CPU calls device memory: the built-in probe's own process (meter.py) and the command
    probe's trainer processes (ProcessTree), so their figures compare. File-backed pages
    (the libraries' code, a memory-mapped safetensors checkpoint) are the page cache's, which
    the kernel drops under pressure; the built-in's offloaded tensors are shared memory, the
    host's. Raises OSError when the process is gone."""
    with open(f"/proc/{pid}/statm") as handle:
        fields = handle.read().split()
    resident, shared = int(fields[1]), int(fields[2])
    return resident * _PAGE_BYTES, (resident - shared) * _PAGE_BYTES


def read_anon_peak_bytes(pid: int | str = "self") -> int:
    """The anonymous RSS's peak since the last reset of the kernel's high-water mark, as near
    as the kernel tells it: VmHWM, the exact peak of all resident pages, less the file-backed
    and shared ones now (read_statm_bytes), and never less than the anonymous RSS now. A
    sampled reading misses a peak shorter than its interval (a fused LM head's tiles live for
    milliseconds); this one does not. Raises OSError when the process is gone."""
    hwm = 0
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
                break
    resident, anonymous = read_statm_bytes(pid)
    return max(anonymous, hwm - (resident - anonymous))


def sample_interval_s(on_gpu: bool) -> float:
    """How often every probe reads its device figure (the built-in's meter and the command
    probe alike, one definition of the peak): 2 ms on a CPU, where a fused head's tiles live
    for milliseconds; 10 ms on a GPU (NVML and the allocator's own peak)."""
    return 0.01 if on_gpu else 0.002


class ProcessTree:
    """A probe's processes and their summed RSS (and anonymous RSS, the CPU device figure:
    read_statm_bytes): the root, its descendants, and (with a tag)
    every process carrying the tag outside the tree (a trainer's Ray workers). Listing
    descendants scans every process of the machine (about 1 ms), so the list is refreshed
    every TREE_REFRESH_S, and reading environments to find tagged processes every TAG_SCAN_S;
    reading the RSS of known processes each poll costs tens of microseconds (parallel probes
    share the cores with their watchdogs)."""

    def __init__(self, root: psutil.Process, tag: str | None = None) -> None:
        self.root, self.tag = root, tag
        self.members: dict[int, psutil.Process] = {root.pid: root}
        self.listed_at = self.scanned_at = -math.inf
        self.seen_pids = {root.pid}  # every process ever in the tree (OOM-killer evidence)
        self.peak_rss_bytes = 0
        self.anon_rss_bytes = 0  # of the last reading
        self.peak_anon_rss_bytes = 0  # sampled, and each process's kernel high-water mark

    def rss_bytes(self) -> int:
        """RSS of every process of the probe now (processes that vanish count as zero); the
        anonymous part is kept in `anon_rss_bytes`."""
        now = time.monotonic()
        if now - self.listed_at >= TREE_REFRESH_S:
            self.listed_at = now
            with contextlib.suppress(psutil.Error):
                for child in self.root.children(recursive=True):
                    self.members.setdefault(child.pid, child)
        if self.tag and now - self.scanned_at >= TAG_SCAN_S:
            self.scanned_at = now
            for proc, _ in tagged_processes(self.tag):
                self.members.setdefault(proc.pid, proc)
        self.seen_pids.update(self.members)
        total = anonymous = anonymous_peaks = 0
        for pid in list(self.members):
            try:
                resident, anon = read_statm_bytes(pid)
                peak = read_anon_peak_bytes(pid)
            except OSError:
                if pid != self.root.pid:
                    del self.members[pid]
                continue
            total, anonymous = total + resident, anonymous + anon
            anonymous_peaks += peak
        self.peak_rss_bytes = max(self.peak_rss_bytes, total)
        self.anon_rss_bytes = anonymous
        self.peak_anon_rss_bytes = max(self.peak_anon_rss_bytes, anonymous, anonymous_peaks)
        return total
