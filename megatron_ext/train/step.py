"""One training iteration: megatron-core's forward/backward schedule, then the optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ext.model.forward_step import reduce_loss, run_schedule


@dataclass
class StepResult:
    loss: float  # token-weighted mean over the global batch (nan when not finite)
    loss_tokens: int
    grad_norm: float | None
    updated: bool  # False: skipped iteration or non-finite loss

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


def train_step(trained, forward_step, micro_batches: list[dict], seq_length: int, micro_batch_size: int) -> StepResult:
    trained.ddp.zero_grad_buffer()
    trained.optimizer.zero_grad()
    loss, tokens = reduce_loss(run_schedule(trained.ddp, forward_step, micro_batches, seq_length, micro_batch_size, False))
    if not math.isfinite(loss):
        return StepResult(loss, tokens, None, updated=False)
    _, grad_norm, _ = trained.optimizer.step()
    trained.scheduler.step(increment=1)
    return StepResult(loss, tokens, grad_norm, updated=True)
