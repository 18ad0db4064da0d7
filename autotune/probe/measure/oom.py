"""Classify how a probe ended: the only module that knows what an OOM looks like.

Pure functions over an exception, an exit code and a stderr tail. Everything else asks here
and never greps failure text itself. Only the OOM classes mark a configuration infeasible.
"""

from __future__ import annotations

import re
import signal

from autotune.probe.measure.result import ProbeStatus

# Order matters: the rollout engine's and Ray's messages must win over the generic ones
# (Ray's "OutOfMemoryError" is host memory; vLLM's cache errors mention GPU memory).
_PATTERNS: tuple[tuple[ProbeStatus, re.Pattern[str]], ...] = tuple(
    (status, re.compile(pattern, re.IGNORECASE | re.MULTILINE)) for status, pattern in [
        # vLLM / SGLang: not enough memory left for the KV cache at engine start.
        (ProbeStatus.CACHE_OOM, r"No available memory for the cache blocks"),
        (ProbeStatus.CACHE_OOM, r"maximum number of tokens that can be stored in KV cache"),
        (ProbeStatus.CACHE_OOM, r"less than desired GPU memory utilization"),
        (ProbeStatus.CACHE_OOM, r"Insufficient memory to allocate KV cache|KV cache is needed, "
                                r"which is larger than the available KV cache memory"),
        (ProbeStatus.CACHE_OOM, r"Not enough memory\. Please try to increase "
                                r"--mem-fraction-static"),
        # Host RAM: Ray's memory monitor, the kernel's OOM killer, CPU allocator failures.
        (ProbeStatus.HOST_OOM, r"ray\.exceptions\.OutOfMemoryError|OutOfMemoryError: Task was "
                               r"killed due to the node running low on memory"),
        (ProbeStatus.HOST_OOM, r"node running low on memory|killed due to .*low on memory"),
        (ProbeStatus.HOST_OOM, r"RAY_memory_usage_threshold|memory usage threshold"),
        (ProbeStatus.HOST_OOM, r"killed (by SIGKILL )?by (the )?OOM killer|K8s pod memory limit"),
        (ProbeStatus.HOST_OOM, r"Out of memory: Kill(ed)? process|oom-kill|oom_reaper"),
        (ProbeStatus.HOST_OOM, r"DefaultCPUAllocator: (can't allocate memory|not enough memory)"),
        (ProbeStatus.HOST_OOM, r"^\s*MemoryError\b|\bMemoryError: Unable to allocate"),
        (ProbeStatus.HOST_OOM, r"host memory limit exceeded"),
        # Device memory: PyTorch's allocator, CUDA runtime, cuBLAS/cuDNN, ROCm.
        (ProbeStatus.GPU_OOM, r"CUDA out of memory|OutOfMemoryError: CUDA"),
        (ProbeStatus.GPU_OOM, r"CUDA (runtime )?error( \(2\))?\s*:\s*out of memory"),
        (ProbeStatus.GPU_OOM, r"cudaErrorMemoryAllocation"),
        (ProbeStatus.GPU_OOM, r"CUBLAS_STATUS_ALLOC_FAILED|CUDNN_STATUS_ALLOC_FAILED"),
        (ProbeStatus.GPU_OOM, r"Cuda failure '?out of memory'?|NCCL.*out of memory"),
        (ProbeStatus.GPU_OOM, r"HIP out of memory|hipErrorOutOfMemory"),
        (ProbeStatus.GPU_OOM, r"device memory limit exceeded"),
        # A SIGKILL and nothing else: what a shell, torchrun or a DataLoader prints for any
        # SIGKILL. The OOM killer is one possible sender among others (a user, a scheduler);
        # classify_exit makes it host_oom only with evidence.
        (ProbeStatus.KILLED, r"^Killed\s*$|killed by signal: Killed"),
        (ProbeStatus.KILLED, r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\) received"),
    ]
)

_INVALID_TYPES = ("ConfigError", "UnknownModelError")


def classify_text(text: str) -> ProbeStatus | None:
    """The OOM class a failure text shows, `killed` for a bare SIGKILL, or None."""
    for status, pattern in _PATTERNS:
        if pattern.search(text) is not None:
            return status
    return None


def classify_exception(exc: BaseException) -> tuple[ProbeStatus, str]:
    """Status and one-line message for an exception raised inside a probe."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    message = summarize(f"{type(exc).__name__}: {exc}")
    if names & set(_INVALID_TYPES):
        return ProbeStatus.INVALID, summarize(str(exc))
    if isinstance(exc, MemoryError):
        return ProbeStatus.HOST_OOM, message
    status = classify_text(f"{type(exc).__module__}.{type(exc).__name__}: {exc}")
    if status is None and "OutOfMemoryError" in names:  # torch.OutOfMemoryError, any device
        status = ProbeStatus.GPU_OOM
    return status or ProbeStatus.CRASH, message


def classify_exit(returncode: int | None, stderr_tail: str, *, timed_out: bool = False,
                  host_limit_exceeded: bool = False,
                  oom_evidence: str | None = None) -> tuple[ProbeStatus, str]:
    """Status and message for a probe process that ended without writing its result.

    A SIGKILL is a host OOM only with `oom_evidence` (runners/oom_evidence.py: the kernel log
    or the cgroup's OOM-kill count); otherwise the probe was `killed` from outside, which says
    nothing about the config. A "Killed" line or exit code -9 in a log is no evidence either:
    it is what any SIGKILL prints.
    """
    if timed_out:
        return ProbeStatus.TIMEOUT, "probe exceeded its timeout and was killed"
    if host_limit_exceeded:
        return ProbeStatus.HOST_OOM, "host memory limit exceeded: probe tree killed by watchdog"
    status = classify_text(stderr_tail)
    if status is ProbeStatus.KILLED or (status is None and returncode == -signal.SIGKILL):
        if oom_evidence:
            return ProbeStatus.HOST_OOM, f"killed by SIGKILL: {oom_evidence}"
        what = summarize(stderr_tail) if status else "killed by SIGKILL"
        return ProbeStatus.KILLED, (f"{what}, from outside autotune and with no sign of "
                                    "memory exhaustion (no OOM-killer record, no cgroup OOM "
                                    "kill)")
    if status is not None:
        return status, summarize(stderr_tail)
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else ""
        return ProbeStatus.CRASH, f"killed by signal {-returncode} {name}".strip()
    last = summarize(stderr_tail)
    return ProbeStatus.CRASH, f"exit code {returncode}" + (f": {last}" if last else "")


def summarize(text: str, max_chars: int = 300) -> str:
    """The most telling line of a failure text: the last exception-looking line, shortened."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    chosen = lines[-1]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exit)\b|^[\w.]+: ", line):
            chosen = line
            break
    return chosen if len(chosen) <= max_chars else chosen[: max_chars - 3] + "..."
