"""DPO as the trainer's objective: the step's reference pass, then megatron-core's schedule with
the DPO loss; the loss is the mean over the global batch's pairs (megatron's per-token-loss mode
with a pair as the unit), so every layout gives the same number.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Callable, Iterable

import torch

from megatron_ext.config.dpo_settings import DpoSettings
from megatron_ext.config.run_plan import RunPlan
from megatron_ext.distributed import device
from megatron_ext.model.forward_step import reduce_sums
from megatron_ext.model.inputs import ModelInputs
from megatron_ext.objectives.base import Objective
from megatron_ext.objectives.dpo.loss import METRICS, metric_sums, pair_losses
from megatron_ext.objectives.dpo.reference import PrecomputedReference, Reference
from megatron_ext.objectives.dpo.sequences import PairPositions

log = logging.getLogger(__name__)

# The loss functions' report: loss sum, pairs, then METRICS' sums.
REPORT = 2 + len(METRICS)


class DpoObjective(Objective):
    def __init__(self, plan: RunPlan, trained, inputs: ModelInputs):
        super().__init__(plan, trained, inputs)
        self.settings = DpoSettings.of(plan.config)
        self.resumed = plan.resume is not None
        self.train_pairs = plan.train_split.samples
        self.reference = (PrecomputedReference(plan, trained, inputs) if plan.config.reference_logprobs == "precompute"
                          else Reference.live(plan, trained, inputs))
        self._rpo_scale: torch.Tensor | None = None

    def loss_of(self, batch: dict, kwargs: dict, loss_mask: torch.Tensor):
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

    def start(self, passes: Callable[[], Iterable[list[dict]]]) -> None:
        """The precomputed reference: a fresh run computes its log-probabilities with the starting
        weights; a resumed run reads what it stored."""
        if not isinstance(self.reference, PrecomputedReference):
            return
        if self.resumed:
            self.reference.load()
        else:
            log.info("computing the reference log-probabilities of the %d training pairs", self.train_pairs)
            self.reference.precompute(passes())

    def prepare(self, micro_batches: list[dict]) -> None:
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

    def reduce(self, outputs: list[dict]) -> tuple[float, int, dict]:
        total, pairs, *sums = reduce_sums(outputs, "dpo", REPORT)
        metrics = {name: value / pairs if pairs else float("nan") for name, value in zip(METRICS, sums)}
        return (total / pairs if pairs else float("nan")), int(pairs), metrics

    def summary(self, loss: float, count: int, metrics: dict) -> dict:
        """The DPO loss and TRL's metrics over the val pairs (means over pairs)."""
        return {"pairs": count, "loss": loss, **metrics}
