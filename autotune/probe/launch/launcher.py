"""A real W-rank probe: W worker processes started, watched and ended as one unit.

The worker of a probe with `world_size` W > 1 and real ranks becomes this launcher (no torch
import, no torchrun on the PATH): it writes one request per rank (its own cores, threads and,
on GPUs, its own CUDA_VISIBLE_DEVICES), starts `python -m autotune.probe.worker` for each
with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, and watches them. The first rank that
fails (an OOM, a crash, a signal) ends the probe: the others are killed at once rather than
left waiting in a collective, and the probe's result is that rank's, naming it. When every
rank succeeds, the result is the group's: each phase's peak is the maximum over ranks, the
throughput the slowest rank's (the run waits for it).

The ranks share the launcher's process group (the runner kills them with it) and die with it
(PR_SET_PDEATHSIG). `AUTOTUNE_FAULT_DEVICE_LIMIT=RANK:SIZE` caps one rank's device memory, to
force an OOM in that rank (fault injection for tests and benchmarks).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from autotune.files import write_text_atomic
from autotune.hardware import nvidia_gpu_count
from autotune.probe.measure.oom import classify_exit
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus
from autotune.process_tag import die_with_parent

POLL_INTERVAL_S = 0.02
RANK_ENV = "AUTOTUNE_PROBE_RANK"  # set in each rank's worker: it is a rank, not a launcher
FAULT_LIMIT_ENV = "AUTOTUNE_FAULT_DEVICE_LIMIT"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_paths(result_path: str, rank: int) -> tuple[Path, Path]:
    """trial-7.result.json -> trial-7.rank1.request.json, trial-7.rank1.result.json."""
    base = Path(result_path)
    stem = base.name.removesuffix(".json").removesuffix(".result")
    return (base.with_name(f"{stem}.rank{rank}.request.json"),
            base.with_name(f"{stem}.rank{rank}.result.json"))


def split_cores(cores: list[int], ranks: int) -> list[tuple[int, ...]]:
    """Disjoint core groups, one per rank (every rank shares all cores when too few)."""
    if len(cores) < ranks:
        return [tuple(cores)] * ranks
    size = len(cores) // ranks
    return [tuple(cores[r * size:(r + 1) * size]) for r in range(ranks)]


def fault_limits() -> dict[int, int]:
    """{rank: device-limit bytes} from AUTOTUNE_FAULT_DEVICE_LIMIT (e.g. '1:300MiB')."""
    from autotune.config import parse_bytes

    raw = os.environ.get(FAULT_LIMIT_ENV, "").strip()
    if not raw:
        return {}
    rank, _, size = raw.partition(":")
    return {int(rank): parse_bytes(size, FAULT_LIMIT_ENV)}


def rank_requests(request: ProbeRequest) -> list[ProbeRequest]:
    """Each rank's request: its cores and threads, and a fault-injected cap if one is set."""
    import dataclasses

    ranks = request.world_size
    cores = sorted(request.cpu_ids or os.sched_getaffinity(0))
    groups = split_cores(cores, ranks)
    threads = max(1, (request.cpu_threads or len(cores)) // ranks)
    limits = fault_limits()
    return [dataclasses.replace(
        request, cpu_ids=groups[r], cpu_threads=threads,
        device=dataclasses.replace(request.device,
                                   limit_bytes=limits.get(r, request.device.limit_bytes)))
        for r in range(ranks)]


def visible_gpus(request: ProbeRequest) -> list[str]:
    if not request.device.on_gpu:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [str(i) for i in range(nvidia_gpu_count())]
    return [gpu.strip() for gpu in visible.split(",") if gpu.strip()]


def start_rank(rank: int, request: ProbeRequest, request_path: Path, result_path: Path,
               port: int, gpu: str | None, log: IO[str] | int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), **{RANK_ENV: str(rank)},
               WORLD_SIZE=str(request.world_size), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS=str(request.cpu_threads))
    env.pop(FAULT_LIMIT_ENV, None)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    write_text_atomic(request_path, request.to_json())
    result_path.unlink(missing_ok=True)
    launcher_pid, cores = os.getpid(), request.cpu_ids

    def prepare() -> None:
        if cores:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, cores)
        die_with_parent(launcher_pid)

    return subprocess.Popen(
        [sys.executable, "-m", "autotune.probe.worker", str(request_path), str(result_path)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
        preexec_fn=prepare)


def read_result(path: Path) -> ProbeResult | None:
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        return ProbeResult.from_json(path.read_text())
    return None


def launch_ranks(request: ProbeRequest, result_path: str) -> ProbeResult:
    """Run the W ranks of `request`; return the group's result or the first failure's."""
    ranks = request.world_size
    gpus = visible_gpus(request)
    if request.device.on_gpu and gpus and len(gpus) < ranks:
        return ProbeResult(
            status=ProbeStatus.INVALID, world_size=ranks,
            message=f"a real {ranks}-rank probe needs {ranks} GPUs, {len(gpus)} visible: "
                    "give it more (--gpus) or emulate the ranks (--ranks emulated)")
    paths = [rank_paths(result_path, r) for r in range(ranks)]
    failure = run_workers(rank_requests(request), paths, free_port(), gpus)
    if failure is not None:
        rank, result = failure
        return result.replace(failed_rank=rank, world_size=ranks,
                              message=f"rank {rank}: {result.message}")
    results = [read_result(result) for _, result in paths]
    return merge_ranks([r for r in results if r is not None])


def run_workers(requests: list[ProbeRequest], paths: list[tuple[Path, Path]], port: int,
                gpus: list[str] | None = None) -> tuple[int, ProbeResult] | None:
    """Start a worker for each request (rank r of them, on `gpus[r]` where given), watch
    them and end every one: the first failure (index, result), or None when all wrote
    theirs."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r, request in enumerate(requests):
            procs.append(start_rank(r, request, *paths[r], port, gpus[r] if gpus else None,
                                    sys.stdout))
        return watch(procs, paths)
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


def watch(procs: list[subprocess.Popen[bytes]],
          paths: list[tuple[Path, Path]]) -> tuple[int, ProbeResult] | None:
    """Wait for every rank; return the first that failed (an OOM before a crash when they
    end in the same poll: a peer's crash follows the OOM that ended its collective)."""
    running = set(range(len(procs)))
    while running:
        failed = []
        for rank in sorted(running):
            returncode = procs[rank].poll()
            if returncode is None:
                continue
            running.discard(rank)
            result = read_result(paths[rank][1])
            if result is None:
                status, message = classify_exit(returncode, "")
                result = ProbeResult(status=status, message=message, returncode=returncode)
            if not result.status.reached_peaks:  # stopped slow: every rank stops there
                failed.append((rank, result))
        if failed:
            return min(failed, key=lambda item: (not item[1].status.is_oom, item[0]))
        time.sleep(POLL_INTERVAL_S)
    return None


def merge_ranks(results: list[ProbeResult]) -> ProbeResult:
    """The group's figures: per-phase peaks the max over ranks, time the slowest rank's."""
    first = results[0]
    phases = {p for r in results for p in r.phase_peak_mem_bytes}

    def most(field: str) -> dict[str, int]:
        return {p: max(getattr(r, field).get(p, 0) for r in results) for p in sorted(phases)}

    slowest = min(results, key=lambda r: r.tokens_per_s or 0.0)
    states = {k: max(r.model_state_bytes.get(k, 0) for r in results)
              for k in first.model_state_bytes}
    return first.replace(
        tokens_per_s=slowest.tokens_per_s, samples_per_s=slowest.samples_per_s,
        step_s=slowest.step_s, step_times_s=slowest.step_times_s,
        step_se_s=slowest.step_se_s, units=slowest.units, timed_wall_s=slowest.timed_wall_s,
        machine=slowest.machine,
        contention="; ".join(sorted({r.contention for r in results if r.contention})) or None,
        phase_s={p: max(r.phase_s.get(p, 0.0) for r in results) for p in first.phase_s},
        peak_mem_bytes=max(r.peak_mem_bytes or 0 for r in results),
        phase_peak_mem_bytes=most("phase_peak_mem_bytes"),
        phase_allocator_peak_bytes=most("phase_allocator_peak_bytes"),
        phase_tensor_peak_bytes=most("phase_tensor_peak_bytes"),
        host_peak_rss_bytes=sum(r.host_peak_rss_bytes or 0 for r in results),
        host_offload_bytes=sum(r.host_offload_bytes or 0 for r in results),
        host_held_peak_bytes=sum(r.host_held_peak_bytes or 0 for r in results),
        startup_s=max(r.startup_s or 0.0 for r in results),
        build_s=max(r.build_s or 0.0 for r in results),
        rank_peak_mem_bytes=[r.peak_mem_bytes or 0 for r in results],
        model_state_bytes=states, emulated=False)
