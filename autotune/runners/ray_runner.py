"""RayRunner: each probe is one Ray task that runs the local runner on the node Ray picks.

The task asks Ray for `num_cpus_per_probe` CPUs, `num_gpus_per_probe` GPUs and any custom
resources, then runs the probe through SubprocessRunner on its node: a probe's isolation (own
process group, watchdog, timeout, OOM classification) is exactly the local one. The request
goes out with gpu_ids=None and cpu_ids=None (the driver's pinning means nothing on another
node): the probe inherits the CUDA_VISIBLE_DEVICES Ray gave the task.

The task is a streaming generator with two replies: the node it landed on, then the
ProbeResult JSON and the tail of the probe's log (the driver writes it where asked). Knowing
the node, the driver watches it: Ray fails a task whose raylet died at once (NodeDiedError),
but a node that hangs or leaves the network keeps `ray.get` waiting on a worker that never
answers, though the GCS marks the node dead within seconds.

Ray never retries a probe (max_retries=0): one that dies with its node (LOST) says nothing
about the configuration; the sweep decides whether to run it again.

`stop` kills every probe in flight without waiting on Ray: each task's local runner tags its
probe's processes with the RayRunner's own tag scope (process_tag.py), and every process of
that scope on the driver's machine is SIGKILLed at once; the task then returns the killed
probe's result. Every task in flight is also cancelled softly (Ray raises KeyboardInterrupt in
the task and the local runner kills the whole probe tree): that reaches other nodes. A task
still running STOP_GRACE_S later has its Ray worker force-killed (PR_SET_PDEATHSIG takes the
probe process down with it; the next probe of this runner on that node kills what the probe
left, as orphans of its scope), and a `run` whose task has still not answered STOP_GRACE_S
after that returns "stopped". No Ray call that can block is made on `run`'s or `stop`'s
thread after a stop: `ray.cancel` is a call to the task's owner and node that can block under
load (a `run` that waited on one did not return 30 s after `stop` in full CI runs), so every
cancel runs on a thread of its own, and `close` waits for those threads before it disconnects
(a thread left inside a Ray call when Ray shuts down can abort the process later).

Ray is imported in this module only, and only when a RayRunner is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from autotune.errors import RunnerError
from autotune.files import describe_os_error, open_log
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus
from autotune.process_tag import kill_processes, tag_scope, tagged_processes
from autotune.runners.local import SubprocessRunner, scratch_dir

if TYPE_CHECKING:
    from ray import ObjectRefGenerator
    from ray.remote_function import RemoteFunction

LOG_TAIL_BYTES = 2 * 2**20  # the most of a probe's log that comes back to the driver
STOP_GRACE_S = 5.0  # after a soft cancel, how long before the Ray worker is force-killed
WAIT_POLL_S = 0.5  # how often a waiting `run` looks at `stop`
NODE_CHECK_S = 2.0  # how often it asks the GCS whether the probe's node is alive
REPLY_GRACE_S = 120.0  # past the probe's own timeout, silence from its node means it is lost
CONNECT_CHECK_S = 60.0  # how long a new runner waits for a first reply from a Ray worker
CANCEL_JOIN_S = 10.0  # how long `close` waits for the cancel threads before disconnecting

# What Ray raises when the probe's node, worker or owner went away (not the probe's doing).
LOST_ERROR_NAMES = ("NodeDiedError", "WorkerCrashedError", "LocalRayletDiedError",
                    "ObjectLostError", "RaySystemError", "TaskUnschedulableError")

_remote_probe: RemoteFunction | None = None  # run_probe_on_node as a Ray remote function,
# made on first use
_connected_here = False  # this module called ray.init (close() disconnects, and stops a Ray
# it started)


def connect(address: str | None) -> None:
    """Connect this process to the Ray cluster at `address` (None: start one here), once."""
    import ray

    global _connected_here
    if ray.is_initialized():
        return
    check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RunnerError(f"cannot connect to Ray at {address or 'local'}: {exc}") from exc
    _connected_here = True


def cluster_gpus(address: str | None) -> float:
    """GPUs of the alive nodes of the cluster at `address` (connecting to it)."""
    import ray

    connect(address)
    return float(ray.cluster_resources().get("GPU", 0.0))


class NodeReply(TypedDict):
    """The task's first reply: where it runs."""

    node_id: str
    hostname: str


class ProbeReply(TypedDict):
    """The task's second reply: the probe's result and its log."""

    result: str  # the ProbeResult's JSON
    log: bytes  # the tail of the probe's log (LOG_TAIL_BYTES at most)


_cancels: set[threading.Thread] = set()  # cancel threads not ended yet
_cancels_lock = threading.Lock()


def cancel_in_background(probe: ObjectRefGenerator, force: bool = True) -> None:
    """Cancel a task on a thread of its own: `ray.cancel` is a call to the task's owner and
    its node that can block under load, and neither `stop` nor `run` may wait on it."""
    import ray

    def cancel() -> None:
        try:
            with contextlib.suppress(Exception):
                ray.cancel(probe, force=force)
        finally:
            with _cancels_lock:
                _cancels.discard(threading.current_thread())

    thread = threading.Thread(target=cancel, name="autotune-ray-cancel", daemon=True)
    with _cancels_lock:
        _cancels.add(thread)
    thread.start()


def wait_for_cancels(timeout_s: float = CANCEL_JOIN_S) -> list[threading.Thread]:
    """Wait for the cancel threads to end (at most `timeout_s`); those still in a Ray call."""
    deadline = time.monotonic() + timeout_s
    with _cancels_lock:
        threads = list(_cancels)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    return [thread for thread in threads if thread.is_alive()]


def kill_scope_here(scope: str) -> int:
    """SIGKILL every process on this machine tagged with `scope` (a RayRunner's probes that
    run on the driver's node); how many there were."""
    procs = [proc for proc, tag in tagged_processes() if tag.split(".")[2:3] == [scope]]
    return kill_processes(procs) if procs else 0


def run_probe_on_node(request_json: str | None, worker_argv: list[str] | None = None,
                      scope: str = "") -> Iterator[NodeReply | ProbeReply]:
    """The Ray task: say where it runs, then run one probe (if any) with the local runner, its
    processes tagged with `scope` (the RayRunner's)."""
    import ray

    yield {"node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname()}
    if request_json is None:
        return
    with scratch_dir() as tmp:
        log_path = tmp / "probe.log"
        request = ProbeRequest.from_json(request_json)
        result = SubprocessRunner(worker_argv, scope=scope, fork=False).run(request,
                                                                            log_path=log_path)
        yield {"result": result.to_json(), "log": read_log_tail(log_path, LOG_TAIL_BYTES)}


def read_log_tail(path: Path, max_bytes: int) -> bytes:
    """The last `max_bytes` of a log, with a first line saying how much was dropped."""
    with contextlib.suppress(OSError), open(path, "rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - max_bytes))
        data = handle.read()
        if size > max_bytes:
            data = f"[... first {size - max_bytes} bytes of the log dropped]\n".encode() + data
        return data
    return b""


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class ProbeLost(Exception):
    """The probe's node is gone, though Ray has not failed its task (yet)."""


def check_reachable(address: str | None, timeout_s: float = 5.0) -> None:
    """One clear error for a HOST:PORT nobody listens on (ray.init would retry for minutes)."""
    if address is None or address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as exc:
        from autotune.errors import ConfigError

        raise ConfigError(f"--address {address}: no Ray cluster answers there ({exc}); start "
                          "one with `ray start --head` or give the head's HOST:PORT") from None


class RayRunner:
    """Runs each probe as one Ray task on a Ray cluster (or a local Ray started for it)."""

    def __init__(self, address: str | None = None, num_cpus_per_probe: float = 1.0,
                 num_gpus_per_probe: float = 0.0, resources: dict[str, float] | None = None,
                 worker_argv: list[str] | None = None) -> None:

        self.num_cpus_per_probe = num_cpus_per_probe
        self.num_gpus_per_probe = num_gpus_per_probe
        self.resources = dict(resources or {})  # custom Ray resources each probe needs
        self.worker_argv = worker_argv  # the probe command on the node (tests: a faulty worker)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.in_flight: set[ObjectRefGenerator] = set()  # the probe tasks not returned
        # the tag scope of this runner's probes (process_tag.py): `stop` kills them by it
        self.scope = tag_scope(f"ray-{os.getpid()}-{id(self)}-{time.time_ns()}")
        connect(address)
        self.check_replies()

    def check_replies(self) -> None:
        """RunnerError unless the cluster runs autotune's task and its replies reach us."""
        import ray

        task = ray.remote(num_cpus=0, max_retries=0, num_returns="streaming")(run_probe_on_node)
        probe = task.remote(None)
        ready, _ = ray.wait([probe], timeout=CONNECT_CHECK_S)
        if not ready:
            with contextlib.suppress(Exception):
                ray.cancel(probe, force=True)
            raise RunnerError(  # a token in ~/.ray turns token auth on for this driver alone
                f"no reply from a Ray worker in {CONNECT_CHECK_S:.0f} s: the cluster runs no "
                "tasks, or their replies cannot reach this driver (a driver joining with "
                "address None or 'auto' uses token auth if ~/.ray has a token: give HOST:PORT "
                "or set RAY_AUTH_MODE=disabled)")
        try:
            ray.get(next(probe))
        except ray.exceptions.RayError as exc:
            raise RunnerError(f"Ray cannot run autotune's task: {first_line(exc)}") from exc

    def probe_slots(self) -> int:
        """How many probes the cluster holds at once now (alive nodes' resources), at least 1."""
        import ray

        total = ray.cluster_resources()
        needs = dict(self.resources)
        needs["GPU" if self.num_gpus_per_probe else "CPU"] = (
            self.num_gpus_per_probe or self.num_cpus_per_probe)
        slots = min(math.floor(total.get(name, 0.0) / amount + 1e-9)
                    for name, amount in needs.items() if amount > 0)
        return max(1, slots)

    def close(self) -> None:
        """Disconnect from Ray if this module connected (a local Ray it started stops), once
        the cancel threads have ended."""
        import ray

        global _connected_here
        wait_for_cancels()
        if _connected_here and ray.is_initialized():
            ray.shutdown()
        _connected_here = False

    def stop(self) -> None:
        """Kill every probe in flight (from any thread): those on this machine at once, the
        others through Ray; their `run` calls return soon."""
        with self.lock:
            self.stopping.set()
            probes = list(self.in_flight)
        kill_scope_here(self.scope)
        for probe in probes:  # KeyboardInterrupt in the task: its probe's tree killed
            cancel_in_background(probe, force=False)

    def run(self, request: ProbeRequest, log_path: Path | None = None) -> ProbeResult:
        import ray

        global _remote_probe
        if _remote_probe is None:
            _remote_probe = ray.remote(max_retries=0, num_returns="streaming")(
                run_probe_on_node)
        sent = dataclasses.replace(request, gpu_ids=None, cpu_ids=None)
        started = time.monotonic()
        with self.lock:
            if self.stopping.is_set():
                return ProbeResult(status=ProbeStatus.CRASH, message="stopped")
            probe = _remote_probe.options(
                num_cpus=self.num_cpus_per_probe, num_gpus=self.num_gpus_per_probe,
                resources=self.resources or None, name=f"autotune-probe:{request.model}",
            ).remote(sent.to_json(), self.worker_argv, self.scope)
            self.in_flight.add(probe)
        node: NodeReply | None = None
        try:
            self.await_reply(probe)
            node = ray.get(next(probe))
            self.await_reply(probe, node, time.monotonic() + request.timeout_s)
            reply: ProbeReply = ray.get(next(probe))
            result = ProbeResult.from_json(reply["result"])
            log_bytes = reply["log"]
        except (ray.exceptions.RayError, ProbeLost) as exc:
            if isinstance(exc, ProbeLost):  # tidy up, should the node come back
                cancel_in_background(probe)
            result = self.failed(exc)
            log_bytes = f"{result.message}\n{result.stderr_tail}\n".encode()
        except BaseException:  # KeyboardInterrupt in the driver: no probe outlives this call
            kill_scope_here(self.scope)
            cancel_in_background(probe)
            raise
        finally:
            with self.lock:
                self.in_flight.discard(probe)
        if log_path is not None:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            try:
                with os.fdopen(open_log(log_path), "wb") as log:
                    log.write(log_bytes)
            except OSError as exc:  # a symbolic link planted there: never followed
                result = result.replace(message=f"{result.message}; its log was not "
                                        f"written: {describe_os_error(exc, log_path)}")
        if node and not result.status.reached_peaks:  # where it failed (ProbeResult has no
            # field for the node)
            where = f"[node {node['hostname']} {node['node_id'][:12]}]"
            result = result.replace(message=f"{result.message} {where}".lstrip())
        return result.replace(probe_wall_s=result.probe_wall_s or time.monotonic() - started)

    def await_reply(self, probe: ObjectRefGenerator, node: NodeReply | None = None,
                    deadline: float = math.inf) -> None:
        """Wait until the task's next reply is ready; ProbeLost if its node dies or is silent
        long past deadline.
        After `stop`, a task that outlives the soft cancel by STOP_GRACE_S is force-killed;
        one whose reference is still not ready STOP_GRACE_S after that is given up on (Ray
        can leave a force-cancelled streaming task's reference pending under load): `run`
        returns "stopped" and the probe dies with its killed worker."""
        import ray

        stop_seen_at, forced_at = None, None
        check_at = time.monotonic() + NODE_CHECK_S
        while True:
            ready, _ = ray.wait([probe], timeout=WAIT_POLL_S)
            if ready:
                return
            now = time.monotonic()
            if self.stopping.is_set():
                stop_seen_at = stop_seen_at or now
                if forced_at is None and now - stop_seen_at > STOP_GRACE_S:
                    cancel_in_background(probe)  # its RPC may block under load: not here
                    forced_at = now
                elif forced_at is not None and now - forced_at > STOP_GRACE_S:
                    raise ProbeLost("stopped: the task did not end after a forced cancel")
            elif node and now > check_at:
                check_at = now + NODE_CHECK_S
                if not any(n["NodeID"] == node["node_id"] and n["Alive"] for n in ray.nodes()):
                    raise ProbeLost("node lost: Ray marked the probe's node dead")
                if now > deadline + REPLY_GRACE_S:
                    raise ProbeLost(f"node lost: no reply {REPLY_GRACE_S:.0f} s past the "
                                    "probe's timeout")

    def failed(self, exc: BaseException) -> ProbeResult:
        """The ProbeResult for a task that failed instead of replying."""
        import ray

        if self.stopping.is_set() or isinstance(exc, ray.exceptions.TaskCancelledError):
            return ProbeResult(status=ProbeStatus.CRASH, message="stopped")
        if isinstance(exc, ProbeLost):
            return ProbeResult(status=ProbeStatus.LOST, message=str(exc))
        if isinstance(exc, ray.exceptions.OutOfMemoryError):
            status, message = ProbeStatus.HOST_OOM, "host memory ran out: Ray's memory monitor "
            message += f"killed the probe's task ({first_line(exc)})"
        elif {cls.__name__ for cls in type(exc).__mro__} & set(LOST_ERROR_NAMES):
            status, message = ProbeStatus.LOST, f"node lost: {first_line(exc)}"
        else:
            status, message = ProbeStatus.CRASH, f"Ray task failed: {first_line(exc)}"
        return ProbeResult(status=status, message=message, stderr_tail=str(exc)[-4000:])
