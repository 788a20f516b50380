"""A run stopped by a signal keeps its work: SIGTERM or SIGUSR1 to run.py (a user's kill, srun
passing on scancel) or to every process of the run at once (slurmstepd) saves a snapshot at the
next iteration boundary (also when it comes during a save), exits 0 without a traceback, and the same
command resumes as if the run had never stopped; at TP2, PP2, TP2 x DP2 with --dist-optim, LoRA, DPO.

The stopped runs and their resumptions go through run.py and torchrun, as a user's do; the
uninterrupted runs they are compared with only need the trainer's numbers, so their ranks are
forked (`train`), which spares each about 20 s of fresh imports."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time

import psutil
import pytest

from megatron_ext.checkpoint import layout
from tests.support.helpers import run, started
from tests.support.stopping import RUN, assert_resumed_as_if_never_stopped, assert_stopped_cleanly, command, logged_two
from tests.support.training import metrics, train, trainer_args


def _uninterrupted(checkpoint, data, save, gpus: int = 2, **options) -> dict:
    """The metrics of `command`'s run (the same options) when nothing stops it."""
    train(gpus, *trainer_args(checkpoint, data, save, **{**RUN, **options}), timeout=300)
    return metrics(save)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, megatron_clip, train_data):
    return _uninterrupted(megatron_clip, train_data, tmp_path_factory.mktemp("uninterrupted") / "run", tp=2)


def _every_process(proc: subprocess.Popen) -> list[psutil.Process]:
    """run.py, torchrun, the ranks and their loader workers: what slurmstepd signals."""
    top = psutil.Process(proc.pid)
    return [top, *top.children(recursive=True)]


def _signal(proc: subprocess.Popen, sig: int, whole_job: bool) -> None:
    for member in _every_process(proc) if whole_job else [psutil.Process(proc.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(sig)


def _saving(save):
    """While a snapshot is being written (under its temporary name), after the first one."""
    return lambda: layout.latest_complete_snapshot(save) is not None and any(save.glob(".tmp-iter_*"))


def _stopped_run(cmd, save, log, gpus: int, sig: int, whole_job: bool, ready) -> int:
    """The run signalled once `ready()`; returns run.py's exit status."""
    with open(log, "w") as out, started(cmd, stdout=out, stderr=subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 240
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.01)
        # torchrun, the ranks and each rank's two loader workers (forks of it)
        assert sum("megatron_ext.train.pretrain_llava" in p.cmdline() for p in _every_process(proc)) == 1 + 3 * gpus
        _signal(proc, sig, whole_job)
        return proc.wait(timeout=120)


def _resume(stopped, save, stopped_at: int, expected: dict) -> None:
    resumed = run(stopped, timeout=300)
    assert_resumed_as_if_never_stopped(resumed.stdout + resumed.stderr, save, stopped_at, expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_tp2_run_sent_sigterm_saves_exits_0_and_resumes_as_if_never_stopped(tmp_path, megatron_clip, train_data,
                                                                              uninterrupted):
    save, log = tmp_path / "run", tmp_path / "stopped.log"
    stopped = command(megatron_clip, train_data, save, tp=2)
    status = _stopped_run(stopped, save, log, 2, signal.SIGTERM, False, logged_two(save))
    stopped_at = assert_stopped_cleanly(status, save, log.read_text(), signal.SIGTERM)
    _resume(stopped, save, stopped_at, uninterrupted)


# SLURM's `--signal=USR1@seconds`, sent to every process. What it saves, the run above resumes from alike.
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_tp2_run_whose_every_process_gets_sigusr1_saves_and_exits_0(tmp_path, megatron_clip, train_data):
    save, log = tmp_path / "run", tmp_path / "stopped.log"
    status = _stopped_run(command(megatron_clip, train_data, save, tp=2), save, log, 2, signal.SIGUSR1, True,
                          logged_two(save))
    assert_stopped_cleanly(status, save, log.read_text(), signal.SIGUSR1)


# (processes, options, data fixture, whether to resume and compare with an uninterrupted run). Resuming
# from a snapshot at these layouts is tested in test_resume.py, test_lora.py and test_dpo_training.py;
# a snapshot a signal asked for is written by the same code: resumed here where the signal came mid-save.
LAYOUTS = {
    "pp2-signalled-while-saving": (2, dict(pp=2, save_interval=1), "train_data", True),
    "tp2xdp2-dist-optim": (4, dict(tp=2, dist_optim=True), "train_data", False),
    "lora-tp2": (2, dict(tp=2, lora_rank=4, lora_alpha=8.0), "train_data", False),
    "dpo-tp2": (2, dict(tp=2, stage="dpo", seq_length=192), "preference_data", False),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_run_of_any_layout_signalled_as_slurm_does_saves_and_exits_0(tmp_path, request, megatron_clip, name):
    gpus, options, data_fixture, resume = LAYOUTS[name]
    data = request.getfixturevalue(data_fixture)
    save, log = tmp_path / "run", tmp_path / "stopped.log"
    stopped = command(megatron_clip, data, save, gpus, **options)
    ready = _saving(save) if options.get("save_interval") else logged_two(save)
    status = _stopped_run(stopped, save, log, gpus, signal.SIGTERM, True, ready)
    stopped_at = assert_stopped_cleanly(status, save, log.read_text(), signal.SIGTERM)
    if resume:
        _resume(stopped, save, stopped_at, _uninterrupted(megatron_clip, data, tmp_path / "uninterrupted", gpus, **options))
