"""Resuming: kill -9 after a checkpoint, --exit-interval, a failed save, and resuming at TP2 x PP2 or
into another layout; the run continues exactly (or, into another layout, to float noise)."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron_ext.checkpoint import layout
from tests.helpers import child_env, kill_tree, run_python, run_script, started
from tests.train.conftest import metrics, train, trainer_args

ITERS, EVERY, KILL_AFTER = 16, 4, 8


def _args(save_dir, checkpoint, data):
    return trainer_args(checkpoint, data, save_dir, train_iters=ITERS, save_interval=EVERY, save_optim=True,
                        load_optim=True, dist_optim=True, num_workers=1)


def _command(save_dir, checkpoint, data):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "scripts/train/pretrain_llava.py", *_args(save_dir, checkpoint, data)]


def _kill_after_checkpoint(command, save_dir, log):
    """Start the run and SIGKILL torchrun and every rank (a node failure) once iteration KILL_AFTER is saved."""
    latest = save_dir / "latest_checkpointed_iteration.txt"
    with open(log, "w") as out, started(command, stdout=out, stderr=subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if latest.is_file() and int(latest.read_text() or 0) >= KILL_AFTER:
                kill_tree(proc)
                break
            time.sleep(0.05)
    assert proc.returncode == -signal.SIGKILL, f"the run was not killed mid-way (status {proc.returncode}); see {log}"


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_killed_run_resumes_exactly(tmp_path, megatron_clip, train_data):
    reference = tmp_path / "uninterrupted"
    train(2, *_args(reference, megatron_clip, train_data), timeout=300)

    resumed = tmp_path / "killed"
    _kill_after_checkpoint(_command(resumed, megatron_clip, train_data), resumed, tmp_path / "killed.log")
    saved = int((resumed / "latest_checkpointed_iteration.txt").read_text())
    assert KILL_AFTER <= saved < ITERS and layout.find_snapshot(resumed).iteration == saved
    run = train(2, *_args(resumed, megatron_clip, train_data), timeout=300)
    assert f"resumed from {resumed / layout.snapshot_name(saved)}" in run.stdout + run.stderr

    expected, got = metrics(reference), metrics(resumed)
    assert sorted(got) == list(range(1, ITERS + 1))
    for iteration in range(saved + 1, ITERS + 1):
        assert got[iteration]["samples_digest"] == expected[iteration]["samples_digest"], iteration
        assert got[iteration]["loss"] == expected[iteration]["loss"], iteration
        assert got[iteration]["grad_norm"] == expected[iteration]["grad_norm"], iteration
        assert got[iteration]["lr"] == expected[iteration]["lr"], iteration
    # Keep-last-3 pruned the older snapshots of the resumed run; its newest is the final one.
    assert sorted(p.name for p in resumed.glob("iter_*")) == ["iter_0000008", "iter_0000012", "iter_0000016"]


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


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_resume_at_tp2_pp2_and_into_another_layout(tmp_path, megatron_clip, train_data):
    base = dict(train_iters=4, save_optim=True, load_optim=True, lr_warmup_fraction=0.5, min_lr=1e-4)
    reference = tmp_path / "tp2pp2"
    train(4, *trainer_args(megatron_clip, train_data, reference, tp=2, pp=2, save_interval=2, keep_last=0,
                           eval_interval=2, eval_iters=1, wandb=True, **base), timeout=400)
    expected = metrics(reference)

    # What a run records: its metrics, the schedule, TensorBoard events and an offline W&B run.
    assert sorted(expected) == [1, 2, 3, 4]
    assert set(expected[1]) == {"split", "iteration", "loss", "lr", "grad_norm", "loss_tokens", "samples",
                                "samples_digest", "skipped_samples", "truncated_samples", "update", "skipped",
                                "iteration_time_s", "samples_per_s", "tokens_per_s", "padding_share",
                                "tflops_per_gpu", "memory_gb"}
    assert [set(r) for r in _records(reference, "val")] == [{"split", "iteration", "loss", "perplexity",
                                                              "loss_tokens"}] * 2
    for iteration, record in expected.items():
        assert record["lr"] == pytest.approx(_lr(iteration, peak=1e-3, minimum=1e-4, warmup=2, total=4), abs=1e-12)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(reference / "tensorboard"))
    events.Reload()
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/loss")] == \
        [(i, expected[i]["loss"]) for i in range(1, 5)]
    assert [e.step for e in events.Scalars("val/perplexity")] == [2, 4]
    (run,) = (reference / "wandb").glob("offline-run-*/run-*.wandb")  # the records W&B syncs later
    assert all(key in run.read_bytes() for key in (b"seq_length", b"train/loss", b"val/perplexity"))

    # The same layout, resumed from the checkpoint at iteration 2 (as after a crash right after it).
    resumed = tmp_path / "tp2pp2-resumed"
    shutil.copytree(reference, resumed, ignore=shutil.ignore_patterns("iter_0000004", "metrics.jsonl", "wandb",
                                                                      "tensorboard"))
    layout.mark_latest(resumed, 2)
    train(4, *trainer_args(megatron_clip, train_data, resumed, tp=2, pp=2, **base), timeout=400)
    got = metrics(resumed)
    assert sorted(got) == [3, 4]
    for iteration in (3, 4):
        for key in ("samples_digest", "loss", "grad_norm", "lr"):
            assert got[iteration][key] == expected[iteration][key], (iteration, key)

    # --exit-interval at TP2, then the same command at TP1: the checkpoint is resharded on load.
    moved = tmp_path / "tp2-then-tp1"
    train(2, *trainer_args(megatron_clip, train_data, moved, tp=2, exit_interval=2, **base), timeout=300)
    assert layout.find_snapshot(moved).iteration == 2 and sorted(metrics(moved)) == [1, 2]
    train(1, *trainer_args(megatron_clip, train_data, moved, **base), timeout=300)
    got = metrics(moved)
    assert sorted(got) == [1, 2, 3, 4]
    for iteration in range(1, 5):
        assert got[iteration]["samples_digest"] == expected[iteration]["samples_digest"]
        assert got[iteration]["loss"] == pytest.approx(expected[iteration]["loss"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_failed_save_leaves_the_previous_checkpoint_current(tmp_path, megatron_clip, train_data):
    save = tmp_path / "run"
    args = trainer_args(megatron_clip, train_data, save, train_iters=3, save_interval=1, save_optim=True,
                        load_optim=True)
    proc = run_python("tests/train/failing_save.py", *args, env=child_env(FAIL_SAVE="2"), check=False, timeout=300)
    assert proc.returncode != 0 and "injected checkpoint writer failure" in proc.stderr
    # The failed snapshot was never published: the latest is the last complete one.
    assert (save / layout.LATEST_FILE).read_text().strip() == "1"
    assert layout.find_snapshot(save).iteration == 1
    assert not (save / "iter_0000002").exists() and (save / ".tmp-iter_0000002").is_dir()

    run_script("train/pretrain_llava.py", *args, timeout=300)
    assert layout.find_snapshot(save).iteration == 3 and not list(save.glob(".tmp-*"))
    second = [r for r in _records(save) if r["iteration"] == 2]
    assert len(second) == 2  # before the failed save, and again after resuming from iteration 1
    assert second[0]["loss"] == second[1]["loss"] and second[0]["samples_digest"] == second[1]["samples_digest"]
