"""Running real scripts and torchrun jobs from tests, always with a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_ext.distributed import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent


_DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(gpu: bool = False, **extra: str) -> dict[str, str]:
    """This environment minus torch.distributed's variables (a child starts its own world). CPU tests'
    children see no GPU, so they run the same on a machine that has one; `gpu=True` keeps them visible."""
    env = {k: v for k, v in os.environ.items() if k not in _DISTRIBUTED_VARS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update(extra)
    return env


def _checked(cmd: list[str], proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_script(script: str, *args, timeout: float = 300, env: dict | None = None, check: bool = True,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python scripts/<script> args...`; output captured; a hang fails the test after `timeout` s."""
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / script), *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or child_env(),
                          cwd=cwd or REPO_ROOT)
    return _checked(cmd, proc, check)


def run_torchrun(nproc: int, target: str, *args, timeout: float = 300, env: dict | None = None,
                 check: bool = True) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N target args...` on a free port (target: a .py path or `-m module`)."""
    target_args = target.split() if target.startswith("-m ") else [target]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", *target_args, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or child_env(), cwd=REPO_ROOT)
    return _checked(cmd, proc, check)


def hf_tensors(hf_dir: Path) -> dict:
    """Every tensor of an HF checkpoint directory (all its safetensors files), by stored name."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(hf_dir).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
