"""A run and its save directory: run.py killed alone (kill -9, an OOM kill) takes torchrun, every
rank and every process a rank started with it, a second run on a live run's --save-dir is refused, and once the first is gone the
next run takes over the directory and resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_ext import lifetime
from megatron_ext.checkpoint import layout
from tests.support.helpers import REPO_ROOT, run, started
from tests.support.training import metrics, run_py


def _started_by(launcher_pid: int) -> list[psutil.Process]:
    """Live processes whose environment names `launcher_pid` as their run.py (forks and their helpers
    included: they are reparented once a rank dies, so a tree walk from run.py misses them)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.status() != psutil.STATUS_ZOMBIE
                    and proc.environ().get(lifetime.LAUNCHER_ENV, "").startswith(f"{launcher_pid}:")):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_process_forked_by_a_guarded_one_dies_with_it():
    middle = (f"import os, sys, time; sys.path.insert(0, {str(REPO_ROOT)!r}); from megatron_ext import lifetime\n"
              "lifetime.die_with_parent()\n"
              "pid = os.fork()\n"
              "if pid == 0: time.sleep(60); os._exit(0)\n"
              "print(pid, flush=True); time.sleep(60)\n")
    with started([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True) as proc:
        forked = psutil.Process(int(proc.stdout.readline()))
        os.kill(proc.pid, signal.SIGKILL)
        gone, alive = psutil.wait_procs([forked], timeout=10)
        assert not alive


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_run_py_killed_alone_takes_its_ranks_along(tmp_path, megatron_clip, train_data):
    save = tmp_path / "run"
    endless = run_py(megatron_clip, train_data, save, 100000)
    with open(tmp_path / "first.log", "w") as log, started(endless, stdout=log, stderr=subprocess.STDOUT) as first:
        deadline = time.monotonic() + 240
        while layout.latest_complete_snapshot(save) is None:
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        family = psutil.Process(first.pid).children(recursive=True)  # torchrun and its two ranks
        assert sum("megatron_ext.train.pretrain_llava" in p.cmdline() for p in family) >= 3

        second = run(endless, timeout=120, check=False, fresh=True)
        assert second.returncode == 2 and len(second.stderr.splitlines()) == 1, second.stderr
        assert second.stderr.startswith(f"error: --save-dir {save} is in use by a run on ")

        os.kill(first.pid, signal.SIGKILL)  # run.py alone: nothing is forwarded
        gone, alive = psutil.wait_procs(family, timeout=20)
        assert not alive, [p.cmdline() for p in alive]
        deadline = time.monotonic() + 20
        while (left := _started_by(first.pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, [p.cmdline() for p in left]

    saved = layout.latest_complete_snapshot(save).iteration
    # The ranks either die holding the run lock or, told to stop as their launcher went, save and
    # release it (stop_signals): whichever happened, the next run starts, taking over a stale lock.
    stale = (save / ".run.lock").exists()
    resumed = run(run_py(megatron_clip, train_data, save, saved + 2), timeout=300)
    output = resumed.stdout + resumed.stderr
    assert ("took over the lock of a run on" in output and "which is gone" in output) is stale
    assert f"resumed from {save / layout.snapshot_name(saved)}" in output
    assert max(metrics(save)) == saved + 2 and not (save / ".run.lock").exists()
