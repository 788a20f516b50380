"""A run stopped by a signal keeps its work: SIGTERM, SIGINT or SIGUSR1 to run.py (a user's kill,
Ctrl-C, srun passing on scancel) or to every process of the run at once (slurmstepd) saves a
snapshot at the next iteration boundary, exits 0 without a traceback, and the same command resumes
as if the run had never stopped."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatron_ext.checkpoint import layout
from tests.helpers import REPO_ROOT, run, started
from tests.train.conftest import launcher_args, metrics

ITERS = 8


def _command(checkpoint, data, save):
    """run.py at TP2 with two loader workers per rank (the default), no periodic saves."""
    return [sys.executable, str(REPO_ROOT / "scripts/train/run.py"),
            *launcher_args(2, checkpoint, data, save, tp=2, num_workers=2, train_iters=ITERS,
                            save_optim=True)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, megatron_clip, train_data):
    save = tmp_path_factory.mktemp("uninterrupted") / "run"
    run(_command(megatron_clip, train_data, save), timeout=300)
    return metrics(save)


def _every_process(proc: subprocess.Popen) -> list[psutil.Process]:
    """run.py, torchrun, the ranks and their loader workers: what slurmstepd signals."""
    top = psutil.Process(proc.pid)
    return [top, *top.children(recursive=True)]


def _signal(proc: subprocess.Popen, sig: int, whole_job: bool) -> None:
    for member in _every_process(proc) if whole_job else [psutil.Process(proc.pid)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.send_signal(sig)


def _stopped_run(command, save, log, sig: int, whole_job: bool) -> int:
    """The run signalled once it has logged two iterations; returns run.py's exit status."""
    with open(log, "w") as out, started(command, stdout=out, stderr=subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 240
        while not (save / "metrics.jsonl").is_file() or len(metrics(save)) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        # torchrun, two ranks and each rank's two loader workers (forks of it)
        assert sum("megatron_ext.train.pretrain_llava" in p.cmdline() for p in _every_process(proc)) == 7
        _signal(proc, sig, whole_job)
        return proc.wait(timeout=120)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig,whole_job", [(signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGUSR1, True)],
                         ids=["sigterm-to-run.py", "sigterm-to-every-process", "sigusr1-to-every-process"])
def test_a_stopped_tp2_run_saves_exits_0_and_resumes_as_if_never_stopped(tmp_path, megatron_clip, train_data,
                                                                         uninterrupted, sig, whole_job):
    save, log = tmp_path / "run", tmp_path / "stopped.log"
    command = _command(megatron_clip, train_data, save)
    status = _stopped_run(command, save, log, sig, whole_job)
    output = log.read_text()
    assert status == 0, output[-3000:]
    stopped_at = max(metrics(save))
    assert stopped_at < ITERS and layout.latest_complete_snapshot(save).iteration == stopped_at
    name = signal.Signals(sig).name
    assert f"stopped by {name} at iteration {stopped_at}: saved {save / layout.snapshot_name(stopped_at)}; " \
           "the same command resumes from it" in output
    for sign in ("Traceback", "SignalException", "killed by signal", "error"):
        assert sign not in output, output[-3000:]

    resumed = run(command, timeout=300)
    assert f"resumed from {save / layout.snapshot_name(stopped_at)}" in resumed.stdout + resumed.stderr
    got = metrics(save)
    assert sorted(got) == list(range(1, ITERS + 1))
    for iteration, record in got.items():
        for key in ("samples_digest", "loss", "grad_norm"):
            assert record[key] == uninterrupted[iteration][key], (iteration, key)
