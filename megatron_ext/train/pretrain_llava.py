"""The Megatron LLaVA trainer's command line, started under torchrun (usually by the launcher, run.py).

    torchrun --nproc-per-node 2 -m megatron_ext.train.pretrain_llava --megatron-load-dir CKPT \
        --data-path DATA --save --save-dir OUT --tp 2 --stage 1 --train-iters 100

(`scripts/train/pretrain_llava.py` is the same command.) The launcher starts it as a module, so it
runs from an installed package as from a checkout. Every option is a field of
megatron_ext/config/options.py (see --help).
"""

import click

from megatron_ext import lifetime, rank_failures, stop_signals
from megatron_ext.errors import run_command
from megatron_ext.logs import setup_logging
from megatron_ext.train.cli import trainer_options

# The processes of a run end with the one that started them (megatron_ext/lifetime.py). At module
# level, so the helper processes megatron-core spawns (they import the main module again) do too.
lifetime.die_with_parent()


@click.command(context_settings={"max_content_width": 100})
@trainer_options
def main(config):
    setup_logging(verbose=config.debug)
    from megatron_ext.train.trainer import run

    return run(config)


if __name__ == "__main__":
    # Before run.py learns that this rank started: from then on it passes stopping signals to it.
    stop_signals.stop_request()
    rank_failures.mark_started()
    run_command(main)  # which leaves a failure for run.py (rank_failures.recorded)
