"""The parity check's run of our trainer, under torchrun (on a CPU forked: `verify.parity._forked_ranks`):
the real Trainer, which also saves every global batch it trains on, so the transformers loop
(`verify.hf_loop`) replays exactly those samples.

    torchrun --nproc-per-node N -m megatron_ext.verify.parity_run RECORD_DIR CONFIG_JSON

CONFIG_JSON: a TrainConfig's fields. RECORD_DIR/step_{i}_dp_{r}.pt: the micro batches data-parallel
replica r trained on at iteration i (written by the replica's first TP/PP/CP rank; its peers hold
the same ones). RECORD_DIR/grads: the gradients of iteration 1 as the optimizer steps with them, a
dist checkpoint of the model's trained tensors (whole, whatever the layout: read with
convert.dist_read). Losses and gradient norms are the trainer's own metrics.jsonl (--save-dir). A
LoRA run also saves a snapshot at iteration 0: the adapters it starts from, which are not PEFT's
initial ones.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

from megatron_ext import lifetime
from megatron_ext.config.options import TrainConfig
from megatron_ext.lora.layers import has_lora
from megatron_ext.train.trainer import Trainer, run

lifetime.die_with_parent()

# What the transformers loop needs of a micro batch (the rest is the trainer's bookkeeping).
RECORDED = ("images", "media_layout", "image_index", "input_ids", "labels", "loss_mask", "segment_ids", "keys",
            "pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
GRADS_DIR = "grads"  # under RECORD_DIR


def batch_file(record_dir: Path, iteration: int, replica: int) -> Path:
    return Path(record_dir) / f"step_{iteration}_dp_{replica}.pt"


def reduced_grads(ddp) -> dict[int, torch.Tensor]:
    """id(parameter) -> this rank's part (TP/PP shard) of its gradient as the optimizer will step with
    it: summed over the data-parallel replicas and divided by the global batch's tokens (the schedule's
    finalize_model_grads has run). The distributed optimizer reduce-scatters each bucket, so a replica
    holds reduced values in its own shard alone: every other shard is zeroed and the replicas' copies
    summed, which puts the reduced shards together."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    out = {}
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        grad = buffer.grad_data.clone()
        if ddp.ddp_config.use_distributed_optimizer:
            group = buffer.data_parallel_group
            mine = torch.distributed.get_rank(group)
            for bucket in buffer.buckets:
                shards = shard_buffer(grad[bucket.offset:bucket.offset + bucket.grad_data.numel()],
                                      torch.distributed.get_world_size(group))
                for replica, shard in enumerate(shards):
                    if replica != mine:
                        shard.zero_()
            torch.distributed.all_reduce(grad, group=group)
        for param, (start, end, _) in buffer.param_index_map.items():
            out[id(param)] = grad[start:end].view(param.shape)
    return out


def save_grads(trained, out_dir: Path) -> None:
    """The reduced gradients of the trained parameters, saved as the model's checkpoint would save those
    parameters (collective): the model's sharded state dict with each trained tensor's gradient in
    its place, so TP shards, pipeline stages and fused layers come back whole by the checkpoint's
    own keys."""
    from megatron_ext.checkpoint.model_io import MODEL_KEY, save_sharded

    grads = reduced_grads(trained.ddp)
    entries = {name: dataclasses.replace(entry, data=grads[id(entry.data)])
               for name, entry in trained.model.sharded_state_dict().items() if id(getattr(entry, "data", None)) in grads}
    save_sharded({MODEL_KEY: entries}, out_dir)


class RecordingTrainer(Trainer):
    record_dir: Path

    def train(self) -> None:
        if self.iteration == 0 and has_lora(self.trained.model):
            self.save()  # our initial adapters, for the PEFT model to start from
        super().train()

    def before_optimizer_step(self) -> None:
        if self.iteration == 1:
            save_grads(self.trained, self.record_dir / GRADS_DIR)

    def after_iteration(self, micro_batches: list[dict]) -> None:
        from megatron.core import parallel_state

        if self.counts_batch:
            path = batch_file(self.record_dir, self.iteration, parallel_state.get_data_parallel_rank())
            torch.save([{k: b[k] for k in RECORDED if k in b} for b in micro_batches], path)


def main(argv: list[str]) -> int:
    record_dir, config_json = Path(argv[0]), Path(argv[1])
    record_dir.mkdir(parents=True, exist_ok=True)
    RecordingTrainer.record_dir = record_dir
    return run(TrainConfig(**json.loads(config_json.read_text())), RecordingTrainer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
