"""Snapshots are written by the saving process itself (checkpoint/in_process_save.py): megatron-core's
own writer starts a process per save and spawns a manager on a process's first save."""

from __future__ import annotations

import multiprocessing.process
import os

import pytest


class _Weights:
    """What save_model_weights and load_model_weights ask of a model: its sharded state dict, loading one."""

    def __init__(self, weight):
        self.weight = weight

    def sharded_state_dict(self):
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

        return {"weight": ShardedTensor.from_rank_offsets("weight", self.weight),
                "layer._extra_state": ShardedObject("layer._extra_state", {"step": 3}, (1,), (0,))}

    def load_state_dict(self, state, strict):
        from types import SimpleNamespace

        self.weight, self.extra = state["weight"], state["layer._extra_state"]
        return SimpleNamespace(missing_keys=[], unexpected_keys=[])


@pytest.mark.multiprocess
def test_a_snapshot_is_saved_without_starting_a_process_and_loads_back(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    from megatron_ext.checkpoint.model_io import load_model_weights, save_model_weights

    def refuse(*args, **kwargs):
        raise AssertionError("the save started a process")

    saved, loaded = _Weights(torch.arange(12.0).reshape(3, 4)), _Weights(torch.zeros(3, 4))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
            patch.setattr(os, "fork", refuse)
            save_model_weights(saved, tmp_path / "snapshot")
        load_model_weights(loaded, tmp_path / "snapshot")
    finally:
        dist.destroy_process_group()
    assert torch.equal(loaded.weight, saved.weight) and loaded.extra == {"step": 3}
