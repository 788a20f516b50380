"""Each training objective as the run plan and the memory plan need it, with no torch imported:
the data it trains on, what it refuses, and whether it holds a second model. What it computes is
`megatron_ext.objectives`; both are chosen by `--stage` here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_ext.checkpoint import layout
from megatron_ext.config.dpo_settings import DpoSettings
from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import UserError


def _no_checks(config: TrainConfig, start: layout.Snapshot | None) -> None:
    pass


def _no_reference_copy(config: TrainConfig) -> bool:
    return False


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    pairs: bool  # trains on preference pairs (`data.pairs`), else on conversations
    # The run plan's checks of the options (`start`: the checkpoint it starts from).
    check: Callable[[TrainConfig, layout.Snapshot | None], None] = _no_checks
    # The memory plan: a second, frozen model of the trained model's parameters.
    reference_copy: Callable[[TrainConfig], bool] = _no_reference_copy


def _check_dpo(config: TrainConfig, start: layout.Snapshot | None) -> None:
    DpoSettings.of(config)
    if start is None:
        raise UserError("--stage dpo needs --megatron-load-dir: the checkpoint to tune, which is also the reference policy")
    if config.cp > 1:
        raise UserError("--stage dpo does not support --cp: a pair's sequences are summed whole on one rank")
    if config.eval_generate_samples or config.eval_benchmarks:
        raise UserError("--stage dpo evaluates the DPO loss and rewards on the val pairs; generate answers or score "
                        "benchmarks with scripts/eval on the saved checkpoint")


def _dpo_reference_copy(config: TrainConfig) -> bool:
    """The live reference without LoRA is a frozen copy; with LoRA it is the adapters switched off."""
    return config.reference_logprobs == "live" and not config.lora_rank


SFT = ObjectiveSpec("sft", pairs=False)
DPO = ObjectiveSpec("dpo", pairs=True, check=_check_dpo, reference_copy=_dpo_reference_copy)


def objective_of(config: TrainConfig) -> ObjectiveSpec:
    """LLaVA's stages 1 and 2 fine-tune on conversations; --stage dpo tunes on preference pairs."""
    return DPO if config.stage == "dpo" else SFT
