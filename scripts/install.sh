#!/usr/bin/env bash
# Create .venv and install autotune with its test extra.
# Without an NVIDIA GPU it installs a CPU build of torch first (scripts/cpu_torch.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1 && ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "no NVIDIA GPU: installing a CPU build of torch"
  bash scripts/cpu_torch.sh .venv/bin/python || true
fi
"${pip[@]}" install -q -e ".[test]"
echo "installed: $(.venv/bin/autotune --version)"
