"""Resuming: --exit-interval, kill -9 while saving and at a random moment, a failed save, and resuming a
TP2 run at TP1 x PP2; the run continues exactly (or, into another layout, to float noise)."""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
import time

import pytest

from megatron_ext.checkpoint import layout
from tests.support.helpers import child_env, kill_tree, run_ranks, started
from tests.support.training import metrics, train, trainer_args

ITERS, EVERY = 12, 2


def _args(save_dir, checkpoint, data):
    return trainer_args(checkpoint, data, save_dir, train_iters=ITERS, save_interval=EVERY, save_optim=True,
                        dist_optim=True, num_workers=1, wandb=True)


def _command(save_dir, checkpoint, data):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "scripts/train/pretrain_llava.py", *_args(save_dir, checkpoint, data)]


def _published_snapshots_are_complete(save_dir) -> int:
    """No partial snapshot is ever visible: every iter_* has its metadata, `latest` names one. Returns it."""
    for snapshot in save_dir.glob("iter_*"):
        assert (snapshot / layout.METADATA_FILE).is_file(), snapshot
    latest = int((save_dir / layout.LATEST_FILE).read_text())
    assert (save_dir / layout.snapshot_name(latest) / layout.METADATA_FILE).is_file()
    return latest


def _kill(command, save_dir, log, when) -> bool:
    """Start the run; SIGKILL torchrun and every rank (a node failure) once `when()` says so.
    Returns False when the run finished first."""
    with open(log, "a") as out, started(command, stdout=out, stderr=subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 240
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"the run hung; see {log}"
            if when():
                kill_tree(proc)
                return True
            time.sleep(0.02)
    assert proc.returncode == 0, f"the run failed; see {log}"
    return False


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_stopped_failed_and_killed_again_and_again_the_run_ends_as_if_never_stopped(tmp_path, megatron_clip, train_data):
    """--exit-interval, kill -9 of the whole run in the middle of writing a snapshot, a save whose writer
    fails, kill -9 at a random moment, each time resumed by the same command (optimizer state, data
    position, RNG, schedule restored without --load-optim): every pass of every iteration (the killed
    and failed runs' too) has an uninterrupted run's loss, gradient norm and samples; a failed save
    leaves the previous checkpoint current; W&B continues one run, TensorBoard has each iteration once."""
    reference = tmp_path / "uninterrupted"
    train(2, *_args(reference, megatron_clip, train_data), timeout=300)

    save, log = tmp_path / "killed", tmp_path / "killed.log"
    train(2, *_args(save, megatron_clip, train_data), "--exit-interval", "2", timeout=300)
    assert layout.find_snapshot(save).iteration == 2 and sorted(metrics(save)) == [1, 2]

    command = _command(save, megatron_clip, train_data)
    kills = _kill(command, save, log, lambda: bool(list(save.glob(".tmp-iter_*"))))  # while a snapshot is being written
    before = _published_snapshots_are_complete(save)

    # The writer writes the run's second snapshot, then raises (a full disk): it is never published.
    failed = run_ranks(2, "tests/train/failing_save.py", *_args(save, megatron_clip, train_data),
                          env=child_env(FAIL_SAVE="2"), check=False, timeout=300)
    assert failed.returncode != 0 and "injected checkpoint writer failure" in failed.stderr
    assert _published_snapshots_are_complete(save) == before + EVERY == layout.find_snapshot(save).iteration
    lost = before + 2 * EVERY
    assert not (save / layout.snapshot_name(lost)).exists() and (save / f".tmp-{layout.snapshot_name(lost)}").is_dir()

    kills += _kill(command, save, log, _after(random.Random(7).uniform(4.0, 12.0)))  # at a random moment (start-up included)
    _published_snapshots_are_complete(save)
    assert kills >= 2, f"the run ended before it could be killed twice; see {log}"
    _kill(command, save, log, lambda: False)  # and finally to the end
    assert _published_snapshots_are_complete(save) == ITERS and not list(save.glob(".tmp-*"))

    expected, got = metrics(reference), metrics(save)
    assert sorted(got) == list(range(1, ITERS + 1))
    for record in _records(save):
        for key in ("samples_digest", "loss", "grad_norm", "lr"):
            assert record[key] == expected[record["iteration"]][key], (record["iteration"], key)
    # What the failed save lost was trained again after resuming from the snapshot before it.
    assert [r["iteration"] for r in _records(save)].count(lost) >= 2
    assert log.read_text().count("resumed from") >= kills
    # TensorBoard dropped what a killed run logged after its checkpoint: each iteration once, as resumed.
    assert _events(save / "tensorboard", "train/loss") == [(i, pytest.approx(got[i]["loss"]))
                                                           for i in range(1, ITERS + 1)]
    # Each start that got as far as W&B (the first and the last did) added a session to one run.
    sessions = sorted((save / "wandb").glob("offline-run-*"))
    assert len(sessions) >= 2 and len({path.name.rsplit("-", 1)[1] for path in sessions}) == 1


def _after(seconds: float):
    """A moment `seconds` after the run (re)starts (the clock starts at the first question)."""
    start = []

    def when():
        if not start:
            start.append(time.monotonic())
        return time.monotonic() - start[0] >= seconds

    return when


def _records(save_dir, split="train") -> list[dict]:
    """Every record of metrics.jsonl in order (a resumed run appends to it)."""
    lines = (save_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def _lr(iteration: int, *, peak: float, minimum: float, warmup: int, total: int) -> float:
    """The schedule the README states: linear warm-up from 0, then cosine to --min-lr (megatron-core's
    OptimizerParamScheduler); iteration i trains with the rate after i - 1 steps."""
    step = iteration - 1
    if step <= warmup:
        return peak * step / warmup
    return minimum + (peak - minimum) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def _events(tensorboard_dir, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


BASE = dict(train_iters=4, save_optim=True, lr_warmup_fraction=0.5, min_lr=1e-4)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, megatron_clip, train_data):
    """Four iterations at TP2, checkpoints at 2 and 4, evaluations (the first before training),
    TensorBoard and offline W&B."""
    save = tmp_path_factory.mktemp("tp2") / "run"
    train(2, *trainer_args(megatron_clip, train_data, save, tp=2, save_interval=2, keep_last=0, eval_interval=2,
                           eval_iters=1, eval_on_start=True, wandb=True, **BASE), timeout=300)
    return save


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_what_a_run_records(tp2_run):
    expected = metrics(tp2_run)
    assert sorted(expected) == [1, 2, 3, 4]
    assert set(expected[1]) == {"split", "iteration", "loss", "lr", "grad_norm", "loss_tokens", "samples",
                                "samples_digest", "skipped_samples", "truncated_samples", "update", "skipped",
                                "iteration_time_s", "samples_per_s", "tokens_per_s", "padding_share",
                                "tflops_per_gpu", "memory_gb"}
    assert [set(r) for r in _records(tp2_run, "val")] == [{"split", "iteration", "loss", "perplexity",
                                                            "loss_tokens"}] * 3
    for iteration, record in expected.items():
        assert record["lr"] == pytest.approx(_lr(iteration, peak=1e-3, minimum=1e-4, warmup=2, total=4), abs=1e-12)
    assert _events(tp2_run / "tensorboard", "train/loss") == [(i, pytest.approx(expected[i]["loss"])) for i in range(1, 5)]
    assert [step for step, _ in _events(tp2_run / "tensorboard", "val/perplexity")] == [0, 2, 4]
    # The starting weights were evaluated on the same val batch as the trained ones, and were worse.
    start, end = _records(tp2_run, "val")[0], _records(tp2_run, "val")[-1]
    assert start["loss_tokens"] == end["loss_tokens"] and start["loss"] > end["loss"]
    (run,) = (tp2_run / "wandb").glob("offline-run-*/run-*.wandb")  # the records W&B syncs later
    assert all(key in run.read_bytes() for key in (b"seq_length", b"train/loss", b"val/perplexity"))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_resume_into_another_layout(tmp_path, tp2_run, megatron_clip, train_data):
    """TP2's checkpoint at iteration 2, continued at TP1 x PP2 (which un-splits what TP2 split, as a TP1
    run would, and splits the layers): model and optimizer state resharded on load, the data position
    and schedule restored, the same run to float noise."""
    expected = metrics(tp2_run)
    moved = tmp_path / "moved"
    shutil.copytree(tp2_run, moved, ignore=shutil.ignore_patterns("iter_0000004", "metrics.jsonl", "wandb",
                                                                  "tensorboard"))
    layout.mark_latest(moved, 2)
    train(2, *trainer_args(megatron_clip, train_data, moved, pp=2, eval_interval=4, eval_iters=1, eval_on_start=True,
                           **BASE), timeout=240)
    got = metrics(moved)
    assert sorted(got) == [3, 4]
    assert sorted(metrics(moved, "val")) == [4]  # resumed: no evaluation before its first iteration
    for iteration in (3, 4):
        assert got[iteration]["samples_digest"] == expected[iteration]["samples_digest"]
        assert got[iteration]["loss"] == pytest.approx(expected[iteration]["loss"], rel=1e-5)
        assert got[iteration]["lr"] == pytest.approx(expected[iteration]["lr"], rel=1e-12)
