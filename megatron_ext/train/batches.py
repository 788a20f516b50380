"""The trainer's view of the data: micro batches from energon loaders, and where they stand.

Wraps megatron_ext.data (task encoder + energon loaders) for one rank: every rank of a
data-parallel replica reads the same batches, so TP/PP peers see the same samples.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

from megatron_ext.config.objective_specs import objective_of
from megatron_ext.config.options import TrainConfig
from megatron_ext.config.run_plan import RunPlan
from megatron_ext.data.loader import (
    restore_loader_state,
    save_loader_state,
    shutdown_workers,
    train_loader,
    val_loader,
)
from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder
from megatron_ext.data.native_resolution_pairs import NativeResolutionPairTaskEncoder
from megatron_ext.data.pairs import PairTaskEncoder
from megatron_ext.data.task_encoder import LlavaTaskEncoder
from megatron_ext.model.arch import LlavaArch
from megatron_ext.model.sequence_alignment import SequenceAlignment


def samples_digest(keys: list[str]) -> str:
    """A short fingerprint of which samples, in which order, a global batch holds."""
    return hashlib.sha1("\n".join(keys).encode()).hexdigest()[:12]


def task_encoder(tokenizer_dir: str | Path, arch: LlavaArch, cfg: TrainConfig, seq_length: int,
                 alignment: SequenceAlignment) -> LlavaTaskEncoder:
    """The encoder the trainer feeds a model of `arch` with under the options `cfg` (the sample
    inspector builds its own with it): preference pairs for --stage dpo, conversations otherwise."""
    common = dict(seq_length=seq_length, pad_token_id=arch.pad_token_id, chat_template=cfg.chat_template, lang=cfg.lang,
                  packing_seq_length=cfg.packing_seq_length, alignment=alignment, video_frames=cfg.video_frames)
    pairs = objective_of(cfg).pairs
    if not isinstance(arch, LlavaArch):  # a native-resolution model's images keep their sizes
        native_class = NativeResolutionPairTaskEncoder if pairs else NativeResolutionTaskEncoder
        return native_class.for_model(str(tokenizer_dir), arch, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels,
                                      **common)
    encoder_class = PairTaskEncoder if pairs else LlavaTaskEncoder
    return encoder_class.for_model(str(tokenizer_dir), arch, image_aspect=cfg.image_aspect,
                                   max_tiles=cfg.max_tiles_per_sequence, **common)


def _encoder(plan: RunPlan) -> LlavaTaskEncoder:
    return task_encoder(plan.tokenizer_dir, plan.arch, plan.config, plan.seq_length, plan.execution.alignment)


class TrainData:
    """Training micro batches whose position is saved with every checkpoint: endless, or for a run
    measured in samples (`RunPlan.epoch_samples`) --epochs whole passes over a dataset directory or a
    metadataset without weights (a `blend_epochized` pass repeats each member as it says).
    energon's endless loader mixes the next pass into its shuffle and packing buffers, so an epoch
    would not be every sample once; a weighted blend has no passes of its own and stays endless."""

    def __init__(self, plan: RunPlan):
        cfg = plan.config
        by_pass = plan.epoch_samples is not None and not plan.train_split.by_weight
        self.epochs = math.ceil(cfg.epochs) if by_pass else None
        self.passes = 0  # passes read to their end (the trainer keeps it with its counters)
        self.loader = train_loader(cfg.data_path, _encoder(plan), micro_batch_size=cfg.micro_batch_size,
                                   num_workers=cfg.num_workers, seed=cfg.seed, repeat=not by_pass)
        self._batches = None

    def next_micro_batches(self, count: int) -> list[dict]:
        """`count` micro batches; fewer (none) once the last of --epochs passes is used up."""
        batches = []
        while len(batches) < count and (self.epochs is None or self.passes < self.epochs):
            if self._batches is None:
                self._batches = iter(self.loader)
            try:
                batches.append(next(self._batches).as_dict())
            except StopIteration:
                self._batches = None
                self.passes += 1
        return batches

    def save(self, path: Path) -> None:
        save_loader_state(self.loader, path)

    def restore(self, path: Path) -> None:
        """Continue where `save` left off; must come before the first batch."""
        restore_loader_state(self.loader, path)

    def close(self) -> None:
        self._batches = None
        shutdown_workers(self.loader)


def split_pass(plan: RunPlan, split: str):
    """Every micro batch of one in-order pass over `split` (this data-parallel rank's share)."""
    cfg = plan.config
    loader = val_loader(cfg.data_path, _encoder(plan), micro_batch_size=cfg.micro_batch_size, split=split)
    return (batch.as_dict() for batch in loader)


class ValData:
    """At most `eval_iters` global batches of the val split, the same ones at every evaluation."""

    def __init__(self, plan: RunPlan):
        cfg = plan.config
        self.num_microbatches = plan.num_microbatches
        self.loader = val_loader(cfg.data_path, _encoder(plan), micro_batch_size=cfg.micro_batch_size,
                                 limit=cfg.eval_iters * plan.num_microbatches)

    def global_batches(self) -> list[list[dict]]:
        """One full pass (energon restarts the split on every pass), as groups of micro batches; the
        last group may be short, and a data-parallel rank with fewer groups than another gets empty
        ones, so every rank takes part in as many evaluation steps (a val split smaller than a
        global batch is still evaluated)."""
        batches = [batch.as_dict() for batch in self.loader]
        n = self.num_microbatches
        groups = [batches[i:i + n] for i in range(0, len(batches), n)]
        return groups + [[] for _ in range(_most_over_data_parallel(len(groups)) - len(groups))]


def _most_over_data_parallel(count: int) -> int:
    import torch
    from megatron.core import parallel_state

    from megatron_ext.distributed import device

    most = torch.tensor([count], device=device())
    torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    return int(most.item())
