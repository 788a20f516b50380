"""kill -9 after a checkpoint, then the same command again: the run continues exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_ext.distributed import free_port
from tests.helpers import REPO_ROOT, child_env
from tests.train.conftest import metrics, train, trainer_args

ITERS, EVERY, KILL_AFTER = 16, 4, 8


def _args(save_dir, checkpoint, data):
    return trainer_args(checkpoint, data, save_dir, train_iters=ITERS, save_interval=EVERY, save_optim=True,
                        load_optim=True, dist_optim=True, num_workers=1)


def _command(save_dir, checkpoint, data):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
            "scripts/train/pretrain_llava.py", *_args(save_dir, checkpoint, data)]


def _kill_after_checkpoint(command, save_dir, log):
    """Start the run in its own process group and SIGKILL all of it once iteration KILL_AFTER is saved."""
    latest = save_dir / "latest_checkpointed_iteration.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if latest.is_file() and int(latest.read_text() or 0) >= KILL_AFTER:
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed mid-way (status {proc.returncode}); see {log}"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_killed_run_resumes_exactly(tmp_path, megatron_clip, train_data):
    reference = tmp_path / "uninterrupted"
    train(2, *_args(reference, megatron_clip, train_data), timeout=300)

    resumed = tmp_path / "killed"
    _kill_after_checkpoint(_command(resumed, megatron_clip, train_data), resumed, tmp_path / "killed.log")
    saved = int((resumed / "latest_checkpointed_iteration.txt").read_text())
    assert KILL_AFTER <= saved < ITERS
    train(2, *_args(resumed, megatron_clip, train_data), timeout=300)

    expected, got = metrics(reference), metrics(resumed)
    assert sorted(got) == list(range(1, ITERS + 1))
    for iteration in range(saved + 1, ITERS + 1):
        assert got[iteration]["samples_digest"] == expected[iteration]["samples_digest"], iteration
        assert got[iteration]["loss"] == expected[iteration]["loss"], iteration
        assert got[iteration]["grad_norm"] == expected[iteration]["grad_norm"], iteration
        assert got[iteration]["lr"] == expected[iteration]["lr"], iteration
    # Keep-last-3 pruned the older snapshots of the resumed run; its newest is the final one.
    assert sorted(p.name for p in resumed.glob("iter_*")) == ["iter_0000008", "iter_0000012", "iter_0000016"]
