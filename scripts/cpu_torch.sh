#!/usr/bin/env bash
# Install a CPU build of torch into the environment of PYTHON (about 200 MB), never the CUDA
# wheels (several GB): from a local wheelhouse pip already knows (find-links), else PyTorch's
# CPU index. Used by install.sh and by the tests that build an environment of their own.
#   bash scripts/cpu_torch.sh PYTHON [VERSION]
set -uo pipefail
python=$1
want=${2:+==$2}
pip=("$python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --no-index --no-deps "torch$want" 2>/dev/null \
  || "${pip[@]}" install -q --retries 1 --timeout 30 "torch$want" \
       --index-url https://download.pytorch.org/whl/cpu \
  || { echo "no CPU build of torch reachable: the default build will be installed"; exit 1; }
