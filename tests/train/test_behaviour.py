"""What a user sees over a run: the loss falls, skipped ranges consume data, faults end cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from megatron_ext.checkpoint import layout
from tests.support.helpers import run_script, started
from tests.support.training import metrics, trainer_args


def _expected_digests(checkpoint, data, iterations: int) -> list[str]:
    """Fingerprints of the first global batches (2 micro batches of 2) straight from the data loader."""
    from megatron_ext.data.loader import train_loader
    from megatron_ext.data.task_encoder import LlavaTaskEncoder
    from megatron_ext.train.batches import samples_digest

    snapshot = layout.find_snapshot(checkpoint)
    encoder = LlavaTaskEncoder.for_model(str(snapshot.tokenizer_dir), snapshot.arch, seq_length=128)
    batches = iter(train_loader(data, encoder, micro_batch_size=2, num_workers=0, seed=1234))
    return [samples_digest([k for _ in range(2) for k in next(batches).as_dict()["keys"]]) for _ in range(iterations)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_loss_falls_and_skipped_iterations_consume_their_data(tmp_path, megatron_clip, train_data):
    save = tmp_path / "run"
    run_script("train/pretrain_llava.py", *trainer_args(megatron_clip, train_data, save, train_iters=30,
               skip_train_iteration_range="3-4"), timeout=300)
    records = metrics(save)
    assert sorted(records) == list(range(1, 31))
    assert [i for i, r in records.items() if r["skipped"]] == [3, 4]
    assert not any(r["update"] for i, r in records.items() if i in (3, 4))
    assert all(r["update"] for i, r in records.items() if i not in (3, 4))
    # Iterations 3-4 still took their samples: every iteration saw the loader's next global batch.
    assert [records[i]["samples_digest"] for i in range(1, 31)] == _expected_digests(megatron_clip, train_data, 30)
    losses = [records[i]["loss"] for i in range(1, 31) if i not in (3, 4)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.0, (first, last)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, megatron_clip, train_data):
    save = tmp_path / "run"
    command = [sys.executable, "scripts/train/pretrain_llava.py",
               *trainer_args(megatron_clip, train_data, save, train_iters=100000, save_interval=None)]
    with open(tmp_path / "log", "w") as out, started(command, stdout=out, stderr=subprocess.STDOUT) as proc:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not ((save / "metrics.jsonl").is_file()
                                                   and len((save / "metrics.jsonl").read_text().splitlines()) >= 3):
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    last = max(metrics(save))
    snapshot = layout.find_snapshot(save)
    assert snapshot.iteration == last >= 3
    assert f"stopped by SIGTERM at iteration {last}: saved {snapshot.path}" in (tmp_path / "log").read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_repeated_nonfinite_losses_stop_naming_the_last_good_checkpoint(tmp_path, megatron_clip, train_data):
    save = tmp_path / "run"
    # A huge learning rate: one Adam step puts weights near 1e30, and every later loss overflows.
    proc = run_script("train/pretrain_llava.py", *trainer_args(megatron_clip, train_data, save, train_iters=20,
                      lr=1e30, clip_grad=0, save_interval=1, max_nonfinite_steps=3), timeout=300, check=False)
    assert proc.returncode == 1
    message = proc.stderr.strip().splitlines()[-1]
    records = metrics(save)
    stopped = max(records)
    assert message.startswith("error: loss was not finite for 3 iterations in a row")
    assert f"(last: iteration {stopped})" in message
    bad = [i for i, r in records.items() if r["loss"] != r["loss"]]
    assert bad == [stopped - 2, stopped - 1, stopped] and not any(records[i]["update"] for i in bad)
    good = str(save / layout.snapshot_name(stopped - 1))
    assert f"last good checkpoint: {good}" in message and (save / layout.snapshot_name(stopped - 1)).is_dir()
