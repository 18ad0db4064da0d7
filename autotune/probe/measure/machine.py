"""How busy the machine was while a probe timed its steps, and whether that makes it contended.

A tuner ranks measurements, and a step timed while another process took the cores (or the
GPU) measures the other process too. `MachineWatch` is started before the timed steps and
stopped after them. It reads, over that window:

- the cores the whole machine kept busy (/proc/stat, through psutil), less the CPU time of
  the probe's own processes (the process tree of the probe, and every process carrying the
  probe's tag: a real multi-rank probe's other ranks, an engine it started): what *other*
  processes used, in cores;
- the 1-minute load average at the end;
- on a GPU, through NVML: processes on the probe's card that are not the probe's, and the SM
  clock against its maximum (a throttled card measures slow).

`contention` is the one rule that calls a probe contended (CONTENDED_SHARE below); trials.csv,
`show` and the report read the flag it sets. Torch-free, psutil only; NVML where there is one.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import psutil

from autotune.process_tag import PROBE_TAG_ENV, tagged_processes

# Other processes using at least this share of the machine's cores (and never less than half a
# core) make a probe contended; so does any load that leaves the probe fewer idle cores than
# threads it runs, and any other process on its GPU.
CONTENDED_SHARE = 0.25
CONTENDED_MIN_CORES = 0.5


@dataclass(frozen=True)
class MachineState:
    """What the machine did besides the probe while it timed its steps."""

    window_s: float
    cpu_count: int
    probe_threads: int  # the threads the probe computes with
    others_cpu_cores: float  # mean cores other processes kept busy over the window
    load_avg_1m: float
    gpu_other_processes: int | None = None  # None: not on a GPU, or no NVML
    gpu_sm_clock_mhz: int | None = None
    gpu_max_sm_clock_mhz: int | None = None

    def contention(self) -> str | None:
        """Why this probe's time is not its own, in a few words; None when the machine was
        quiet enough."""
        reasons = []
        spare = self.cpu_count - self.probe_threads
        if self.others_cpu_cores >= max(CONTENDED_MIN_CORES, CONTENDED_SHARE * self.cpu_count) \
                or (self.others_cpu_cores >= CONTENDED_MIN_CORES
                    and self.others_cpu_cores > spare):
            reasons.append(f"other processes used {self.others_cpu_cores:.1f} of "
                           f"{self.cpu_count} cores")
        if self.gpu_other_processes:
            reasons.append(f"{self.gpu_other_processes} other process(es) on the GPU")
        return "; ".join(reasons) or None

    def as_dict(self) -> dict[str, float]:
        data = {"window_s": round(self.window_s, 3), "cpu_count": self.cpu_count,
                "probe_threads": self.probe_threads,
                "others_cpu_cores": round(self.others_cpu_cores, 3),
                "load_avg_1m": round(self.load_avg_1m, 2),
                "gpu_other_processes": self.gpu_other_processes,
                "gpu_sm_clock_mhz": self.gpu_sm_clock_mhz,
                "gpu_max_sm_clock_mhz": self.gpu_max_sm_clock_mhz}
        return {k: v for k, v in data.items() if v is not None}


def busy_cpu_s() -> float:
    """Seconds of CPU the whole machine has spent busy since boot (all but idle and iowait)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


class MachineWatch:
    """Started before the timed steps, stopped after: the machine's state over that window."""

    def __init__(self, probe_threads: int, gpu_index: int | None = None) -> None:
        self.probe_threads = probe_threads
        self.gpu_index = gpu_index  # the card's NVML index (physical), when on a GPU
        self.started_s = 0.0
        self.busy_start_s = 0.0
        self.own_start: dict[int, float] = {}

    def own_processes(self) -> dict[int, psutil.Process]:
        """The probe's processes: this one, its descendants, and every process carrying the
        probe's tag (a multi-rank probe's other ranks are its launcher's children)."""
        me = psutil.Process()
        procs = {me.pid: me}
        with contextlib.suppress(psutil.Error):
            procs.update({p.pid: p for p in me.children(recursive=True)})
        tag = os.environ.get(PROBE_TAG_ENV)
        if tag:
            procs.update({p.pid: p for p, _ in tagged_processes(tag)})
        return procs

    @staticmethod
    def cpu_s(procs: dict[int, psutil.Process]) -> dict[int, float]:
        seconds = {}
        for pid, proc in procs.items():
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                seconds[pid] = t.user + t.system
        return seconds

    def start(self) -> None:
        self.own_start = self.cpu_s(self.own_processes())
        self.busy_start_s = busy_cpu_s()
        self.started_s = time.monotonic()

    def stop(self) -> MachineState:
        """The machine's state over the window from `start` to now (a call mid-window reads
        it so far: nothing is reset)."""
        window_s = max(time.monotonic() - self.started_s, 1e-6)
        busy_s = busy_cpu_s() - self.busy_start_s
        own_end = self.cpu_s(self.own_processes())
        own_s = sum(own_end[pid] - self.own_start.get(pid, 0.0) for pid in own_end)
        others = max(0.0, busy_s - own_s) / window_s
        gpu = self.gpu_state()
        return MachineState(window_s=window_s, cpu_count=psutil.cpu_count() or 1,
                            probe_threads=self.probe_threads, others_cpu_cores=others,
                            load_avg_1m=os.getloadavg()[0], **gpu)

    def gpu_state(self) -> dict[str, int]:
        """Other processes on the probe's card, and its SM clock; empty without NVML."""
        if self.gpu_index is None:
            return {}
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.gpu_index)
            own = set(self.own_processes())
            pids = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            state = {"gpu_sm_clock_mhz": int(pynvml.nvmlDeviceGetClockInfo(
                        handle, pynvml.NVML_CLOCK_SM)),
                    "gpu_max_sm_clock_mhz": int(pynvml.nvmlDeviceGetMaxClockInfo(
                        handle, pynvml.NVML_CLOCK_SM))}
            if pids & own:  # in a container NVML names host pids: others are then unknown
                state["gpu_other_processes"] = len(pids - own)
            return state
        except Exception:  # no NVML, or a process it cannot see (containers): said as unknown
            return {}
