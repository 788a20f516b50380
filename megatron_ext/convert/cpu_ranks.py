"""Run one function on N CPU processes that form a gloo world (the converters' and comparer's workers).

Conversion is I/O-bound and exactness is easiest to reason about on CPU, so the workers never see a
GPU (`CUDA_VISIBLE_DEVICES=""`, which makes `init_parallel` apply `cpu_support`). Processes are
forked from a `forkserver` that has imported torch and megatron-core once (worker_preload.py),
which every worker would otherwise pay again, N at a time on a few cores; the server is a clean
single-threaded process, so forking it is safe. Each worker then takes the caller's environment
as it is at the call, as a spawned one would. The entry script must still guard its `main()` with
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from megatron_ext.environ import environ_set
from megatron_ext.errors import UserError

# megatron-core warns at import that Transformer Engine / Apex are missing (a dozen lines); the fork
# server imports it before any logging setup (megatron_ext.logs says it once, where it matters).
_QUIET_FALLBACKS = "ignore:Transformer Engine and Apex are not installed,ignore:Apex is not installed"


@contextlib.contextmanager
def cpu_only_env(**extra: str):
    """Hide GPUs (and default to one thread per process) for processes started inside the block;
    `extra` environment variables are set for them too."""
    with environ_set({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}):
        yield


def start_fork_server(entry_module: str) -> None:
    """Start the fork server now, if it is not running, preloading what workers running a function of
    `entry_module` import: its imports take seconds, and overlap with whatever the caller does next."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(["megatron_ext.convert.worker_preload", entry_module])
    with cpu_only_env(PYTHONWARNINGS=_QUIET_FALLBACKS):
        forkserver.ensure_running()


def _rank_main(rank: int, world_size: int, port: int, workdir: str, env: dict, fn: Callable, args: tuple) -> None:
    import torch

    # The fork server's environment is the one of the call that started it; this call's is `env`.
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    # The parent hosts the rendezvous store (as torchrun's agent does): every rank connects to it.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    from megatron_ext.logs import setup_logging

    setup_logging(rank=rank)
    try:
        result = fn(*args)
    except UserError as exc:
        Path(workdir, f"error-{rank}.txt").write_text(str(exc))
        raise
    if rank == 0:
        torch.save(result, Path(workdir, "result.pt"))


def run_on_cpu_ranks(fn: Callable, world_size: int, *args) -> Any:
    """Call `fn(*args)` on ranks 0..world_size-1 (env:// set for `init_parallel`); returns rank 0's result.

    A UserError raised on any rank is raised here with its message; any other failure stops all
    ranks and propagates (with the failing rank's traceback).
    """
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from megatron_ext.distributed import local_store

    start_fork_server(fn.__module__)
    store = local_store()
    with tempfile.TemporaryDirectory(prefix="megatron_ext-ranks-") as workdir, cpu_only_env():
        try:
            mp.start_processes(_rank_main, args=(world_size, store.port, workdir, dict(os.environ), fn, args),
                               nprocs=world_size, join=True, start_method="forkserver")
        except ProcessException:
            errors = sorted(Path(workdir).glob("error-*.txt"))
            if errors:
                raise UserError(errors[0].read_text()) from None
            raise
        return torch.load(Path(workdir, "result.pt"), weights_only=False)
