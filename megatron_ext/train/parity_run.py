"""The parity check's run of our trainer, under torchrun: the real Trainer, which also saves every
global batch it trains on, so the transformers loop (`train.hf_loop`) replays exactly those samples.

    torchrun --nproc-per-node N -m megatron_ext.train.parity_run RECORD_DIR CONFIG_JSON

CONFIG_JSON: a TrainConfig's fields. RECORD_DIR/step_{i}_dp_{r}.pt: the micro batches data-parallel
replica r trained on at iteration i (written by the replica's first TP/PP/CP rank; its peers hold
the same ones). Losses and gradient norms are the trainer's own metrics.jsonl (--save-dir).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from megatron_ext import lifetime
from megatron_ext.train.options import TrainConfig
from megatron_ext.train.trainer import Trainer, run

lifetime.die_with_parent()

# What the transformers loop needs of a micro batch (the rest is the trainer's bookkeeping).
RECORDED = ("images", "media_layout", "image_index", "input_ids", "labels", "loss_mask", "segment_ids", "keys")


def batch_file(record_dir: Path, iteration: int, replica: int) -> Path:
    return Path(record_dir) / f"step_{iteration}_dp_{replica}.pt"


class RecordingTrainer(Trainer):
    record_dir: Path

    def _iteration(self):
        from megatron.core import parallel_state

        result, micro_batches, batch, stop = super()._iteration()
        if self.counts_batch:
            path = batch_file(self.record_dir, self.iteration, parallel_state.get_data_parallel_rank())
            torch.save([{k: b[k] for k in RECORDED if k in b} for b in micro_batches], path)
        return result, micro_batches, batch, stop


def main(argv: list[str]) -> int:
    record_dir, config_json = Path(argv[0]), Path(argv[1])
    record_dir.mkdir(parents=True, exist_ok=True)
    RecordingTrainer.record_dir = record_dir
    return run(TrainConfig(**json.loads(config_json.read_text())), RecordingTrainer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
