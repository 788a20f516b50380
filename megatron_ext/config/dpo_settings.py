"""DPO's options checked and gathered (`--dpo-*`, `--rpo-alpha`): the run plan checks them before
anything starts, the loss (objectives/dpo/loss.py) computes with them."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.errors import UserError


@dataclass(frozen=True)
class DpoSettings:
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None

    @classmethod
    def of(cls, config) -> "DpoSettings":
        settings = cls(config.dpo_beta, config.dpo_loss, config.dpo_label_smoothing, config.rpo_alpha)
        if settings.beta <= 0:
            raise UserError(f"--dpo-beta {settings.beta} must be positive")
        if settings.loss == "robust" and not 0 <= settings.label_smoothing < 0.5:
            raise UserError(f"--dpo-label-smoothing {settings.label_smoothing} must be in [0, 0.5) (a flip rate)")
        if settings.loss != "robust" and settings.label_smoothing:
            raise UserError("--dpo-label-smoothing applies to --dpo-loss robust (the flip rate of Robust DPO)")
        return settings
