"""Slots: which GPUs or cores each parallel probe gets, and a real pinned probe process."""

from __future__ import annotations

import sys

import pytest

from autotune.errors import ConfigError
from autotune.probe.measure.result import ProbeStatus
from autotune.runners.local import SubprocessRunner
from autotune.sweep.execution.parallel import Slot, cpu_slots, gpu_slots, plan_slots


def test_eight_gpus_one_per_trial_are_eight_disjoint_slots():
    slots = gpu_slots(tuple(range(8)), 1)
    assert [s.gpu_ids for s in slots] == [(i,) for i in range(8)]


def test_gpu_groups_are_disjoint_and_leftovers_stay_idle():
    slots = gpu_slots(tuple(range(8)), 3)
    assert [s.gpu_ids for s in slots] == [(0, 1, 2), (3, 4, 5)]
    assert [s.gpu_ids for s in gpu_slots((2, 5, 6, 7), 2)] == [(2, 5), (6, 7)]


def test_more_gpus_per_trial_than_gpus_is_a_usage_error():
    with pytest.raises(ConfigError, match="--gpus-per-trial 4: only 2 GPU"):
        gpu_slots((0, 1), 4)


def test_parallel_past_the_gpu_slots_is_a_usage_error():
    with pytest.raises(ConfigError, match="--parallel 5: 4 GPU"):
        plan_slots("cuda", (0, 1, 2, 3), 1, 5, None)
    slots = plan_slots("auto", (0, 1, 2, 3), 2, 1, 4)
    assert slots == [Slot(gpu_ids=(0, 1), cpu_threads=4)]


def test_cuda_without_a_gpu_is_a_usage_error():
    with pytest.raises(ConfigError, match="--device cuda: no NVIDIA GPU is visible"):
        plan_slots("cuda", (), 1, None, None)


def test_cpu_cores_split_into_disjoint_pinned_groups():
    slots = cpu_slots(2, (0, 1, 2, 3))
    assert slots == [Slot(cpu_ids=(0, 1), cpu_threads=2), Slot(cpu_ids=(2, 3), cpu_threads=2)]
    assert cpu_slots(2, (0, 1), threads_per_probe=1) == [
        Slot(cpu_ids=(0,), cpu_threads=1), Slot(cpu_ids=(1,), cpu_threads=1)]


def test_more_probes_than_cores_is_a_usage_error():
    """--parallel 1000 on 2 cores was accepted: probes sharing cores measure each other."""
    with pytest.raises(ConfigError, match="--parallel 3: .* 2 core"):
        cpu_slots(3, (0, 1))


def test_one_probe_on_cpu_is_not_pinned():
    assert plan_slots("cpu", None, 1, None, None) == [Slot()]


def test_a_pinned_probe_process_runs_on_its_cores_only(make_request, tmp_path):
    """The local runner pins the worker before exec: it sees only its slot's cores."""
    import os

    core = sorted(os.sched_getaffinity(0))[-1]
    script = tmp_path / "affinity.py"
    script.write_text("import os, sys\nprint('cores', sorted(os.sched_getaffinity(0)), "
                      "file=sys.stderr)\nos._exit(3)\n")
    log = tmp_path / "probe.log"
    result = SubprocessRunner([sys.executable, str(script)]).run(
        make_request(cpu_ids=(core,)), log)
    assert result.status is ProbeStatus.CRASH
    assert f"cores [{core}]" in log.read_text()


def test_gpu_probes_side_by_side_get_cores_of_their_own(monkeypatch):
    """Two GPU slots: each probe pinned to its own core group, so the sweep's trace can take
    a free slot's cores; one GPU slot keeps every core."""
    from autotune.sweep.execution import parallel

    monkeypatch.setattr(parallel, "usable_cpu_ids", lambda: (0, 1, 2, 3))
    two = plan_slots("cuda", (0, 1), 1, None, None)
    assert [(s.gpu_ids, s.cpu_ids, s.cpu_threads) for s in two] == [
        ((0,), (0, 1), 2), ((1,), (2, 3), 2)]
    assert plan_slots("cuda", (0,), 1, None, 3) == [Slot(gpu_ids=(0,), cpu_threads=3)]


def test_a_trace_runs_on_a_free_slots_cores_and_waits_while_none_is_free():
    """The tracer asks the sweep where it may run: pinned to the free slot's cores, or put
    off while every slot runs a probe (the trace process itself is stood in: what it is
    asked is the point)."""
    from autotune.hardware import Device
    from autotune.probe.measure.result import ProbeRequest
    from autotune.sweep.feasibility.traced import SubprocessTracer
    from autotune.sweep.space.search_space import SearchSpace

    space = SearchSpace({})  # fixes nothing: a candidate is its params

    class Asked(SubprocessTracer):
        def _ask(self, request):
            self.asked.append(request)
            return {"phase_peak_mem_bytes": {"update": 1}, "trace_s": 0.1}

    free: list = [False]
    tracer = Asked(lambda candidate, device: ProbeRequest(model="tiny-qwen2.5"), on_gpu=False,
                   free_cores=lambda: free[0])
    tracer.asked = []
    assert tracer.traced_bytes(space.candidate({"m": 1}), Device("cpu")) is None \
        and tracer.deferred == 1
    free[0] = (1,)
    assert tracer.traced_bytes(space.candidate({"m": 1}), Device("cpu")) is not None
    assert [r.cpu_ids for r in tracer.asked] == [(1,)]
    free[0] = None  # an unpinned free slot: no probe runs beside it
    tracer.traced_bytes(space.candidate({"m": 2}), Device("cpu"))
    assert tracer.asked[-1].cpu_ids is None


def test_the_trace_process_pins_every_thread_it_has():
    """probe/trace.py's pin_threads, in a real process with torch's threads started."""
    import os
    import subprocess

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    code = ("import os, torch; torch.set_num_threads(2); torch.ones(256, 256) @ "
            "torch.ones(256, 256); from autotune.probe.trace import pin_threads; "
            f"pin_threads(({cores[-1]},)); print(sorted({{c for t in os.listdir('/proc/self/task')"
            " for c in os.sched_getaffinity(int(t))}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"[{cores[-1]}]"
