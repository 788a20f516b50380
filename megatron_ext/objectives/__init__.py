"""Training objectives as peers (`sft`, `dpo/`) behind `base.Objective`; the run's is chosen here,
once, from its plan. Nothing outside this package names one."""

from __future__ import annotations

from megatron_ext.config.run_plan import RunPlan
from megatron_ext.model.inputs import ModelInputs
from megatron_ext.objectives.base import Objective


def for_run(plan: RunPlan, trained, inputs: ModelInputs) -> Objective:
    """The objective `plan` trains with, for the trainer's `TrainingModel` and its `inputs`."""
    if plan.config.stage == "dpo":
        from megatron_ext.objectives.dpo.objective import DpoObjective

        return DpoObjective(plan, trained, inputs)
    from megatron_ext.objectives.sft import SftObjective

    return SftObjective(plan, trained, inputs)
