"""energon data loaders for the trainer, and saving / restoring where the training loader stands.

`--data-path` is a prepared dataset directory or an energon metadataset YAML (a blend); energon
reads both. Every rank of one data-parallel replica (its TP/PP peers) gets the same batches:
the worker config uses megatron's data-parallel rank, size and group.
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset, get_val_dataset
from megatron.energon.savable_loader import SavableDatasetCheckpoint

from megatron_ext import stop_signals
from megatron_ext.data.prepared import require_split
from megatron_ext.data.task_encoder import LlavaTaskEncoder, count_bad_sample
from megatron_ext.errors import UserError

# Samples energon holds back to shuffle (per worker), and to choose packs from.
SHUFFLE_BUFFER = 100
PACKING_BUFFER = 256
# Samples read from one shard before switching to another (energon's sequence interleaving).
MAX_SAMPLES_PER_SEQUENCE = 100


def worker_config(num_workers: int, seed: int = 0) -> WorkerConfig:
    """Rank and size of this process's data-parallel group (0 / 1 without torch.distributed)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        rank = parallel_state.get_data_parallel_rank()
        size = parallel_state.get_data_parallel_world_size()
        group = parallel_state.get_data_parallel_group()
    else:
        rank, size, group = 0, 1, None
    return WorkerConfig(rank=rank, world_size=size, num_workers=num_workers, data_parallel_group=group,
                        seed_offset=seed, global_error_handler=count_bad_sample)


def train_loader(path: str | Path, encoder: LlavaTaskEncoder, *, micro_batch_size: int, num_workers: int = 2,
                 seed: int = 1234, packing_buffer_size: int = PACKING_BUFFER, repeat: bool = True):
    """A shuffled, savable loader of `LlavaBatch`es from the train split: endless, or with `repeat`
    False one pass over it (each sample once; iterate it again for the next)."""
    require_split(path, "train")
    dataset = get_train_dataset(
        str(path),
        worker_config=worker_config(num_workers, seed),
        batch_size=micro_batch_size,
        shuffle_buffer_size=SHUFFLE_BUFFER,
        max_samples_per_sequence=MAX_SAMPLES_PER_SEQUENCE,
        packing_buffer_size=packing_buffer_size if encoder.packing else None,
        task_encoder=encoder,
        repeat=repeat,
    )
    return _quiet_workers(get_savable_loader(dataset))


def _quiet_workers(loader):
    """The loader's worker processes ignore stopping signals (SLURM signals every process of a job
    step; torch's workers die of SIGTERM): their rank stops at an iteration boundary and shuts them
    down (`shutdown_workers`). Read by torch when it starts the workers, after energon's init."""
    energon_init = loader.worker_init_fn

    def init(worker_id: int) -> None:
        stop_signals.ignore()
        energon_init(worker_id)

    loader.worker_init_fn = init
    return loader


def shutdown_workers(loader) -> None:
    """End `loader`'s worker processes now (energon keeps them for the loader's lifetime), instead of
    leaving them to notice at exit that their rank is gone."""
    iterator = getattr(loader, "_iterator", None)  # torch keeps persistent workers' iterator here
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


def val_loader(path: str | Path, encoder: LlavaTaskEncoder, *, micro_batch_size: int, num_workers: int = 0,
               limit: int | None = None, packing_buffer_size: int = PACKING_BUFFER, split: str = "val"):
    """One pass over the val split (or `split`; at most `limit` batches), in order; iterate it again for
    the next evaluation."""
    require_split(path, split)
    dataset = get_val_dataset(
        str(path),
        split_part=split,
        worker_config=worker_config(num_workers),
        batch_size=micro_batch_size,
        packing_buffer_size=packing_buffer_size if encoder.packing else None,
        limit=limit,
        task_encoder=encoder,
    )
    return get_savable_loader(dataset)


def save_loader_state(loader, path: str | Path) -> None:
    """Write this rank's position in `loader` (call between batches)."""
    torch.save(loader.save_state_rank(), path)


def restore_loader_state(loader, path: str | Path) -> None:
    """Continue `loader` where `save_loader_state` left it; call before iterating it."""
    # The state holds energon dataclasses, so it is not a weights-only file; it is our own.
    state = torch.load(path, weights_only=False)
    if state is not None:
        # Without worker processes energon saves one plain state instead of one per worker.
        saved = len(state.worker_states) if isinstance(state.worker_states[0], SavableDatasetCheckpoint) else 0
        if saved != loader.worker_config.num_workers:
            raise UserError(f"the data loader position in {path} was saved with {saved} data workers; "
                            f"resume with --num-workers {saved}")
    loader.restore_state_rank(state)
