"""A command of several ranks typed as one process (`benchmark.py --megatron-dir D --tp 2`): it starts
its ranks itself, with torchrun on this machine, the way run.py starts a training run (`runner.run`).

Under a torchrun of the user's own, a failed rank ends with torchrun's ChildFailedError traceback
after the rank's own line, and nothing a rank does can change what its parent prints; started here,
a failure is one line of ours (`rank_failures`) and torchrun's report goes only to the kept log.
"""

from __future__ import annotations

import os
import signal
import sys

from megatron_ext import rank_failures, stop_signals


def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ


def start(nproc: int, module: str, args: list[str]) -> int:
    """`python -m module args` on `nproc` ranks of this machine; the exit status (one line on a failure)."""
    from megatron_ext.launch import run_dirs, runner

    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", module, *args]
    return runner.run(argv, {}, key=run_dirs.run_key([module, *args])).status


def rank_started() -> None:
    """In a rank `start` started: say so to the starter (its stderr is held until then), and take
    stopping signals as a plain process does (the starter passes Ctrl-C on to each rank; torchrun's
    children inherit them ignored)."""
    rank_failures.mark_started()
    if os.environ.get(rank_failures.FAILURES_ENV):
        for sig in stop_signals.STOP_SIGNALS:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
