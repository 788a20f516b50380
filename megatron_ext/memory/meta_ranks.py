"""Any rank's model of any layout, built in this process on PyTorch's meta device.

A fake process group (torch's `fake` backend: collectives return at once, nothing is sent) stands
in for a world of `tp * pp * dp` processes, so megatron-core's parallel state, and with it the
model megatron-core builds for one rank, are exactly those of that rank in a real run, while
every tensor is a shape without memory. What a layout holds per rank (the converters' shape
checks at published sizes, a memory plan) is then read from the real module tree in seconds,
with no second process and no weights.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def as_rank(rank: int, tp: int, pp: int, dp: int = 1) -> Iterator[None]:
    """megatron-core's parallel state of `rank` in a `tp` x `pp` x `dp` world, for the block.
    Refuses to run where torch.distributed is already initialised (a real world is in use)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_ext.compat import cpu_support
    from megatron_ext.compat.lean_import import import_lean

    if dist.is_initialized():
        raise RuntimeError("as_rank needs a process without a torch.distributed world")
    import_lean()
    from megatron.core import parallel_state

    cpu_support.apply()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp * pp * dp)
    try:
        # The fake backend makes no gloo groups; megatron-core wants them only for CPU-side transfers.
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 create_gloo_process_groups=False)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def rank_models(arch, layout: tuple[int, int], opts=None) -> Iterator[tuple[int, object]]:
    """(rank, that rank's model on meta) for every model-parallel rank of `layout` = (tp, pp): a
    LLaVA's or a vision-language family's (`families.build_model`)."""
    from megatron_ext import families
    from megatron_ext.model.provider import ModelOptions

    tp, pp = layout
    opts = opts or ModelOptions(init_weights=False)
    for rank in range(tp * pp):
        with as_rank(rank, tp, pp):
            yield rank, families.build_model(arch, opts, meta=True)
