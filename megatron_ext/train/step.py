"""One training iteration: megatron-core's forward/backward schedule, then the optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from megatron_ext.model.forward_step import run_schedule, token_objective


@dataclass
class StepResult:
    loss: float  # mean over the global batch (tokens; DPO: pairs); nan when not finite
    loss_tokens: int  # what the loss is the mean over (DPO: pairs)
    grad_norm: float | None
    updated: bool  # False: skipped iteration or non-finite loss
    metrics: dict = field(default_factory=dict)  # the objective's own (DPO's rewards and log-probs)

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


def train_step(trained, forward_step, micro_batches: list[dict], seq_length: int, micro_batch_size: int,
               reduce=token_objective, before_update: Callable[[], None] = lambda: None,
               schedule_increment: int = 1) -> StepResult:
    """`reduce`: the step's loss-function outputs -> (loss, what it is the mean over, metrics);
    `before_update`: called when the gradients are final (reduced, scaled), before the optimizer clips
    and applies them (not when the loss is not finite); `schedule_increment`: how far the LR
    schedule advances (0: the caller advances it)."""
    trained.ddp.zero_grad_buffer()
    trained.optimizer.zero_grad()
    loss, count, metrics = reduce(run_schedule(trained.ddp, forward_step, micro_batches, seq_length, micro_batch_size,
                                               False))
    if not math.isfinite(loss):
        return StepResult(loss, count, None, updated=False, metrics=metrics)
    before_update()
    _, grad_norm, _ = trained.optimizer.step()
    trained.scheduler.step(increment=schedule_increment)
    return StepResult(loss, count, grad_norm, updated=True, metrics=metrics)
