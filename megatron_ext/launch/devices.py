"""How many CUDA GPUs this node has, found without importing torch (the launcher must start fast)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Mapping

from megatron_ext.errors import UserError

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def physical_gpu_count() -> int:
    """GPUs of the machine: `nvidia-smi -L`, else the NVIDIA driver's /proc entries, else 0."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.TimeoutExpired):
        pass
    return len(list(PROC_GPUS.iterdir())) if PROC_GPUS.is_dir() else 0


def visible_gpu_count(physical: int, env: Mapping[str, str]) -> int:
    """Of the `physical` GPUs, those a process started with `env` can use: CUDA_VISIBLE_DEVICES narrows them ("" hides all)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if physical == 0 or visible is None:
        return physical
    return len([item for item in visible.split(",") if item.strip()])


def parse_gpu_ids(gpu_ids: str, physical: int) -> list[str]:
    """--gpu-ids `0,2,3` -> ["0", "2", "3"], checked against the GPUs present."""
    ids = [item.strip() for item in gpu_ids.split(",")]
    if not all(ids):
        raise UserError(f"--gpu-ids {gpu_ids!r}: expected comma-separated GPU ids such as 0,1,2,3")
    if len(set(ids)) != len(ids):
        raise UserError(f"--gpu-ids {gpu_ids!r} lists a GPU twice")
    if physical == 0:
        raise UserError(f"--gpu-ids {gpu_ids}: no CUDA GPU found on this machine (nvidia-smi -L lists none)")
    bad = [i for i in ids if i.isdigit() and int(i) >= physical]
    if bad:
        raise UserError(f"--gpu-ids {gpu_ids}: GPU {bad[0]} does not exist; this machine has GPUs 0-{physical - 1}")
    return ids


# What the memory plan assumes without a GPU to ask: an 80 GB A100 / H100.
DEFAULT_GPU_MEMORY = 80 * 2**30


def gpu_memory(env: Mapping[str, str]) -> int:
    """Bytes of the first GPU that `env` makes visible (`nvidia-smi`, in MiB), else DEFAULT_GPU_MEMORY."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    first = visible.split(",")[0].strip() if visible else "0"
    try:
        out = subprocess.run(["nvidia-smi", f"--id={first}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return DEFAULT_GPU_MEMORY
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines or not lines[0].strip().isdigit():
        return DEFAULT_GPU_MEMORY
    return int(lines[0].strip()) * 2**20


def budget(given: float | None, env: Mapping[str, str]) -> int:
    """--gpu-memory (`given`, GiB) in bytes, else the visible GPU's, else 80 GiB."""
    if given is None:
        return gpu_memory(env)
    if given <= 0:
        raise UserError(f"--gpu-memory {given} must be > 0 (GiB per GPU)")
    return int(given * 2**30)
