#!/usr/bin/env bash
# Verify the GPU path on a machine with a GPU, in about 20 minutes (an estimate: 14 measured before layers
# compiled by default; each benchmark variant now compiles first, ~35 s on an H200): the GPU tests (packed attention
# against the reference, TE against SDPA, bf16/FP8 training steps), the parity check against
# transformers in bf16 and fp32 (docs/training.md), one profiled step (where the device and host time go),
# then the throughput rows of BENCHMARKS.md as one table. Run it from a checkout, in an environment with this package
# installed (pip install -e ".[dev,gpu]"), or inside the image:
#   singularity exec --nv llava.sif bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else
  "gpu_check: torch sees no CUDA GPU here; run it on a GPU node (or: singularity exec --nv IMAGE bash scripts/gpu_check.sh)")'
"$python" -m pytest -q -m gpu tests/gpu
"$python" bench/parity_bench.py
"$python" bench/gpu_profile.py
"$python" bench/gpu_profile.py --host-functions 25
"$python" bench/gpu_bench.py --sweep --iters 5 --warmup 2
"$python" bench/tower_attention_bench.py
