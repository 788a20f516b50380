"""Launch LLaVA training: torchrun on one or many nodes, optionally inside a Singularity image, under SLURM or not.

    python scripts/train/run.py -g 8 --tp 4 --pp 1 --name run1 --megatron-load-dir CKPT \
        --tokenizer-load-dir HF_DIR --save --save-dir OUT --data-path DATA --sif-path image.sif \
        --stage 2 --save-interval 2000 -- --lr 1e-5 --seq-length 2048

Trainer options without a flag here go after `--`. --dry-run prints the exact command and exits.
Flags, defaults and examples: docs/launcher.md.
"""

import sys

import click

from megatron_ext.launch.flags import invoke, launcher_options


@click.command(context_settings={"max_content_width": 110, "help_option_names": ["-h", "--help"]})
@launcher_options
@click.pass_obj
def main(passthrough, **values):
    """Launch scripts/train/pretrain_llava.py under torchrun. Trainer options without a flag here go after `--`."""
    from megatron_ext.launch.launcher import main as launch

    return launch(values, passthrough)


if __name__ == "__main__":
    invoke(main, sys.argv[1:])
