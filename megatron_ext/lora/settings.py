"""LoRA settings from the trainer's options, checked. Imports no torch (the launcher's --dry-run uses it)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.errors import UserError

# --lora-targets names -> the language-model layer's linear layer they wrap.
TARGETS = {
    "qkv": "self_attention.linear_qkv",
    "proj": "self_attention.linear_proj",
    "fc1": "mlp.linear_fc1",
    "fc2": "mlp.linear_fc2",
}


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]  # keys of TARGETS
    train_projector: bool

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def lora_settings(config) -> LoraSettings | None:
    """The LoRA settings of a (resolved) TrainConfig, or None when --lora-rank is 0."""
    if config.lora_rank == 0:
        return None
    if config.lora_rank < 0:
        raise UserError(f"--lora-rank {config.lora_rank} must be >= 1 (or 0 for full fine-tuning)")
    if config.stage == 1:  # the projector alone trains
        raise UserError("--lora-rank trains adapters on the language model: use it with --stage 2 or --stage dpo")
    if config.unfreeze_vit:
        raise UserError("--lora-rank with --unfreeze-vit is not supported: LoRA adapts the language model only")
    if config.lora_alpha <= 0:
        raise UserError(f"--lora-alpha {config.lora_alpha} must be > 0")
    if not 0.0 <= config.lora_dropout < 1.0:
        raise UserError(f"--lora-dropout {config.lora_dropout} must be in [0, 1)")
    targets = tuple(t.strip() for t in config.lora_targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        what = f"no target {', '.join(unknown)}" if unknown else "no targets"
        raise UserError(f"--lora-targets {config.lora_targets!r}: {what}; give a comma-separated subset of "
                        + ", ".join(f"{name} ({layer})" for name, layer in TARGETS.items()))
    return LoraSettings(rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout,
                        targets=tuple(dict.fromkeys(targets)), train_projector=config.lora_train_projector)


def saved_settings(options: dict) -> LoraSettings:
    """The settings a LoRA run saved in its run config (`TrainConfig` fields), for inference (no dropout)."""
    return LoraSettings(rank=options["lora_rank"], alpha=options["lora_alpha"], dropout=0.0,
                        targets=tuple(options["lora_targets"].split(",")), train_projector=options["lora_train_projector"])
