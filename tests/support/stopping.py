"""Checks of a run stopped by a signal (docs/launcher.md "A real run"): it saved its last iteration
and said so, with no sign of a failure, and the same command resumed as if it had never stopped."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from megatron_ext.checkpoint import layout
from tests.support.helpers import REPO_ROOT
from tests.support.training import launcher_args, metrics

ITERS = 8
# Options of every stopped run: two loader workers per rank (the default), optimizer state saved, no periodic saves.
RUN = dict(num_workers=2, train_iters=ITERS, save_optim=True)
# What a clean stop never prints: a traceback, torchrun's report of a signal, a loader worker killed, an
# error line (ours, srun's, slurmstepd's). Not "Error": warnings quote exception names (a DPO pair too long
# is skipped with "ValueError: ...").
FAILURE_SIGNS = ("Traceback", "SignalException", "killed by signal", "error")


def command(checkpoint, data, save, gpus: int = 2, **options) -> list[str]:
    """run.py for a run of `gpus` processes with RUN's options (and `options`)."""
    return [sys.executable, str(REPO_ROOT / "scripts/train/run.py"),
            *launcher_args(gpus, checkpoint, data, save, **{**RUN, **options})]


def logged_two(save: Path):
    """Ready to be stopped: two iterations logged."""
    return lambda: (save / "metrics.jsonl").is_file() and len(metrics(save)) >= 2


def assert_no_failure_signs(output: str) -> None:
    for sign in FAILURE_SIGNS:
        assert sign not in output, output[-3000:]


def assert_stopped_cleanly(status: int, save: Path, output: str, sig: int, iters: int = ITERS) -> int:
    """The checks of a stopped run of `iters` iterations: status 0, stopped before its end, its last
    iteration saved and said so, no sign of a failure. Returns that iteration."""
    assert status == 0, output[-3000:]
    stopped_at = max(metrics(save))
    assert stopped_at < iters and layout.latest_complete_snapshot(save).iteration == stopped_at
    assert f"stopped by {signal.Signals(sig).name} at iteration {stopped_at}: saved " \
           f"{save / layout.snapshot_name(stopped_at)}; the same command resumes from it" in output
    assert_no_failure_signs(output)
    return stopped_at


def assert_resumed_as_if_never_stopped(output: str, save: Path, stopped_at: int, expected: dict) -> None:
    """The run after the stop (`output`) resumed from its snapshot and logged the iterations of
    `expected` (an uninterrupted run's metrics) with their samples, losses and gradient norms exactly."""
    assert f"resumed from {save / layout.snapshot_name(stopped_at)}" in output, output[-3000:]
    got = metrics(save)
    assert sorted(got) == sorted(expected)
    for iteration, record in got.items():
        for key in ("samples_digest", "loss", "grad_norm"):
            assert record[key] == expected[iteration][key], (iteration, key)
