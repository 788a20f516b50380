"""Launch LLaVA training: torchrun on one or many nodes, optionally inside a Singularity image, under SLURM or not.

    python scripts/train/run.py -g 8 --tp 4 --pp 1 --name run1 --megatron-load-dir CKPT \
        --tokenizer-load-dir HF_DIR --save --save-dir OUT --data-path DATA --sif-path image.sif \
        --stage 2 --save-interval 2000 -- --lr 1e-5 --seq-length 2048

Trainer options without a flag here go after `--`. --dry-run prints the exact command and exits.
Flags, defaults and examples: docs/launcher.md.
"""

import sys

from megatron_ext.commands.train import launch
from megatron_ext.launch.flags import invoke

if __name__ == "__main__":
    invoke(launch, sys.argv[1:])
