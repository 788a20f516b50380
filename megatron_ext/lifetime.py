"""A run's processes die together: when run.py dies, however it dies (an OOM kill, kill -9), torchrun
and every rank stop too, instead of training on unseen and writing into a save directory that a
re-run of the same command then shares.

torchrun starts each rank in a session of its own, so no process-group signal reaches the ranks,
and SIGKILL cannot be forwarded at all. Two guards:
- `die_with_parent()`: the kernel sends this process SIGKILL when its parent exits (Linux
  PR_SET_PDEATHSIG): torchrun started by run.py, each rank started by torchrun, and every process a
  rank forks later (megatron-core's checkpoint writers).
- `watch_launcher()`: each rank also watches run.py itself (LAUNCHER_ENV, set by run.py) and ends
  when it is gone. That covers what a parent-death signal cannot: inside Singularity the image's
  starter process sits between run.py and torchrun.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

LAUNCHER_ENV = "MEGATRON_EXT_LAUNCHER"  # "pid:start time" of the run.py that started this run
_PR_SET_PDEATHSIG = 1


def _arm_parent_death_signal() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent was already gone before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent() -> None:
    """SIGKILL this process when its parent exits, and each process it forks when that one's parent
    exits (Linux; elsewhere nothing).

    Forks need their own: the kernel clears the signal in a forked child. megatron-core forks its
    checkpoint writers; one whose rank was killed mid-save lives on, and blocks for good once its
    results fill the pipe to the rank nobody reads any more."""
    if not sys.platform.startswith("linux"):
        return
    _arm_parent_death_signal()
    os.register_at_fork(after_in_child=_arm_parent_death_signal)


def launcher_marker() -> dict[str, str]:
    """The environment run.py gives the processes it starts, naming itself."""
    import psutil

    return {LAUNCHER_ENV: f"{os.getpid()}:{psutil.Process().create_time()}"}


def running(pid: int, start: float) -> bool:
    import psutil

    try:
        return abs(psutil.Process(pid).create_time() - start) < 1.0
    except psutil.NoSuchProcess:
        return False


def watch_launcher(interval_s: float = 1.0) -> None:
    """End this process (SIGKILL) once the run.py named in LAUNCHER_ENV is gone."""
    value = os.environ.get(LAUNCHER_ENV)
    if not value:
        return
    pid, start = int(value.split(":")[0]), float(value.split(":")[1])
    if not running(pid, start):
        # Not visible from here (a separate PID namespace): nothing to watch.
        log.debug("launcher pid %d not visible: not watching it", pid)
        return

    def watch():
        while running(pid, start):
            threading.Event().wait(interval_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
