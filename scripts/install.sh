#!/usr/bin/env bash
# Create .venv and install autotune with its test extra.
# Without an NVIDIA GPU it installs a CPU build of torch (about 200 MB), never the CUDA wheels
# (several GB): from a local wheelhouse pip already knows (find-links), else PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1 && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "no NVIDIA GPU: installing a CPU build of torch"
  "${pip[@]}" install -q --no-index --no-deps torch 2>/dev/null \
    || "${pip[@]}" install -q --retries 1 --timeout 30 torch \
         --index-url https://download.pytorch.org/whl/cpu \
    || echo "no CPU build of torch reachable: the default build will be installed"
fi
"${pip[@]}" install -q -e ".[test]"
echo "installed: $(.venv/bin/autotune --version)"
