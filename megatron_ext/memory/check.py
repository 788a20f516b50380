"""The memory plan (`memory/plan.py`) of the run about to start, printed, and the launch
refused in one line when its largest rank does not fit the GPU."""

from __future__ import annotations

from megatron_ext.config.run_plan import RunPlan
from megatron_ext.errors import UserError


def check_memory(plan: RunPlan, budget: int) -> list[str]:
    """The plan's lines; raises the one-line refusal when its largest rank does not fit `budget` bytes."""
    from megatron_ext.logs import quiet_megatron_core

    with quiet_megatron_core():
        from megatron_ext.memory.plan import memory_plan, plan_lines, refusal

        mp = memory_plan(plan, budget)
    if not mp.fits:
        raise UserError(refusal(plan, mp))
    return plan_lines(mp, plan.dtype)
