"""What the trainer asks of a training objective: its loss inside megatron-core's schedule, how a
step's loss outputs become the logged loss and metrics, and its evaluation of the val batches.

The trainer runs the step itself (`train.step.train_step` with `forward_step` and `reduce`), so an
objective never touches the optimizer; it is chosen once per run by `objectives.for_run`.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

import torch

from megatron_ext.config.run_plan import RunPlan
from megatron_ext.model.forward_step import make_forward_step, run_schedule
from megatron_ext.model.inputs import ModelInputs

log = logging.getLogger(__name__)

NOTHING_EVALUATED = ("evaluation scored nothing (loss nan): every val sample was skipped or has no trained "
                     "tokens (too long for --seq-length? see the skipped counts); the val split needs usable samples")


class Objective:
    """A subclass gives `loss_of` (the loss function of a micro batch's output, as
    `model.forward_step.make_forward_step` takes it), `reduce` and `summary`."""

    def __init__(self, plan: RunPlan, trained, inputs: ModelInputs):
        """`trained`: the trainer's `TrainingModel`; `inputs`: how batches are laid out for it."""
        self.trained = trained
        self.inputs = inputs
        self.seq_length, self.micro_batch_size = plan.seq_length, plan.config.micro_batch_size
        self.forward_step = make_forward_step(inputs, loss_of=self.loss_of)

    def loss_of(self, batch: dict, kwargs: dict, loss_mask: torch.Tensor):
        raise NotImplementedError

    def reduce(self, outputs: list[dict]) -> tuple[float, int, dict]:
        """A global batch's loss-function outputs -> (loss, what it is the mean over, metrics)."""
        raise NotImplementedError

    def summary(self, loss: float, count: int, metrics: dict) -> dict:
        """The val record's fields for an evaluation's means."""
        raise NotImplementedError

    def start(self, passes: Callable[[], Iterable[list[dict]]]) -> None:
        """Called once before training; `passes()`: one pass over the train and val global batches."""

    def prepare(self, micro_batches: list[dict]) -> None:
        """Called before the schedule runs `micro_batches` (training or evaluation)."""

    def evaluate_batch(self, micro_batches: list[dict]) -> tuple[float, int, dict]:
        """(loss, count, metrics) of one global batch, forward only. No `micro_batches` (a data-parallel
        rank whose share of a small split is used up): this rank adds nothing to the others' sums."""
        self.prepare(micro_batches)
        if not micro_batches:
            return self.reduce([])
        with torch.no_grad():
            return self.reduce(run_schedule(self.trained.ddp, self.forward_step, micro_batches, self.seq_length,
                                            self.micro_batch_size, True))

    def evaluate(self, groups: list[list[dict]]) -> dict:
        """The val record's fields: the means over every group's loss units."""
        sums, count = {}, 0
        for micro_batches in groups:
            loss, n, metrics = self.evaluate_batch(micro_batches)
            for name, value in {"loss": loss, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + value * n
            count += n
        if not count:
            log.warning(NOTHING_EVALUATED)
        means = {name: value / count if count else float("nan") for name, value in sums.items()}
        return self.summary(means.pop("loss", float("nan")), count, means)
