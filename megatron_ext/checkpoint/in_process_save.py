"""megatron-core's torch_dist save written by the saving process itself.

megatron-core's default torch_dist strategy writes through its asynchronous-capable writer even
when the save is synchronous: every save forks writer processes, and a process's first save
spawns a multiprocessing manager for their results (a fresh interpreter that imports the main
module again: seconds per rank where that module imports torch, as parity_run does).
`InProcessSaveStrategy` makes the same files (megatron-core's translation of the sharded state
dict and its planner, torch's own file writer with as many writer threads, every file synced),
which megatron-core's loader reads as it reads its own.
"""

from __future__ import annotations

from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner,
    TorchDistSaveShardedStrategy,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)


class InProcessSaveStrategy(TorchDistSaveShardedStrategy):
    """The torch_dist format, saved synchronously in this process (threads, no child processes)."""

    def __init__(self):
        super().__init__("torch_dist", 1)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        from torch.distributed.checkpoint import FileSystemWriter
        from torch.distributed.checkpoint import save as dcp_save

        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
        planner = MCoreSavePlanner(dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False)
        writer = FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=self.thread_count,
                                  sync_files=True)
        dcp_save(mcore_to_pyt_state_dict(by_key, False), planner=planner, storage_writer=writer)
