"""DPO as the trainer's objective: the step's reference pass, then megatron-core's schedule with
the DPO loss; the loss is the mean over the global batch's pairs (megatron's per-token-loss mode
with a pair as the unit), so every layout gives the same number.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from megatron_ext.config.dpo_settings import DpoSettings
from megatron_ext.config.run_plan import RunPlan
from megatron_ext.distributed import device
from megatron_ext.model.forward_step import make_forward_step, reduce_sums, run_schedule
from megatron_ext.model.inputs import ModelInputs
from megatron_ext.train.dpo.loss import METRICS, metric_sums, pair_losses
from megatron_ext.train.dpo.reference import PrecomputedReference, Reference
from megatron_ext.train.dpo.sequences import PairPositions
from megatron_ext.train.model_setup import TrainingModel
from megatron_ext.train.step import StepResult, train_step

# The loss functions' report: loss sum, pairs, then METRICS' sums.
REPORT = 2 + len(METRICS)


class DpoObjective:
    def __init__(self, plan: RunPlan, trained: TrainingModel, inputs: ModelInputs):
        self.settings = DpoSettings.of(plan.config)
        self.inputs = inputs
        self.trained = trained
        self.reference = (PrecomputedReference(plan, trained, inputs) if plan.config.reference_logprobs == "precompute"
                          else Reference.live(plan, trained, inputs))
        self.forward_step = make_forward_step(inputs, loss_of=self._loss_of)
        self.seq_length, self.micro_batch_size = plan.seq_length, plan.config.micro_batch_size
        self._rpo_scale: torch.Tensor | None = None

    def _loss_of(self, batch: dict, kwargs: dict, loss_mask: torch.Tensor):
        pairs = PairPositions.of(batch)
        return partial(self._loss, pairs, batch, kwargs, loss_mask)

    def _loss(self, pairs: PairPositions, batch: dict, kwargs: dict, loss_mask: torch.Tensor, output: torch.Tensor):
        logps = pairs.logps(output, loss_mask, kwargs["input_ids"], self.inputs)
        ref = batch["ref_logps"]
        total = pair_losses(self.settings, logps, ref, pairs.tokens.to(logps.device)).sum()
        if self.settings.rpo_alpha:
            # alpha x NLL per chosen token of the global batch, as a share of the pair-mean loss.
            total = total + self.settings.rpo_alpha * self._rpo_scale * -logps[:, 0].sum()
        count = torch.full((), pairs.count, dtype=torch.int, device=output.device)
        report = torch.cat([total.detach()[None], count.float()[None], metric_sums(self.settings, logps, ref)])
        return total, count, {"dpo": report}

    def _prepare(self, micro_batches: list[dict]) -> None:
        self.reference.attach(micro_batches)
        if self.settings.rpo_alpha:
            from megatron.core import parallel_state

            # Pairs and chosen-answer tokens of the global batch: one all-reduce, never read back.
            counts = torch.zeros(2, dtype=torch.float64)
            for batch in micro_batches:
                tokens = PairPositions.of(batch).tokens
                counts += torch.tensor([tokens.shape[0], tokens[:, 0].sum()], dtype=torch.float64)
            counts = counts.to(device())
            torch.distributed.all_reduce(counts, group=parallel_state.get_data_parallel_group())
            self._rpo_scale = (counts[0] / counts[1]).float()

    @staticmethod
    def _reduce(outputs: list[dict]) -> tuple[float, int, dict]:
        total, pairs, *sums = reduce_sums(outputs, "dpo", REPORT)
        metrics = {name: value / pairs if pairs else float("nan") for name, value in zip(METRICS, sums)}
        return (total / pairs if pairs else float("nan")), int(pairs), metrics

    def train_step(self, micro_batches: list[dict], before_update: Callable[[], None] = lambda: None,
                   schedule_increment: int = 1) -> StepResult:
        self._prepare(micro_batches)
        return train_step(self.trained, self.forward_step, micro_batches, self.seq_length, self.micro_batch_size,
                          reduce=self._reduce, before_update=before_update, schedule_increment=schedule_increment)

    def evaluate(self, micro_batches: list[dict]) -> tuple[float, int, dict]:
        """(loss, pairs, metrics) of one global batch, forward only."""
        self._prepare(micro_batches)
        if not micro_batches:  # as model.forward_step.eval_loss: this rank adds nothing
            return self._reduce([])
        with torch.no_grad():
            return self._reduce(run_schedule(self.trained.ddp, self.forward_step, micro_batches, self.seq_length,
                                             self.micro_batch_size, True))
