"""Signals that ask a run to stop and keep its work: SIGTERM (scancel, a time limit, preemption),
SIGINT (Ctrl-C) and SIGUSR1 (`#SBATCH --signal=B:USR1@SECONDS`).

Each training rank remembers the first one it receives (`StopRequest`); the trainer acts on it at
the next iteration boundary, on every rank together, and saves before it exits. Every other process
of a run ignores them (`ignore`): the data loader's workers, which the trainer shuts down itself,
and torchrun, whose own handling would tear the ranks down a few seconds later, mid-save. SLURM
signals every process of a job step, so each of them does receive the signal.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
# torchrun's agent installs handlers for the signals these name (its default adds SIGTERM and SIGINT),
# replacing the dispositions it inherited; without them it keeps ignoring the stopping signals.
# PET_: the default of torchrun's --signals-to-handle; TORCHELASTIC_: what its agent reads.
_TORCHRUN_HANDLES = "SIGHUP,SIGQUIT"
TORCHRUN_SIGNALS = {"PET_SIGNALS_TO_HANDLE": _TORCHRUN_HANDLES, "TORCHELASTIC_SIGNALS_TO_HANDLE": _TORCHRUN_HANDLES}


def ignore(*_args) -> None:
    """Ignore the stopping signals in this process (and, through exec, in the programs it starts).
    Takes and drops any arguments, so it can serve as a worker-init function."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopRequest:
    """The first stopping signal this process received (`signum`; None until one came). Later ones
    change nothing: SLURM and run.py may both deliver the same request."""

    def __init__(self):
        self.signum: int | None = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum

    @property
    def received(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "none"


_request: StopRequest | None = None


def stop_request() -> StopRequest:
    """This process's request, its handlers installed on the first call."""
    global _request
    if _request is None:
        _request = StopRequest()
    return _request
