"""The traces a study has made, kept beside it, so a resumed sweep traces only what is new.

A trace of a candidate (traced.py) takes 18-75 s on a loaded 2-core machine, and a resumed
sweep learns every probed config again (its measured peaks against its trace fit the trace's
fixed term): without a record it traced them all again. `TraceCache` keeps each answer of the
trace process in results/<study>/traces.json, keyed by what decides it: the probe request as
the trace runs it (model, config, device, dtype, a local checkpoint's config.json; not the
cores it was pinned to or its timeout) and the code that traces (autotune's sources and
version, torch's, transformers' and peft's versions). Answers of other code are dropped when
the file is read. Written whole and atomically after each new trace: a killed driver leaves
the last whole file; a write that fails (a full disk) only keeps the answer in memory.
Imports no torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from autotune.files import write_text_atomic
from autotune.probe.measure.result import ProbeRequest
from autotune.version import __version__

TRACES_FILE = "traces.json"
TRACED_DISTRIBUTIONS = ("torch", "transformers", "peft")  # what else decides a trace
UNRELATED_FIELDS = ("cpu_ids", "cpu_threads", "gpu_ids", "timeout_s", "stop_below")


@cache
def code_version() -> str:
    """A digest of the code a trace runs: autotune's sources (every module: the trace runs
    the probe's step, the allocator's replay, the registry's shapes) and version, and the
    versions of torch, transformers and peft installed."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256(__version__.encode())
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    for dist in TRACED_DISTRIBUTIONS:
        try:
            digest.update(f"{dist}=={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{dist} missing".encode())
    return digest.hexdigest()[:16]


def request_key(request: ProbeRequest) -> str:
    """What of a trace's request decides its answer, as one digest."""
    data = request.to_dict()
    for name in UNRELATED_FIELDS:
        data.pop(name, None)
    if request.model_path:  # a local checkpoint: what its config says, not only its path
        with contextlib.suppress(OSError):
            data["model_config"] = (Path(request.model_path) / "config.json").read_text()
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:24]


class TraceCache:
    """The trace process's answers by request, read from and written to `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.code = code_version()
        self.answers: dict[str, dict[str, Any]] = self._read()

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):  # none yet, or torn by hand: traced again
            return {}
        if not isinstance(data, dict) or data.get("code") != self.code or \
                not isinstance(data.get("traces"), dict):
            return {}
        return {k: v for k, v in data["traces"].items() if isinstance(v, dict)}

    def get(self, request: ProbeRequest) -> dict[str, Any] | None:
        return self.answers.get(request_key(request))

    def put(self, request: ProbeRequest, answer: dict[str, Any]) -> None:
        self.answers[request_key(request)] = answer
        with contextlib.suppress(OSError):  # a full disk: kept for this run only
            write_text_atomic(self.path, json.dumps(
                {"code": self.code, "traces": self.answers}, sort_keys=True) + "\n")
