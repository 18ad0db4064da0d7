"""oom.py against a table of real captured failure messages and real exceptions."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch
import yaml

from autotune.errors import ConfigError
from autotune.probe.measure.oom import classify_exception, classify_exit, classify_text, summarize
from autotune.probe.measure.result import ProbeStatus

CAPTURED = yaml.safe_load((Path(__file__).parent / "data" / "captured_failures.yaml").read_text())


def test_table_covers_every_failure_class():
    statuses = {case["status"] for case in CAPTURED}
    assert statuses == {"gpu_oom", "host_oom", "cache_oom", "crash", "killed"}
    assert len(CAPTURED) >= 30


@pytest.mark.parametrize("case", CAPTURED, ids=[c["source"].split("github.com/")[-1]
                                                for c in CAPTURED])
def test_captured_message(case):
    status, message = classify_exit(1, case["text"])
    assert status.value == case["status"], case["text"]
    assert message  # always one line to show


def test_memory_words_that_are_not_oom():
    for text in ["RuntimeError: CUDA error: an illegal memory access was encountered",
                 "RuntimeError: Pin memory thread exited unexpectedly",
                 "RuntimeError: Expected all tensors to be on the same device"]:
        assert classify_text(text) is None


def test_real_torch_cpu_allocation_failure_is_host_oom():
    with pytest.raises(RuntimeError) as info:
        torch.empty(2**62, dtype=torch.uint8)
    status, message = classify_exception(info.value)
    assert status is ProbeStatus.HOST_OOM, message


def test_exception_classes():
    assert classify_exception(MemoryError())[0] is ProbeStatus.HOST_OOM
    assert classify_exception(ConfigError("bad knob"))[0] is ProbeStatus.INVALID
    assert classify_exception(ValueError("shape mismatch"))[0] is ProbeStatus.CRASH

    class OutOfMemoryError(RuntimeError):  # same name as torch's, no CUDA needed
        pass

    status, _ = classify_exception(OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert status is ProbeStatus.GPU_OOM


def test_exit_without_result():
    assert classify_exit(None, "", timed_out=True)[0] is ProbeStatus.TIMEOUT
    assert classify_exit(-9, "", host_limit_exceeded=True)[0] is ProbeStatus.HOST_OOM
    # a SIGKILL is a host OOM only with evidence; "Killed" in a log is what any SIGKILL prints
    assert classify_exit(-signal.SIGKILL, "")[0] is ProbeStatus.KILLED
    assert classify_exit(-signal.SIGKILL, "Killed\n")[0] is ProbeStatus.KILLED
    assert classify_exit(-signal.SIGKILL, "exitcode  : -9\n")[0] is ProbeStatus.KILLED
    status, message = classify_exit(-signal.SIGKILL, "", oom_evidence="the kernel log says so")
    assert status is ProbeStatus.HOST_OOM and "the kernel log says so" in message
    status, message = classify_exit(-signal.SIGSEGV, "")
    assert status is ProbeStatus.CRASH and "SIGSEGV" in message
    status, message = classify_exit(3, "Traceback ...\nValueError: boom\n  at line 3\n")
    assert status is ProbeStatus.CRASH and "ValueError: boom" in message


def test_summarize_picks_the_exception_line():
    text = "Traceback (most recent call last):\n  File x\ntorch.OutOfMemoryError: CUDA out\n"
    assert summarize(text) == "torch.OutOfMemoryError: CUDA out"
    assert len(summarize("x" * 1000)) == 300
