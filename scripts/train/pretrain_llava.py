"""The Megatron LLaVA trainer, started under torchrun (usually by scripts/train/run.py).

    torchrun --nproc-per-node 2 scripts/train/pretrain_llava.py --megatron-load-dir CKPT \
        --data-path DATA --save --save-dir OUT --tp 2 --stage 1 --train-iters 100

The same command as `torchrun ... -m megatron_ext.train.pretrain_llava` (megatron_ext/train/pretrain_llava.py).
"""

from megatron_ext.errors import run_command
from megatron_ext.train.pretrain_llava import main

if __name__ == "__main__":
    run_command(main)
