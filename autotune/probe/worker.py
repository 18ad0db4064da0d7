"""`python -m autotune.probe.worker REQUEST.json RESULT.json`: run one probe, write its result.

Runs in a process of its own (started by a runner); for a real multi-rank probe it starts the
ranks (launcher.py), each a worker of its own; for a command probe it runs the user's trainer
(command.py) and imports no torch. Failures are classified through oom.py and
written as a ProbeResult; when the device-memory limit of a CPU probe is crossed, the result is
written and the process exits at once, as an allocator failure would end it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback

from autotune.files import write_text_atomic
from autotune.probe.launch.launcher import RANK_ENV, launch_ranks
from autotune.probe.launch.split_sides import launch_split
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus

EXIT_DEVICE_LIMIT = 77  # the worker ended itself after writing a gpu_oom result


def process_age_s() -> float:
    """Seconds since this process started (interpreter start, imports included; for a forked
    probe, since its fork). On Linux from the kernel's clock since boot (/proc/uptime less
    /proc/self/stat's start time, to 10 ms): psutil's create_time adds the boot time, which
    the kernel gives in whole seconds, so its age is off by up to a second."""
    try:
        with open("/proc/uptime") as handle:
            uptime_s = float(handle.read().split()[0])
        with open("/proc/self/stat") as handle:  # the command may hold spaces: after ")"
            start_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return time.time() - psutil.Process().create_time()


def run_request(request: ProbeRequest, result_path: str) -> ProbeResult:
    import torch

    from autotune.probe.measure.meter import (
        MemoryMeter,
        describe_device,
        physical_gpu_index,
        torch_device,
    )
    from autotune.probe.measure.oom import classify_exception
    from autotune.probe.step.split_step import Link, SplitSide
    from autotune.probe.step.training import TrainingProbe

    quiet_libraries()
    if request.cpu_threads:
        torch.set_num_threads(request.cpu_threads)
    startup_s = process_age_s()
    device = None
    meter = None
    try:
        device = torch_device(request.device.kind)
        if device.type == "cuda":
            capacity = torch.cuda.get_device_properties(device).total_memory
        else:
            import psutil

            capacity = psutil.virtual_memory().total
        request = dataclasses.replace(request, device=request.device.with_capacity(capacity))
        limit = request.device.cap_bytes
        if limit is not None and limit <= 0:
            raise MemoryError(f"device memory limit {limit} bytes leaves nothing for the probe")
        if device.type == "cuda" and limit is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, limit / capacity), device)

        def on_limit(phase: str, num_bytes: int) -> None:
            message = (f"device memory limit exceeded: {num_bytes} bytes > {limit} bytes "
                       f"in phase {phase}")
            failed = ProbeResult(status=ProbeStatus.GPU_OOM, message=message, failed_phase=phase,
                                 startup_s=startup_s, **describe_device(device, limit))
            write_text_atomic(result_path, failed.to_json())
            print(message, file=sys.stderr, flush=True)
            os._exit(EXIT_DEVICE_LIMIT)

        meter = MemoryMeter(device, device_limit_bytes=limit, on_limit=on_limit,
                            short=request.short)
        meter.start(nvml_index=physical_gpu_index(device))
        probe = TrainingProbe(request, meter) if not request.split_side else SplitSide(
            request, meter, request.split_side,
            Link.connect(request.split_side, request.split_port, request.timeout_s))
        return probe.run(startup_s=startup_s)
    except BaseException as exc:  # every failure becomes a classified result
        traceback.print_exc()
        status, message = classify_exception(exc)
        failed = ProbeResult(status=status, message=message, startup_s=startup_s,
                             failed_phase=(meter.current_phase if meter else None) or "build")
        if device is None:  # no device to describe: it failed before one was chosen
            return failed
        return failed.replace(**describe_device(
            device, meter.device_limit_bytes if meter else None))
    finally:
        if meter is not None:
            meter.stop()


def quiet_libraries() -> None:
    """Keep the libraries' advisory warnings out of the probe's stderr tail and a trace's
    output: transformers' logging, its renamed keywords (`past_key_values` is `cache` from
    5.x; 4.x knows only the old name), FSDP2's note on a model's output view."""
    import logging
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("torch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`past_key_values` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view",
                            category=UserWarning)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m autotune.probe.worker REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    request_path, result_path = argv
    with open(request_path) as handle:
        request = ProbeRequest.from_json(handle.read())
    if request.command is not None:  # a short run of the user's trainer: no torch here
        from autotune.probe.launch.command import run_command

        result = run_command(request, result_path)
    elif request.config.separate:  # its two sides (each side's config is colocated)
        result = launch_split(request, result_path)
    elif request.world_size > 1 and not request.emulated and RANK_ENV not in os.environ:
        result = launch_ranks(request, result_path)  # this process starts the W ranks
    else:
        result = run_request(request, result_path)
    write_text_atomic(result_path, result.to_json())
    if RANK_ENV in os.environ:  # a rank: its result is out; no NCCL/gloo teardown to wait on
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
