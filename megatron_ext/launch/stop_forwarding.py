"""run.py's part in stopping a run (megatron_ext/stop_signals.py): the first stopping signal it
receives goes to each training rank of this node, once, straight from run.py.

Not through torchrun: its agent answers a signal with a `SignalException` traceback and kills the
ranks some seconds later, whether or not they have finished saving. torchrun and everything it
starts inherit the stopping signals ignored, so a signal to the whole job (SLURM signals every
process of a step) reaches only the ranks' handlers. Once the ranks have saved and exited, torchrun
ends with their status. Before any rank has started there is nothing to save: run.py then ends the
launch itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from megatron_ext import rank_failures, stop_signals


class StopForwarding:
    """Installed while `proc` (torchrun, in a process group of its own) runs; `restore` when it ended."""

    def __init__(self, proc: subprocess.Popen, failures_dir: Path):
        self.proc, self.failures_dir = proc, failures_dir
        self.signum: int | None = None
        self.launch_ended = False  # no rank had started: run.py ended torchrun itself
        self.signalled: set[int] = set()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in stop_signals.STOP_SIGNALS}

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if not rank_failures.started_ranks(self.failures_dir):
            self.launch_ended = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the ranks starting under it die with it (lifetime)
            return
        self.pass_on()

    def pass_on(self) -> None:
        """The signal to each rank that has started and not yet received it (call again and again:
        ranks of a starting run register one by one)."""
        if self.signum is None or self.launch_ended:
            return
        for pid in rank_failures.started_ranks(self.failures_dir) - self.signalled:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, self.signum)
            self.signalled.add(pid)

    def status(self, returncode: int) -> int:
        """run.py's exit status: torchrun's (the ranks' own, 0 after a stop they saved for), or 128 + N
        when signal N came before any rank started."""
        if self.launch_ended:
            return 128 + self.signum
        return 128 - returncode if returncode < 0 else returncode

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
