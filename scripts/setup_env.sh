#!/usr/bin/env bash
# Create ./.venv with PyTorch 2.13.0 and this package; `--dev` adds the test tools and the `eval`
# extra (lmms-eval), which the tests exercise, and Chromium for the page tests.
# `--python 3.12` builds ./.venv312 with that Python (from PATH, else pyenv's newest 3.12.x): pip then
# picks the newest megatron-core the pin allows for it (0.19 on 3.12, 0.16 on 3.11), CI's second leg.
# On a machine without a GPU, install PyTorch's CPU wheel of 2.13.0 (no CUDA packages needed).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
python=python3
venv=.venv

# The interpreter for `--python X.Y`: pythonX.Y if it runs, else pyenv's newest X.Y.z.
find_python() {
  if "python$1" -c '' 2>/dev/null; then echo "python$1"; return; fi
  local found=""
  if command -v pyenv >/dev/null; then
    found=$(ls -d "$(pyenv root)/versions/$1".*/bin/"python$1" 2>/dev/null | sort -V | tail -1)
  fi
  [[ -n "$found" ]] || { echo "setup_env.sh --python $1: no python$1 found; install it (e.g. pyenv install $1)" >&2; exit 1; }
  echo "$found"
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dev) extras="[dev,eval]" ;;
    --python)
      [[ $# -ge 2 ]] || { echo "setup_env.sh: --python needs a version, e.g. --python 3.12" >&2; exit 2; }
      python=$(find_python "$2"); venv=".venv${2//./}"; shift ;;
    *) echo "setup_env.sh: unknown option $1 (use --dev and/or --python 3.12)" >&2; exit 2 ;;
  esac
  shift
done
"$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required")'
"$python" -m venv "$venv"
# torch first (with --dev also the torchvision built for it, which lmms-eval needs), so the
# requirements are already satisfied and pip pulls no other build.
"$venv"/bin/pip install --quiet torch==2.13.0 ${extras:+torchvision==0.28.0}
"$venv"/bin/pip install --quiet -e ".${extras}"
# PyPI's torchvision is built against CUDA torch; beside a CPU torch it cannot even be imported and
# breaks transformers' model classes. lmms-eval and transformers run without it.
if "$venv"/bin/pip show --quiet torchvision 2>/dev/null && ! "$venv"/bin/python -c 'import torchvision' 2>/dev/null; then
  "$venv"/bin/pip uninstall --quiet --yes torchvision
fi
# The tests compare with transformers' torchvision-backend processors (OneVision's video processor):
# they import this copy, outside site-packages, in a child process (tests/reference/torchvision_child says how).
if [[ -n "$extras" ]]; then
  "$venv"/bin/pip install --quiet --no-deps --upgrade --target "$venv"/torchvision-reference torchvision==0.28.0
fi
# The page tests open our HTML pages in a real headless browser: Debian's Chromium.
if [[ -n "$extras" ]] && ! command -v chromium >/dev/null; then
  if command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
    apt-get install -y -q chromium >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
  else
    echo "the page tests need Chromium: install it (Debian/Ubuntu: sudo apt-get install chromium)" >&2
  fi
fi
echo "environment ready: $venv ($("$venv"/bin/python -c 'from importlib.metadata import version as v; print("Python", __import__("platform").python_version(), "torch", v("torch"), "megatron-core", v("megatron-core"))'))"
echo "run the commands with $venv/bin/python (e.g. $venv/bin/python scripts/demo/run_demo.py), or first: source $venv/bin/activate"
