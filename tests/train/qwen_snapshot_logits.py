"""Worker for test_qwen_vl_training (one rank): a trained snapshot's logits on the tiny model's samples.

Usage: qwen_snapshot_logits.py SAVE_DIR OUT_DIR SUPPORT

The snapshot is loaded as generation loads it (`lora.checkpoint.load_for_inference`: an adapter
snapshot on its base, adapters unmerged), and OUT_DIR/SAMPLE.pt holds its full-vocabulary logits on
each of the SUPPORT module's `samples()` (tests.support.qwen2_5_vl or qwen3_vl).
"""

import importlib
import sys
from pathlib import Path

import torch

from tests.families.qwen_vl_worker import logits


def main():
    from megatron_ext import families
    from megatron_ext.checkpoint.layout import find_snapshot
    from megatron_ext.distributed import init_parallel, shutdown
    from megatron_ext.lora.checkpoint import load_for_inference
    from megatron_ext.model.provider import ModelOptions

    save, out = Path(sys.argv[1]), Path(sys.argv[2])
    init_parallel(1, 1)
    snapshot = find_snapshot(save)
    model = families.build_model(snapshot.arch, ModelOptions(seq_length=512, init_weights=False, parallel_output=False))
    load_for_inference(model, snapshot)
    model.eval()
    for name, sample in importlib.import_module(sys.argv[3]).samples().items():
        torch.save(logits(model, sample, snapshot.arch.text.vocab_size), out / f"{name}.pt")
    shutdown()


if __name__ == "__main__":
    main()
