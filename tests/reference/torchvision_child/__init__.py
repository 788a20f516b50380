"""transformers' torchvision-backend processors (OneVision's video processor among them), run in a
child process for the tests and benchmarks to compare with.

PyPI's torchvision is built against CUDA torch: beside this project's CPU torch its compiled ops
do not load, and importing it fails where it registers fake kernels for two of them (`nms`,
`qnms`). Everything transformers' processors call is torchvision's Python over torch's own
kernels (`interpolate`, arithmetic), so the child declares those two op schemas (never called)
before importing it; beside PyPI's CUDA torch (the Python 3.12 venv) the ops load, and it uses them. `scripts/setup_env.sh --dev` keeps torchvision outside site-packages
(`.venv/torchvision-reference`), so that transformers in every other process runs without it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from tests.support.helpers import child_env, run_python

TORCHVISION_DIR = Path(sys.prefix) / "torchvision-reference"
WORKER = Path(__file__).with_name("worker.py")


def available() -> bool:
    return (TORCHVISION_DIR / "torchvision").is_dir()


def call(task: str, work: Path, timeout: float = 240, **arguments):
    """The result of worker.py's `task` on `arguments` (tensors, arrays, paths, plain values)."""
    return call_many(work, [(task, arguments)], timeout)[0]


def call_many(work: Path, requests: list[tuple[str, dict]], timeout: float = 240) -> list:
    """The results of worker.py's tasks on their arguments, all in one child: its start (torch,
    transformers, torchvision) is most of a task's time."""
    if not available():
        raise AssertionError(f"no torchvision at {TORCHVISION_DIR}: run `bash scripts/setup_env.sh --dev`")
    work.mkdir(parents=True, exist_ok=True)
    request, result = work / "requests.pt", work / "results.pt"
    torch.save([{"task": task, **arguments} for task, arguments in requests], request)
    env = child_env(PYTHONPATH=os.pathsep.join([str(TORCHVISION_DIR), str(WORKER.parents[2])]))
    run_python(WORKER, request, result, timeout=timeout, env=env)
    return torch.load(result, weights_only=False)
