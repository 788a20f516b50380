"""DPO losses and metrics from per-pair sequence log-probabilities, as TRL's DPOTrainer (1.16)
computes them (tests/train/test_dpo.py compares the two).

A pair's log-probability is the sum over its answer's tokens. Losses (`--dpo-loss`):
- sigmoid: -log sigmoid(beta * delta), delta = (chosen - ref chosen) - (rejected - ref rejected);
- ipo: (delta per answer token - 1 / (2 beta))^2, each side's log-ratio divided by its answer's
  token count (TRL's normalisation, confirmed with IPO's authors);
- robust: sigmoid with preference labels flipped at rate `--dpo-label-smoothing` (Robust DPO;
  TRL's `label_smoothing` applies to this loss, not to sigmoid).
`--rpo-alpha` adds alpha x the mean negative log-likelihood per chosen-answer token (TRL's
`loss_type=["sigmoid", "sft"]`, `loss_weights=[1, alpha]`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext.config.dpo_settings import DpoSettings

# Logged per step (means over the global batch's pairs), by TRL's names.
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def pair_losses(settings: DpoSettings, logps: torch.Tensor, ref: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[P] DPO loss of each pair; `logps`, `ref`: [P, 2] (chosen, rejected); `tokens`: [P, 2] answer tokens."""
    ratios = logps - ref
    delta = ratios[:, 0] - ratios[:, 1]
    if settings.loss == "sigmoid":
        return -F.logsigmoid(settings.beta * delta)
    if settings.loss == "ipo":
        per_token = ratios / tokens.clamp(min=1)
        return (per_token[:, 0] - per_token[:, 1] - 1 / (2 * settings.beta)) ** 2
    flip = settings.label_smoothing
    return (-(1 - flip) * F.logsigmoid(settings.beta * delta) + flip * F.logsigmoid(-settings.beta * delta)) / (1 - 2 * flip)


def metric_sums(settings: DpoSettings, logps: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[len(METRICS)] sums over the pairs; divided by the global batch's pairs they are TRL's metrics."""
    rewards = settings.beta * (logps - ref).detach()
    chosen, rejected = rewards[:, 0], rewards[:, 1]
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), (chosen - rejected).sum(),
                        logps[:, 0].detach().sum(), logps[:, 1].detach().sum()])
