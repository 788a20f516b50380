#!/usr/bin/env bash
# A lent GPU's measurements in one call, most wanted first, within LEASE_SECONDS (default 540): the
# profile of the default step, the step as it is, transformers on the same packs (position ids,
# Liger-Kernel where carried: issue 46's ratio), the step with the levers not yet measured (weight
# gradients added within their GEMMs, fused AdamW; FP8 through torchao), the eager step, Qwen2.5-VL-3B
# ours and transformers', the Qwen-VL towers' attention side by side (and compiled), a 16k pack,
# transformers padded as before, then the GPU tests in what is left.
# Each step runs under its own limit, cut to the time left; its output goes to OUT/NAME.txt (OUT:
# the device tool's folder, else bench/results/lease) and its last lines to the screen.
#   OUT=/some/dir bash bench/gpu_lease.sh            # python3 must import megatron-ext's needs
# On a machine without an index, carry them first: bench/gpu_wheels.py --extra liger --extra fp8 (with
# megatron-ext[liger,fp8] installed in the environment that fetches them).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-bench/results/lease}
mkdir -p "$out"
deadline=$((SECONDS + ${LEASE_SECONDS:-540}))

step() {  # NAME LIMIT COMMAND...
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  if ((left < 30)); then echo "=== $name: skipped, ${left}s left"; return; fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  echo "--- $name: exit $? after $((SECONDS - start))s"
  tail -n 4 "$out/$name.txt"
}

"$python" -c 'import torch; print(torch.cuda.get_device_name(0), torch.__version__)' | tee "$out/device.txt"
step profile 100 "$python" bench/gpu_profile.py
step bench-compiled 110 "$python" bench/gpu_bench.py --iters 3 --warmup 4
step bench-hf 70 "$python" bench/gpu_bench.py --hf --iters 3 --warmup 2
step bench-levers 110 "$python" bench/gpu_bench.py --gradient-accumulation-fusion --fused-adam --iters 3 --warmup 4
step bench-fp8 110 "$python" bench/gpu_bench.py --fp8 --fp8-backend torchao --iters 3 --warmup 4
step bench-eager 70 "$python" bench/gpu_bench.py --no-compile-layers --iters 3 --warmup 2
step qwen 120 "$python" bench/qwen_vl_bench.py --iters 3 --warmup 2
step qwen-hf 90 "$python" bench/qwen_vl_bench.py --hf --iters 3 --warmup 2
step tower-attention 120 "$python" bench/tower_attention_bench.py --iters 3
step bench-16k 100 "$python" bench/gpu_bench.py --seq-length 16384 --iters 3 --warmup 4
step bench-hf-padded 60 "$python" bench/gpu_bench.py --hf --no-packing --no-liger --iters 3 --warmup 2
step gpu-tests 300 "$python" -m pytest -q -m gpu tests/gpu -k "not rehearsal" -n 4 -p no:cacheprovider
