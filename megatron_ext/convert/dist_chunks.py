"""Megatron dist checkpoints (torch_dist format) written and read a chunk at a time, for the converters.

megatron-core's own torch_dist save stages all of a rank's tensors in memory before its writer
processes serialize them, and clones those that are views (the gate/up halves of a gated MLP);
its load reads all requested tensors at once, and concatenates the gate/up halves again. Either
way a converter would hold its part of the model at least once. Here:

- `ComputedSaveStrategy` writes the same files (megatron-core's translation of the sharded state
  dict to torch.distributed.checkpoint, then torch's own file writer, one file per rank), but the
  state dict it is given only describes the layout: as the writer reaches each chunk it asks
  `compute(key, offsets, sizes)` for the values, writes them and drops them.
- `read_tensors` reads whole Megatron tensors (the TP1 layout) from a checkpoint of any TP/PP
  layout into fresh memory, a few at a time.

Chunks are named by checkpoint key and offsets (mapping.tensor_of_chunk / chunk_of_tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_ext.convert.mapping import chunk_of_tensor
from megatron_ext.errors import UserError
from megatron_ext.progress import progress

ChunkFn = Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]


class _ComputedPlanner(MCoreSavePlanner):
    """Plans from the layout; resolves each tensor write by computing it."""

    def __init__(self, compute: ChunkFn):
        super().__init__(flatten_state_dict=False, can_run_decentralized_global_plan=False)
        self._compute = compute
        self.bar = progress(desc="writing tensors", unit="B", unit_scale=True)

    def finish_plan(self, central_plan):
        plan = super().finish_plan(central_plan)
        self.bar.reset(total=sum(_nbytes(item) for item in plan.items if item.type != WriteItemType.BYTE_IO))
        return plan

    def resolve_data(self, write_item):
        if write_item.type == WriteItemType.BYTE_IO:  # a ShardedObject (e.g. _extra_state), already serialized
            return super().resolve_data(write_item)
        chunk, properties = write_item.tensor_data.chunk, write_item.tensor_data.properties
        # Megatron keeps some tensors (norms, the patch embedding) in float32 whatever the source dtype.
        data = self._compute(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes)).to(properties.dtype)
        if tuple(data.shape) != tuple(chunk.sizes):
            raise RuntimeError(f"{write_item.index.fqn} at {list(chunk.offsets)}: computed {list(data.shape)}, "
                               f"the checkpoint needs {list(chunk.sizes)}")
        self.bar.update(data.nbytes)
        return data


def _nbytes(item) -> int:
    return item.tensor_data.properties.dtype.itemsize * torch.Size(item.tensor_data.chunk.sizes).numel()


class ComputedSaveStrategy(TorchDistSaveShardedStrategy):
    """A torch_dist save strategy (the same files, read back by megatron-core's loader) whose
    tensors come from `compute`; pass it to `dist_checkpointing.save` as `sharded_strategy`."""

    def __init__(self, compute: ChunkFn):
        super().__init__("torch_dist", 1)
        self._compute = compute

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        planner = _ComputedPlanner(self._compute)
        dcp_save(mcore_to_pyt_state_dict(by_key, False), planner=planner,
                 storage_writer=FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1))
        planner.bar.close()


class _ChunkLoadPlanner(DefaultLoadPlanner):
    """Reads, for each key, the chunk at `offsets[key]` the size of the tensor given for it, into it."""

    def __init__(self, offsets: dict[str, tuple[int, ...]], snapshot_dir: Path):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._offsets = offsets
        self._dir = snapshot_dir

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, dest in self.state_dict.items():
            stored, offsets = self.metadata.state_dict_metadata.get(key), self._offsets[key]
            if not hasattr(stored, "chunks") or len(stored.size) != dest.dim() or any(
                    o + n > m for o, n, m in zip(offsets, dest.shape, stored.size)):
                shape = list(stored.size) if hasattr(stored, "size") else "nothing"
                raise UserError(f"--megatron-dir {self._dir}: the model its metadata describes needs {key} with at "
                                f"least {[o + n for o, n in zip(offsets, dest.shape)]}, the checkpoint holds {shape}")
            reads = create_read_items_for_chunk_list(key, stored, [ChunkStorageMetadata(torch.Size(offsets), dest.shape)])
            if sum(torch.Size(read.lengths).numel() for read in reads) != dest.numel():
                raise UserError(f"--megatron-dir {self._dir}: the checkpoint lacks parts of {key} (its files are incomplete)")
            items += reads
        return LoadPlan(items)

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]  # the chunk itself, whatever its offsets in the global tensor


def read_tensors(snapshot_dir: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """{canonical name: (TP1 shape, dtype)} -> those whole Megatron tensors, read from the snapshot
    (in this process alone: no collective) into fresh memory."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load

    requests, offsets, out = {}, {}, {}
    for name, (shape, dtype) in tensors.items():
        key, offsets[key], sizes = chunk_of_tensor(name, shape)
        requests[key] = torch.empty(sizes, dtype=dtype)
        out[name] = requests[key].view(shape)
    with warnings.catch_warnings():  # that it reads in this process alone: that is the intent
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp_load(requests, storage_reader=FileSystemReader(str(snapshot_dir)),
                 planner=_ChunkLoadPlanner(offsets, Path(snapshot_dir)), no_dist=True)
    return out
