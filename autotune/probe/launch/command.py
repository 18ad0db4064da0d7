"""The command probe: a short run of the user's own trainer, measured from outside and inside.

The worker runs here, without torch, when the request carries a TrainerCommand. It writes the
trial's trainer config into the trial's directory (`trial-00007.run/`), fills the launch
line's placeholders, and starts the trainer in a session of its own, with a private Ray temp
dir (its own Ray instance, never the driver's cluster). While it runs:

- device memory: on GPUs, NVML's used memory of each GPU the probe is pinned to, less what was
  in use before the run (so vLLM's pool and every Ray worker count); on a CPU, the run's
  anonymous RSS, as the built-in probe measures its own (process_tag.read_statm_bytes);
- host memory: the summed RSS of every process carrying the probe's tag (process_tag.py),
  the command's tree and the Ray workers it started alike;
- throughput: the trainer's own step lines, parsed as they are printed (trainer_logs.py),
  timestamped here, from the steps after the first.

Past --gpu-memory-limit (less --reserve-gpu-memory) the run is killed as gpu_oom, past
--host-memory-limit as host_oom. A run that ends badly is classified by oom.py on its log
tail and exit code; one that exits 0 without a step line is a crash with its log kept.
Once the steps asked for are logged the run is ended (a trainer's last validation and final
checkpoint are not measured, so not waited for). Whatever happens, every tagged process is
killed before the result is written, and if the driver dies the worker kills the run first
(its parent-death signal is SIGTERM here).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypedDict

import psutil

from autotune.files import describe_os_error
from autotune.probe.launch.trainer_logs import StepLog, Throughput
from autotune.probe.measure.machine import MachineWatch
from autotune.probe.measure.oom import classify_exit, summarize
from autotune.probe.measure.result import (
    TRIAL_DIR_TOKEN,
    ProbeRequest,
    ProbeResult,
    ProbeStatus,
    TrainerCommand,
)
from autotune.process_tag import (
    PROBE_TAG_ENV,
    ProcessTree,
    die_with_parent,
    kill_tagged,
    sample_interval_s,
)

TAIL_LINES = 200


def trial_dir_for(result_path: str) -> Path:
    """trial-00007.result.json -> trial-00007.run/: the trainer's config and output."""
    path = Path(result_path).resolve()
    return path.parent / f"{path.name.split('.')[0]}.run"


def launch_argv(command: TrainerCommand, config_path: Path, trial_dir: Path) -> list[str]:
    """The launch line with its placeholders filled; {overrides} becomes one word each."""
    def fill(word: str) -> str:
        return (word.replace("{config}", str(config_path))
                .replace("{config_dir}", str(config_path.parent))
                .replace("{config_name}", config_path.stem)
                .replace(TRIAL_DIR_TOKEN, str(trial_dir)))

    argv: list[str] = []
    for word in command.argv:
        if word == "{overrides}":
            argv.extend(fill(item) for item in command.overrides)
        else:
            argv.append(fill(word))
    return argv


class DeviceName(TypedDict):
    """What a command probe's result says of its device: its name and its memory."""

    device_name: str
    device_capacity_bytes: int


class GpuMemory:
    """NVML's used bytes on each of the probe's GPUs, above what was used before the run."""

    def __init__(self) -> None:
        self.nvml: Any = None  # pynvml, untyped (pyproject's mypy overrides): its handles
        self.handles: list[Any] = []  # are opaque
        self.baseline_bytes: list[int] = []
        self.peak_bytes: list[int] = []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and not visible.strip():
            return  # pinned to no GPU: a CPU probe
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            count = pynvml.nvmlDeviceGetCount()
            ids = [int(i) for i in visible.split(",") if i.strip().isdigit()] \
                if visible else list(range(count))
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in ids if i < count]
        self.baseline_bytes = [self.used(h) for h in self.handles]
        self.peak_bytes = [0 for _ in self.handles]

    @property
    def present(self) -> bool:
        return bool(self.handles)

    def used(self, handle: Any) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)

    def sample(self) -> int:
        """The largest use of any of the GPUs now, and keep each one's peak."""
        now = [max(0, self.used(h) - base) for h, base in zip(self.handles, self.baseline_bytes,
                                                              strict=True)]
        self.peak_bytes = [max(p, n) for p, n in zip(self.peak_bytes, now, strict=True)]
        return max(now)

    def describe(self) -> DeviceName:
        handle = self.handles[0]
        name = self.nvml.nvmlDeviceGetName(handle)
        return {"device_name": name.decode() if isinstance(name, bytes) else name,
                "device_capacity_bytes": int(self.nvml.nvmlDeviceGetMemoryInfo(handle).total)}

    def close(self) -> None:
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


def kill_run(proc: subprocess.Popen[bytes], tag: str | None) -> None:
    """The command's session, its descendants, and every other process of the probe's tag."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if tag:
        kill_tagged(tag)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def clean_up_on_parent_death(state: dict[str, subprocess.Popen[bytes]]) -> None:
    """If the driver dies, this worker gets SIGTERM (not SIGKILL) and ends the run first
    (`state["proc"]`, once it is started)."""
    def on_term(signum: int, frame: FrameType | None) -> None:
        proc = state.get("proc")
        if proc is not None:
            kill_run(proc, os.environ.get(PROBE_TAG_ENV))
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_command(request: ProbeRequest, result_path: str) -> ProbeResult:
    """Run the trainer's command for its few steps and measure it; never raises."""
    command = request.command
    assert command is not None
    state: dict[str, subprocess.Popen[bytes]] = {}
    clean_up_on_parent_death(state)
    trial_dir = trial_dir_for(result_path)
    shutil.rmtree(trial_dir, ignore_errors=True)  # a retried trial starts clean
    config_path = trial_dir / command.config_name
    try:
        trial_dir.mkdir(parents=True)
        config_path.write_text(command.config_text.replace(TRIAL_DIR_TOKEN, str(trial_dir)))
    except OSError as exc:  # a full or read-only disk: said in the result, not a traceback
        return ProbeResult(status=ProbeStatus.CRASH, probe_kind="command",
                           message="cannot write the trial's config: "
                                   + describe_os_error(exc, config_path))
    argv = launch_argv(command, config_path, trial_dir)
    ray_dir = tempfile.mkdtemp(prefix="at-ray-")  # short: Ray's socket paths must fit 107 B
    env = {**os.environ, "RAY_TMPDIR": ray_dir, "PYTHONUNBUFFERED": "1",
           "RAY_DEDUP_LOGS": "0"}  # every step line as printed, not merged across workers
    env.pop("RAY_ADDRESS", None)  # the trainer starts its own Ray, never joins the driver's
    print(f"autotune: {' '.join(argv)}", flush=True)
    gpu = GpuMemory()
    try:
        return _run(request, command, argv, env, gpu, state)
    finally:
        gpu.close()
        shutil.rmtree(ray_dir, ignore_errors=True)


def _run(request: ProbeRequest, command: TrainerCommand, argv: list[str],
         env: dict[str, str], gpu: GpuMemory, state: dict[str, subprocess.Popen[bytes]]
         ) -> ProbeResult:
    """Start the trainer, watch it until its steps are logged, it ends or it passes a
    limit, end it, and say what it did."""
    tag = os.environ.get(PROBE_TAG_ENV)
    capacity: DeviceName = gpu.describe() if gpu.present else {
        "device_name": "cpu (the run's anonymous RSS)",
        "device_capacity_bytes": int(psutil.virtual_memory().total)}
    limit = request.device.with_capacity(capacity["device_capacity_bytes"]).cap_bytes
    log = StepLog(command.trainer, steps_per_cycle=command.steps_per_cycle)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    started = time.monotonic()
    try:
        proc = start_trainer(argv, command.cwd, env)
    except OSError as exc:
        return ProbeResult(status=ProbeStatus.CRASH, probe_kind="command",
                           message=f"--launch: cannot start {argv[0]!r}: {exc.strerror}; check "
                                   "the launch line", device_limit_bytes=limit, **capacity)
    state["proc"] = proc
    watch = MachineWatch(probe_threads=1)  # the trainer's processes carry the probe's tag
    watch.start()
    reader = threading.Thread(target=copy_output, args=(proc, log, tail), daemon=True)
    reader.start()
    memory = ProcessTree(psutil.Process(proc.pid), tag)
    try:
        watched = watch_run(proc, request, command.steps, gpu, memory, log, limit)
    finally:
        kill_run(proc, tag)
    reader.join(timeout=10)
    result = functools.partial(
        ProbeResult, probe_kind="command", device_limit_bytes=limit,
        returncode=proc.returncode, host_peak_rss_bytes=memory.peak_rss_bytes,
        peak_mem_bytes=watched.device_peak or None,
        rank_peak_mem_bytes=list(gpu.peak_bytes) if len(gpu.peak_bytes) > 1 else [],
        steps_logged=log.steps_seen, world_size=request.world_size,
        trainer_metrics=log.trainer_metrics(), **capacity, versions=versions(command))
    measured = measured_steps(watched, proc.returncode, command, log, "".join(tail))
    if not isinstance(measured, Throughput):  # a status and why
        return result(status=measured[0], message=measured[1])
    first_step_s = log.first_step_at - started if log.first_step_at else None
    machine = watch.stop()  # over the whole run: the trainer logs its steps, not their window
    return result(status=ProbeStatus.OK, tokens_per_s=measured.tokens_per_s,
                  step_s=measured.step_s, step_times_s=list(measured.step_times_s),
                  phase_s=log.phase_times(), step_se_s=measured.step_se_s,
                  machine=machine.as_dict(), contention=machine.contention(),
                  startup_s=first_step_s, build_s=0.0)


def start_trainer(argv: list[str], cwd: str | None, env: dict[str, str]
                  ) -> subprocess.Popen[bytes]:
    """The trainer's command in a session of its own, its output piped here, dying with
    this worker."""
    worker_pid = os.getpid()
    return subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True,
                            preexec_fn=lambda: die_with_parent(worker_pid))


@dataclass
class Watched:
    """What watching a run saw: its device peak, the limit it was killed for (a status and
    why), and whether it was ended once every step asked for was logged (what follows, a
    last validation or the checkpoint a trainer always writes at the end, is not measured,
    so not waited for)."""

    device_peak: int = 0
    killed_for: tuple[ProbeStatus, str] | None = None
    ended_early: bool = False


def watch_run(proc: subprocess.Popen[bytes], request: ProbeRequest, steps: int,
              gpu: GpuMemory, memory: ProcessTree, log: StepLog, limit: int | None) -> Watched:
    """Sample the run's device and host memory at the built-in probe's interval until it
    exits, logs `steps` steps, or passes a limit. A live run is sampled before it is ended,
    so a run whose step lines all came before the first look (a loaded machine, a trainer
    that buffers its output) still has a peak."""
    watched = Watched()
    interval_s = sample_interval_s(gpu.present)  # the built-in probe's, on this device
    while proc.poll() is None:
        rss = memory.rss_bytes()
        device = gpu.sample() if gpu.present else memory.anon_rss_bytes
        watched.device_peak = max(watched.device_peak, device if gpu.present else
                                  memory.peak_anon_rss_bytes)  # the kernel's peak, between reads
        watched.killed_for = limit_passed(request, gpu.present, limit, device, rss,
                                          log.steps_seen + 1)
        if watched.killed_for is not None:
            break
        if log.steps_seen >= steps:
            watched.ended_early = True
            break
        time.sleep(interval_s)
    return watched


def limit_passed(request: ProbeRequest, on_gpu: bool, limit: int | None, device: int,
                 rss: int, step: int) -> tuple[ProbeStatus, str] | None:
    """The status and message of a run past its device or host memory limit at `step`;
    None while it is within them."""
    if limit is not None and device > limit:
        what = "NVML: every process on the GPU" if on_gpu else "the run's anonymous RSS"
        return (ProbeStatus.GPU_OOM, f"device memory limit exceeded: {device} bytes > "
                f"{limit} bytes ({what}), at step {step}")
    host_limit = request.host_memory_limit_bytes
    if host_limit is not None and rss > host_limit:
        return (ProbeStatus.HOST_OOM, f"host memory limit exceeded: {rss} bytes > "
                f"{host_limit} bytes (the run's RSS), at step {step}")
    return None


def measured_steps(watched: Watched, returncode: int | None, command: TrainerCommand,
                   log: StepLog, text_tail: str) -> Throughput | tuple[ProbeStatus, str]:
    """The throughput of a run watched to its end, or why it has none (a status and a
    message): killed past a limit, a bad exit (oom.py classifies its log tail), or no step
    line its parser can time."""
    if watched.killed_for is not None:
        return watched.killed_for
    if returncode != 0 and not watched.ended_early:
        return classify_exit(returncode, text_tail)
    measured = log.throughput()
    if measured is None:
        seen = f"{log.steps_seen} step line(s)" if log.steps_seen else "no step line"
        return ProbeStatus.CRASH, (
            f"the trainer exited 0 with {seen} its {command.trainer} log parser can time "
            f"(last line: {summarize(text_tail) or 'none'}); check the launch line and that "
            "the run logs every step to the console")
    return measured


def copy_output(proc: subprocess.Popen[bytes], log: StepLog,
                tail: collections.deque[str]) -> None:
    """The trainer's output, line by line: into the trial's log, the parser and the tail."""
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace")
        sys.stdout.write(line)
        sys.stdout.flush()
        tail.append(line)
        log.feed(line, time.monotonic())
    log.finish()


def versions(command: TrainerCommand) -> dict[str, str]:
    import platform

    from autotune.version import __version__

    return {"autotune": __version__, "python": platform.python_version(),
            "probe": f"command ({command.trainer})"}
