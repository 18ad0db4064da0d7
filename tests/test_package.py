"""autotune as users install it: a wheel in a fresh virtual environment, its search spaces
inside; and every module checked by mypy, torch's and Optuna's types included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_a_wheel_in_a_fresh_venv_runs_with_its_search_spaces(tmp_path):
    """The wheel built from this tree, installed alone in a new venv (the libraries it needs
    are this environment's, on the venv's path; the source tree is not): `--help`, the
    shipped spaces and `validate` on the default one all work from the installed package."""
    source, dist, venv = tmp_path / "source", tmp_path / "dist", tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing but the venv
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):  # built from a copy: the tree stays as it is
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "autotune", source / "autotune",
                    ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(dist), str(source)], check=True, cwd=tmp_path, env=env)
    wheel = next(dist.glob("autotune-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", "--force-reinstall", "--quiet", str(wheel)],
                   check=True, cwd=tmp_path, env=env)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    def autotune(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(venv / "bin" / "autotune"), *args], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)

    where = subprocess.run([str(python), "-c", "import autotune; print(autotune.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=env,
                           check=True).stdout
    assert where.startswith(str(site)), where  # the wheel's copy, not the source tree
    assert autotune("--help").returncode == 0
    spaces = autotune("spaces")
    assert spaces.returncode == 0, spaces.stderr
    for name in ("grpo", "cpu-demo", "grpo-search-n", "easyr1", "verl", "trl"):
        assert name in spaces.stdout
    checked = autotune("validate", "grpo")
    assert checked.returncode == 0, checked.stderr
    assert "autotune/search_spaces/grpo.yaml: ok" not in checked.stdout  # named, not a path
    assert "grpo: ok," in checked.stdout


def test_every_module_is_typed():
    """mypy over all of autotune, the modules that import torch too, against torch's and
    Optuna's own types (pyproject's [tool.mypy])."""
    pytest.importorskip("mypy")
    done = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir",
                           str(ROOT / ".mypy_cache")], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
