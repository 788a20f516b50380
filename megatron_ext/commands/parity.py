"""megatron-ext-parity (= scripts/train/check_parity.py): does our trainer train the model transformers
would? (megatron_ext/verify/parity.py)

    megatron-ext-parity --hf-dir HF --data-path DATA --steps 3 --stage 2 [-g 2 --tp 2]
        [--packing-seq-length 512] [--optimizer sgd] [--lora-rank 8] [--set lr=1e-4 --set weight_decay=0.1 ...]

Prints one row per step (learning rate, loss and gradient norm of both sides, relative differences)
and per module the largest weight difference and the largest relative difference of a first-step
gradient; exits 0 within tolerance, 1 otherwise.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path

import click

from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import UserError, run_command


def _default(name: str):
    """A trainer option's default, so the check runs what the trainer runs when a flag is not given."""
    return TrainConfig.__dataclass_fields__[name].default


def _settings(values: tuple[str, ...]) -> dict:
    """`--set name=value` pairs; values are JSON where they parse (numbers, true/false), else strings."""
    out = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--set {item!r}: expected NAME=VALUE with a trainer option's name, e.g. lr=1e-4")
        try:
            out[name.replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[name.replace("-", "_")] = value
    return out


@click.command(context_settings={"max_content_width": 110, "help_option_names": ["-h", "--help"]})
@click.option("--hf-dir", required=True, type=click.Path(exists=True, file_okay=False), help="HF LLaVA checkpoint.")
@click.option("--megatron-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="HF-DIR converted already (hf-to-megatron, TP1 x PP1); default: converted in --work-dir.")
@click.option("--data-path", required=True, help="Prepared energon dataset (the trainer's --data-path).")
@click.option("--steps", default=3, show_default=True, help="Optimizer steps on each side.")
@click.option("-g", "--gpus", default=1, show_default=True, help="Processes of our run (CPU processes without CUDA).")
@click.option("--tp", default=1, show_default=True)
@click.option("--pp", default=1, show_default=True)
@click.option("--stage", default=2, show_default=True, type=click.IntRange(1, 2))
@click.option("--micro-batch-size", default=1, show_default=True)
@click.option("--global-batch-size", default=4, show_default=True)
@click.option("--seq-length", type=int, default=None, help="Default: the trainer's.")
@click.option("--packing-seq-length", type=int, default=None)
@click.option("--dist-optim", is_flag=True)
@click.option("--optimizer", type=click.Choice(["adam", "sgd"]), default=_default("optimizer"), show_default=True,
              help="Both sides: AdamW, or SGD (torch.optim.SGD), whose final weights are pinned far tighter.")
@click.option("--sgd-momentum", type=float, default=_default("sgd_momentum"), show_default=True)
@click.option("--lora-rank", type=int, default=_default("lora_rank"), show_default=True,
              help="LoRA (stage 2): our adapters against a PEFT model that starts from them.")
@click.option("--lora-alpha", type=float, default=_default("lora_alpha"), show_default=True)
@click.option("--lora-targets", default=_default("lora_targets"), show_default=True)
@click.option("--lora-train-projector", is_flag=True)
@click.option("--set", "settings", multiple=True, help="Any other trainer option, NAME=VALUE (repeatable).")
@click.option("--rtol", type=float, default=None, help="Relative tolerance of losses and gradient norms "
              "[default: 1e-5 in fp32, 3e-2 in bf16, a GPU's default dtype].")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, help="Where the converted and trained "
              "checkpoints go (default: a temporary directory, removed afterwards).")
def check_parity(hf_dir, megatron_dir, data_path, steps, gpus, tp, pp, stage, micro_batch_size, global_batch_size, seq_length,
                 packing_seq_length, dist_optim, optimizer, sgd_momentum, lora_rank, lora_alpha, lora_targets,
                 lora_train_projector, settings, rtol, work_dir):
    """Train STEPS steps with our trainer and with a plain PyTorch loop on transformers' model (with
    --lora-rank a PEFT model), on the same global batches, and compare them step by step, gradient
    by gradient and weight by weight."""
    from megatron_ext.verify.parity import check_parity as check

    options = {"tp": tp, "pp": pp, "stage": stage, "micro_batch_size": micro_batch_size,
               "global_batch_size": global_batch_size, "seq_length": seq_length,
               "packing_seq_length": packing_seq_length, "dist_optim": dist_optim, "optimizer": optimizer,
               "sgd_momentum": sgd_momentum, "lora_rank": lora_rank, "lora_alpha": lora_alpha,
               "lora_targets": lora_targets, "lora_train_projector": lora_train_projector, **_settings(settings)}
    given = contextlib.nullcontext(work_dir) if work_dir else tempfile.TemporaryDirectory(prefix="parity-")
    with given as out:
        Path(out).mkdir(parents=True, exist_ok=True)
        report = check(hf_dir, data_path, Path(out), steps, gpus, options, rtol=rtol,
                       megatron_dir=Path(megatron_dir) if megatron_dir else None)
    click.echo(report.table())
    return 0 if report.ok else 1


def main() -> None:
    run_command(check_parity)


if __name__ == "__main__":
    main()
