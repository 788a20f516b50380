"""One self-contained HTML page of what the model sees of a dataset's samples, through the trainer's
task encoder (see megatron_ext/pages/inspector_page.py).

    python scripts/data/inspect_dataset.py DATA --megatron-load-dir CKPT [--split train] [--samples 8]
        [--seed 0 | --keys K1,K2] [--all] [--seq-length N] [--packing-seq-length N] [--output page.html]

DATA is a prepared energon dataset (or metadataset YAML), or LLaVA JSON / JSONL with --image-root.
"""

from megatron_ext.commands.data import inspect
from megatron_ext.errors import run_command

if __name__ == "__main__":
    run_command(inspect)
