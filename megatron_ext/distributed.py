"""Process-group setup shared by the trainer, the converters and evaluation.

One call, `init_parallel(tp, pp)`, gives a process megatron-core's parallel state on either
NCCL + CUDA or gloo + CPU (with megatron-core imported lean, see lean_import, and `cpu_support`
applied), and seeds every generator the same way
Megatron-LM does, so TP/PP/DP layouts start from identical weights.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch

from megatron_ext import shared_failure
from megatron_ext.compat import cpu_support
from megatron_ext.compat.lean_import import import_lean
from megatron_ext.errors import UserError


def local_store():
    """A TCPStore server on a port the OS picks, for processes of this machine to meet at (a port
    found free and then released could be taken by someone else before it is bound again)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def device() -> torch.device:
    """Where this process computes: its GPU, else the CPU (`cpu_support.NAMED_DEVICE`)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return cpu_support.NAMED_DEVICE


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, backend: str | None = None, timeout_min: int = 30,
                  cp: int = 1) -> None:
    """Initialise torch.distributed (env:// as set by torchrun, or a world of one) and megatron's
    parallel state with `tp` x `pp` x `cp` model parallelism; data parallel takes the remaining ranks."""
    import torch.distributed as dist

    if not torch.cuda.is_available():
        import_lean()
    from megatron.core import parallel_state, tensor_parallel

    on_cpu = cpu_support.apply()
    if not dist.is_initialized():
        if not on_cpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        options = dict(backend=backend or ("gloo" if on_cpu else "nccl"), timeout=datetime.timedelta(minutes=timeout_min))
        if "MASTER_ADDR" in os.environ:  # started by torchrun (or SLURM + env), env:// rendezvous
            dist.init_process_group(**options)
        else:  # a lone process: a world of one, leaving the environment as it was for child processes
            dist.init_process_group(**options, store=local_store(), rank=0, world_size=1)
        shared_failure.keep(dist.distributed_c10d._get_default_store())
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise UserError(f"--tp {tp} x --pp {pp} x --cp {cp} = {tp * pp * cp} does not divide the number of "
                        f"processes ({world})")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                                 context_parallel_size=cp)
    # On a CPU torch megatron never seeds the CPU generator; Megatron-LM's trainer seeds both.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def split_over_data_parallel(items: list, answer) -> list:
    """`answer(some_items)` for all `items`, the work split over the data-parallel replicas (replica
    r takes items r, r + DP, ...; the model-parallel ranks of a replica answer together), the
    results gathered back in the items' order on every rank. Collective; a lone process answers all."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return answer(items)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    gathered = [None] * dp_size
    dist.all_gather_object(gathered, answer(items[dp_rank::dp_size]), group=parallel_state.get_data_parallel_group())
    return [gathered[i % dp_size][i // dp_size] for i in range(len(items))]


def shutdown() -> None:
    import torch.distributed as dist

    # Only a process that set megatron-core's parallel state up has it to undo: a command that stopped at
    # a bad flag returns at once, instead of importing megatron-core (seconds) to find nothing to undo.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
