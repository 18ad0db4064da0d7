"""The wheels a GPU device call must carry for benchmarks/gpu_evidence.py, found here first.

The device's image has torch, transformers, peft, click, pyyaml, psutil, rich and nvidia-ml-py
but not optuna, trl or ruamel.yaml (DEVICE_PACKAGES: the image's package list as the device
library read it on 2026-11-17; DEVICE_VERSIONS: the versions a session's `pip list` there
showed). A GPU row was lost once to one missing wheel (results/gpu/gpu_evidence.txt: the TRL
sweep, without ruamel.yaml). This walks the requirements of what gpu_evidence runs (autotune's
own dependencies, and trl for its TRL rows) through this machine's installed metadata, with
the markers of the device's Python (CPython 3.12, Linux x86-64), and stops at each
distribution the image has: what is left is the set to carry, at this machine's versions.
A requirement of the carried set on a package of the image is checked against the image's
version where it is known, and listed where it is not (`check` reads it there).

    python benchmarks/device_wheels.py list              # the set; what it needs of the image
    python benchmarks/device_wheels.py download .whl     # their cp312 manylinux wheels, into .whl
    python3 benchmarks/device_wheels.py check            # on the device, first: all of it imports

`check` imports every module gpu_evidence's cases import (this checkout's autotune) and prints
each version: a missing or clashing wheel costs seconds there, not a row. On the device, with
`.whl` carried (the device library's README says how):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
        python3 benchmarks/device_wheels.py check && python3 benchmarks/gpu_evidence.py ...
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
from importlib.metadata import (PackageNotFoundError, distribution, packages_distributions,
                                version)
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the modules gpu_evidence's cases import (the CLI's for the command sweeps, trl's for TRL's,
# the runner and the memory model for gpu_holdout's rows)
MODULES = ("torch", "transformers", "peft", "optuna", "sqlalchemy", "alembic", "click", "yaml",
           "ruamel.yaml", "psutil", "rich", "pynvml", "trl", "datasets", "autotune.cli.main",
           "autotune.probe.worker", "autotune.probe.trace", "autotune.runners.local",
           "autotune.memory.model")
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3",
                  "sys_platform": "linux", "platform_machine": "x86_64",
                  "platform_system": "Linux", "os_name": "posix", "implementation_name":
                  "cpython", "platform_python_implementation": "CPython", "extra": ""}
DEVICE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split())
DEVICE_VERSIONS = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2",
                   "safetensors": "0.8.0", "tokenizers": "0.23.2", "torch": "2.11.0",
                   "transformers": "5.17.0", "triton": "3.6.0"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def roots() -> list[str]:
    """autotune's own dependencies and the test extra's trl (its TRL rows), from pyproject."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as handle:
        project = tomllib.load(handle)["project"]
    trl = [spec for spec in project["optional-dependencies"]["test"] if spec.startswith("trl")]
    return [*project["dependencies"], *trl]


def carried_set() -> tuple[dict[str, str], list[str]]:
    """(distribution -> this machine's version) to carry, and the requirements on the image's
    packages: each 'ok', 'CLASH' (the image's known version fails it) or 'unknown version'."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    carry: dict[str, str] = {}
    on_image: list[str] = []
    todo = [(Requirement(spec), "autotune") for spec in roots()]
    while todo:
        req, wanted_by = todo.pop()
        name = canonicalize_name(req.name)
        if name in DEVICE_PACKAGES:
            known = DEVICE_VERSIONS.get(name)
            verdict = "unknown version" if known is None or not req.specifier else \
                "ok" if req.specifier.contains(known, prereleases=True) else "CLASH"
            if req.specifier:
                on_image.append(f"{wanted_by} needs {req} (image: {known or '?'}): {verdict}")
            continue
        if name in carry:
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise SystemExit(f"{req.name} (needed by {wanted_by}) is not installed here: "
                             "install the project's test extra first (scripts/install.sh)")
        carry[name] = dist.version
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or sub.marker.evaluate(DEVICE_MARKERS):
                todo.append((sub, f"{name} {dist.version}"))
    return dict(sorted(carry.items())), sorted(set(on_image))


def download(into: str, carry: dict[str, str]) -> int:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pins = [f"{name}=={ver}" for name, ver in carry.items()]
    return subprocess.call([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--only-binary=:all:", "--python-version", "3.12",
                            "--implementation", "cp", *platforms, "-d", into, *pins])


def check() -> int:
    """Import every module gpu_evidence needs; print each version; 1 if any fails."""
    sys.path.insert(0, str(ROOT))  # this checkout's autotune
    failed = 0
    owners = packages_distributions()  # a top-level module -> the distributions that have it
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - each failure is the line to read
            failed += 1
            print(f"FAILED  {module}: {type(error).__name__}: {error}")
            continue
        dists = dict.fromkeys(owners.get(module.split(".")[0], []))  # once each
        print(f"ok      {module} {' '.join(f'{d} {version(d)}' for d in dists)}")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("list", "download", "check"))
    parser.add_argument("into", nargs="?", default=".whl")
    args = parser.parse_args()
    if args.action == "check":
        return check()
    carry, on_image = carried_set()
    if args.action == "download":
        return download(args.into, carry)
    print(f"carry {len(carry)}: " + " ".join(f"{n}=={v}" for n, v in carry.items()))
    print("\n".join(on_image))
    return 1 if any(line.endswith("CLASH") for line in on_image) else 0


if __name__ == "__main__":
    sys.exit(main())
