#!/usr/bin/env bash
# Create ./.venv with PyTorch 2.13.0 and this package; `--dev` adds the test tools.
# On a machine without a GPU, install PyTorch's CPU wheel of 2.13.0 (no CUDA packages needed).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
if [[ "${1:-}" == "--dev" ]]; then extras="[dev]"; fi
python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
python3 -m venv .venv
# torch first, so the package's requirement is already satisfied and pip pulls no other build.
.venv/bin/pip install --quiet torch==2.13.0
.venv/bin/pip install --quiet -e ".${extras}"
echo "environment ready: .venv ($(.venv/bin/python -c 'import torch, megatron.core; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)'))"
