"""megatron-ext-train: the launcher (scripts/train/run.py runs the same command).

    megatron-ext-train -g 8 --tp 4 --pp 1 --name run1 --megatron-load-dir CKPT --save --save-dir OUT \
        --data-path DATA [--sif-path image.sif] --stage 2 -- --lr 1e-5 --seq-length 2048

Trainer options without a flag here go after `--`. --dry-run prints the exact command and exits.
Flags, defaults and examples: docs/launcher.md.
"""

import sys

import click

from megatron_ext.launch.flags import invoke, launcher_options


@click.command(context_settings={"max_content_width": 110, "help_option_names": ["-h", "--help"]})
@launcher_options
@click.pass_obj
def launch(passthrough, **values):
    """Launch the trainer (megatron_ext/train/pretrain_llava.py) under torchrun. Trainer options without a flag here go after `--`."""
    from megatron_ext.launch.launcher import main as run_launcher

    return run_launcher(values, passthrough)


def main() -> None:
    invoke(launch, sys.argv[1:])


if __name__ == "__main__":
    main()
