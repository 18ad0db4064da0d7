"""A real Ray cluster on loopback for the Ray runner tests (pytest plugin).

Fixtures:

- ``ray_cluster`` (module): a head node on 127.0.0.1 (2 CPUs, a 100 MB object store, no
  dashboard) with fast node-death detection, and this process connected to it as the driver.
  ``ray_cluster.add_node(num_cpus, resources)`` starts another node (its own raylet and
  agents) on the same machine; ``ray_cluster.kill_node(node)`` SIGKILLs all its processes, as
  a machine that vanishes would; ``ray_cluster.freeze_node(node)`` SIGSTOPs it instead, as a
  machine that hangs or leaves the network. At the end the driver disconnects (once the Ray
  runner's cancel threads have ended), every node is stopped, and the fixture fails if a
  process of the cluster or a cancel thread outlived it.

Nodes are real processes started by ``ray.cluster_utils.Cluster``: a later node can have
resources and environment of its own (e.g. a lower ``RAY_memory_usage_threshold``).

Loopback: Ray turns 127.0.0.1 in an address into the machine's own IP unless it believes it
is not on a cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``); with that set, in this process
(Ray read it at import, so the constant is patched too) and in the nodes it starts, every
Ray process binds and connects to 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

HEAD_CPUS = 2
OBJECT_STORE_BYTES = 100 * 2**20
# GCS marks a silent node dead after 3 failed health checks 300 ms apart, ~1.5 s (default:
# 5 checks 3 s apart, each waiting 10 s: ~65 s). A node whose raylet died is known at once.
SYSTEM_CONFIG = {"health_check_initial_delay_ms": 0, "health_check_period_ms": 300,
                 "health_check_timeout_ms": 300, "health_check_failure_threshold": 3}
EXIT_TIMEOUT_S = 15.0


class RayTestCluster:
    """A head node, the nodes added to it, and helpers to add and kill nodes."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": HEAD_CPUS, "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False, "node_ip_address": "127.0.0.1",
            "_system_config": SYSTEM_CONFIG})
        self.frozen: dict[Any, list[psutil.Process]] = {}

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, num_cpus: float = 1, resources: dict[str, float] | None = None,
                 env: dict[str, str] | None = None) -> Any:
        """Start a node with its own resources (and environment variables for its raylet and
        workers); returns once the cluster sees it."""
        with pytest.MonkeyPatch.context() as patch:
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            node = self.cluster.add_node(num_cpus=num_cpus, resources=resources or {},
                                         object_store_memory=OBJECT_STORE_BYTES,
                                         node_ip_address="127.0.0.1")
        self.cluster.wait_for_nodes()
        return node

    def kill_node(self, node: Any) -> None:
        """SIGKILL every process of a node (raylet, agents), as a machine that vanishes: its
        workers exit when their raylet dies. Processes frozen by `freeze_node` are killed too."""
        self.cluster.remove_node(node, allow_graceful=False)
        for proc in self.frozen.pop(node, []):
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def freeze_node(self, node: Any) -> None:
        """SIGSTOP a node's raylet and everything under it (workers, probes), as a machine that
        hangs or drops off the network: no connection breaks, the GCS just stops hearing from
        it. `kill_node` ends it."""
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        frozen = [raylet, *raylet.children(recursive=True)]
        for proc in frozen:
            with contextlib.suppress(psutil.Error):
                proc.suspend()
        self.frozen[node] = frozen

    def shutdown(self) -> list[Any]:
        """Disconnect the driver (once the Ray runner's cancel threads ended: a thread left in
        a Ray call as Ray shuts down can abort this process later) and stop every node;
        returns the cancel threads that had not ended."""
        import ray

        from autotune.runners.ray_runner import wait_for_cancels

        left = wait_for_cancels()
        ray.shutdown()
        self.cluster.shutdown()
        return left


def is_alive(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    return False


def cluster_processes() -> list[psutil.Process]:
    """The live descendants of this test process: Ray's nodes, agents and workers."""
    return [proc for proc in psutil.Process().children(recursive=True) if is_alive(proc)]


def wait_for_exit(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """The processes still alive after `timeout_s` (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    alive = processes
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [proc for proc in alive if is_alive(proc)]
    return alive


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayTestCluster]:
    pytest.importorskip("ray")
    import ray._private.ray_constants as ray_constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback, in the nodes
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)  # and in this process
        before = {proc.pid for proc in cluster_processes()}
        cluster = RayTestCluster()
        try:
            yield cluster
        finally:
            # Workers are the raylets' children: list them while their parents still live.
            started = [proc for proc in cluster_processes() if proc.pid not in before]
            cancelling = cluster.shutdown()
            left = wait_for_exit(started, EXIT_TIMEOUT_S)
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            assert not left, f"Ray processes outlived the cluster: {left}"
            assert not cancelling, f"Ray cancel threads still in a Ray call: {cancelling}"
