"""Write a Megatron dist checkpoint (torch_dist format) whose tensors are computed a chunk at a time.

megatron-core's own torch_dist save stages all of a rank's tensors in memory before its writer
processes serialize them, and clones those that are views (the gate/up halves of a gated MLP), so
a converter using it would hold its part of the model once or twice. `ComputedSaveStrategy`
writes the same files (megatron-core's translation of the sharded state dict to
torch.distributed.checkpoint, then torch's own file writer, one file per rank), but the state
dict it is given only describes the layout: as the writer reaches each chunk it asks
`compute(key, offsets, sizes)` for the values (a chunk of the checkpoint's global tensor `key`,
see checkpoint.keys.tensor_of_chunk), writes them and drops them.
"""

from __future__ import annotations

from typing import Callable

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint.planner import WriteItemType

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
        # No fsync (megatron-core's writer syncs every file): a converted checkpoint can be made
        # again from its input, and the HF side (safetensors, save_pretrained) does not sync either.
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1, sync_files=False)
        dcp_save(mcore_to_pyt_state_dict(by_key, False), planner=planner, storage_writer=writer)
        planner.bar.close()
