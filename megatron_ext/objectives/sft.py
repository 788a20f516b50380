"""Supervised fine-tuning (LLaVA's stages 1 and 2): the language-model loss over the answer tokens,
a token-weighted mean over the global batch (`model.forward_step`, which scripts/eval/evaluate.py
shares, so both report the same number); evaluation adds its perplexity."""

from __future__ import annotations

import math

import torch

from megatron_ext.model.forward_step import token_loss, token_objective
from megatron_ext.objectives.base import Objective


class SftObjective(Objective):
    def loss_of(self, batch: dict, kwargs: dict, loss_mask: torch.Tensor):
        return token_loss(batch, kwargs, loss_mask)

    def reduce(self, outputs: list[dict]) -> tuple[float, int, dict]:
        return token_objective(outputs)

    def summary(self, loss: float, count: int, metrics: dict) -> dict:
        return {"loss": loss, "perplexity": math.exp(loss) if count else float("nan"), "loss_tokens": count}
