"""Run one function on N CPU processes that form a gloo world (the converters' and comparer's workers).

Conversion is I/O-bound and exactness is easiest to reason about on CPU, so the workers never see a
GPU (`CUDA_VISIBLE_DEVICES=""`, which makes `init_parallel` apply `cpu_support`). Processes are
forked from a `forkserver` that has imported torch and megatron-core once (worker_preload.py),
which every worker would otherwise pay again, N at a time on a few cores; the server is a clean
single-threaded process, so forking it is safe. A command that is itself a fork of such a process
(`megatron_ext/preloaded.py`: the demo's steps, the tests' jobs) and still runs one thread forks the workers
directly instead, sparing the server's own fresh interpreter (about 6 s of CPU). Each worker then
takes the caller's environment as it is at the call, as a spawned one would. The entry script must
still guard its `main()` with `if __name__ == "__main__":`.

A rank that fails records why (megatron_ext/rank_failures.py, as the trainer's ranks do for run.py),
and the caller gets the first rank's own failure, never a peer's lost connection to it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from megatron_ext import rank_failures
from megatron_ext.environ import environ_set
from megatron_ext.errors import UserError, report
from megatron_ext.logs import setup_logging


@contextlib.contextmanager
def cpu_only_env(**extra: str):
    """Hide GPUs (and default to one thread per process) for processes started inside the block;
    `extra` environment variables are set for them too."""
    with environ_set({"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra}):
        yield


def forks_directly() -> bool:
    """Whether this process forks the workers itself: it was forked from a preloaded process
    (`preloaded.preload`), so it holds what they import and no CUDA, and it runs no other thread
    (a fork takes only the calling one)."""
    import threading

    from megatron_ext import preloaded

    return preloaded.loaded and threading.active_count() == 1


def start_fork_server(entry_module: str) -> None:
    """Start the fork server now, if it is not running and this process does not fork the workers itself,
    preloading what workers running a function of `entry_module` import: its imports take seconds, and
    overlap with whatever the caller does next."""
    import multiprocessing
    from multiprocessing import forkserver

    if forks_directly():
        return
    multiprocessing.set_forkserver_preload(["megatron_ext.convert.worker_preload", entry_module])
    with cpu_only_env():
        forkserver.ensure_running()


def _rank_main(rank: int, world_size: int, port: int, workdir: str, env: dict, fn: Callable, args: tuple) -> None:
    import torch

    # The fork server's environment is the one of the call that started it; this call's is `env`.
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", torch.get_num_threads())))
    # The parent hosts the rendezvous store (as torchrun's agent does): every rank connects to it.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      **{rank_failures.FAILURES_ENV: workdir})
    setup_logging(rank=rank)
    with rank_failures.recorded():
        try:
            result = fn(*args)
        except UserError as exc:
            report(str(exc))
            sys.exit(2)
    if rank == 0:
        torch.save(result, Path(workdir, "result.pt"))


def run_on_cpu_ranks(fn: Callable, world_size: int, *args) -> Any:
    """Call `fn(*args)` on ranks 0..world_size-1 (env:// set for `init_parallel`); returns rank 0's result.

    The first rank's failure is raised here: a UserError with its message, an unexpected exception as
    `rank_failures.RankFailed` with that rank's traceback. A rank that died without a word (killed:
    out of memory?) is torch's ProcessExitedException, naming it.
    """
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from megatron_ext.distributed import local_store

    start_method = "fork" if forks_directly() else "forkserver"
    start_fork_server(fn.__module__)
    store = local_store()
    with tempfile.TemporaryDirectory(prefix="megatron_ext-ranks-") as workdir, cpu_only_env():
        try:
            mp.start_processes(_rank_main, args=(world_size, store.port, workdir, dict(os.environ), fn, args),
                               nprocs=world_size, join=True, start_method=start_method)
        except ProcessException as exc:
            first = rank_failures.first_failure(Path(workdir))
            if first is None or (first.peer_loss and getattr(exc, "signal_name", None)):
                raise
            if first.traceback is None:
                raise UserError(first.message) from None
            raise rank_failures.RankFailed(first) from None
        return torch.load(Path(workdir, "result.pt"), weights_only=False)
