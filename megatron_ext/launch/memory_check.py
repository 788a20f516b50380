"""The memory plan (`train/memory_plan.py`) of the run about to start, printed, and the launch
refused in one line when its largest rank does not fit the GPU."""

from __future__ import annotations

from typing import Mapping

from megatron_ext.errors import UserError
from megatron_ext.launch.devices import gpu_memory
from megatron_ext.train.plan import RunPlan


def budget(values: dict, env: Mapping[str, str]) -> int:
    """--gpu-memory in bytes (given in GiB), else the visible GPU's, else 80 GiB."""
    given = values.get("gpu_memory")
    if given is None:
        return gpu_memory(env)
    if given <= 0:
        raise UserError(f"--gpu-memory {given} must be > 0 (GiB per GPU)")
    return int(given * 2**30)


def check_memory(plan: RunPlan, values: dict, env: Mapping[str, str]) -> list[str]:
    """The plan's lines; raises the one-line refusal when it does not fit."""
    from megatron_ext.logs import quiet_megatron_core

    with quiet_megatron_core():
        from megatron_ext.train.memory_plan import memory_plan, plan_lines, refusal

        mp = memory_plan(plan, budget(values, env))
    if not mp.fits:
        raise UserError(refusal(plan, mp))
    return plan_lines(mp, plan.dtype)
