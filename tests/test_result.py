"""ProbeRequest and ProbeResult survive the process boundary unchanged."""

from __future__ import annotations

from autotune.config import ProbeConfig
from autotune.files import write_text_atomic
from autotune.hardware import Device
from autotune.probe.measure.result import ProbeRequest, ProbeResult, ProbeStatus


def test_request_round_trip():
    request = ProbeRequest(model="qwen2.5-7b", config=ProbeConfig(rollout_n=8),
                           gpu_ids=(0, 3), device=Device("cuda", 80 * 2**30, 40 * 2**30))
    assert ProbeRequest.from_json(request.to_json()) == request


def test_result_round_trip_and_oom_classes(tmp_path):
    result = ProbeResult(status=ProbeStatus.GPU_OOM, message="CUDA out of memory",
                         failed_phase="update", phase_peak_mem_bytes={"rollout": 5},
                         startup_s=1.0, build_s=2.0)
    path = tmp_path / "result.json"
    write_text_atomic(path, result.to_json())
    assert ProbeResult.from_json(path.read_text()) == result
    assert result.fixed_cost_s == 3.0
    assert [s.value for s in ProbeStatus if s.is_oom] == ["gpu_oom", "host_oom", "cache_oom"]
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


def test_atomic_write_gives_open_s_mode_without_touching_the_umask(tmp_path, monkeypatch):
    """The file gets 0666 less the umask, as open() would give it, and the process umask is
    never set (setting it, even for an instant, races every other thread creating a file)."""
    import os

    old = os.umask(0o027)
    try:
        def refuse(mask: int) -> int:
            raise AssertionError(f"os.umask({mask:#o}) called")

        monkeypatch.setattr(os, "umask", refuse)
        path = tmp_path / "best.yaml"
        write_text_atomic(path, "a: 1\n")
        write_text_atomic(path, "a: 2\n")  # over an existing file
    finally:
        monkeypatch.undo()
        os.umask(old)
    assert path.read_text() == "a: 2\n"
    assert path.stat().st_mode & 0o777 == 0o640
    assert list(tmp_path.iterdir()) == [path]
