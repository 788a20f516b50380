"""Training runs with the GPU path's switches give the losses of the plain run (CPU): the attention
backends, activation recomputation, overlapped gradient reduction and parameter all-gather (with
a checkpoint saved between steps), and bf16, the GPU default."""

from __future__ import annotations

import pytest

from megatron_ext.checkpoint import layout
from tests.support.training import metrics, train, trainer_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


def _run(tmp_path, name, checkpoint, data, nproc=1, **options):
    save = tmp_path / name
    train(nproc, *trainer_args(checkpoint, data, save, **options), timeout=300)
    return metrics(save)


def _assert_same(run, reference, rel=1e-6):
    assert sorted(run) == sorted(reference)
    for iteration, record in reference.items():
        assert run[iteration]["samples_digest"] == record["samples_digest"]
        assert run[iteration]["loss"] == pytest.approx(record["loss"], rel=rel), iteration
        assert run[iteration]["grad_norm"] == pytest.approx(record["grad_norm"], rel=10 * rel), iteration


def test_backends_and_recomputation_train_alike(tmp_path, megatron_clip, train_data):
    reference = _run(tmp_path, "sdpa", megatron_clip, train_data)
    snapshot = layout.find_snapshot(tmp_path / "sdpa")
    # "auto" resolved where the run happened, and stored with the checkpoint.
    assert snapshot.trainer_options["attention_backend"] == "sdpa"
    assert snapshot.run_config["execution"]["recompute_granularity"] is None
    assert all(0 <= r["padding_share"] < 1 and r["tokens_per_s"] > 0 for r in reference.values())
    _assert_same(_run(tmp_path, "sdpa-full", megatron_clip, train_data, recompute_granularity="full"), reference)
    local = _run(tmp_path, "local", megatron_clip, train_data, attention_backend="local")
    assert layout.find_snapshot(tmp_path / "local").run_config["execution"]["recompute_granularity"] == "selective"
    _assert_same(local, reference)
    # bf16, the GPU default, trains on CPU too (images reach the vision tower in the compute dtype).
    bf16 = _run(tmp_path, "bf16", megatron_clip, train_data, dtype="bfloat16")
    assert layout.find_snapshot(tmp_path / "bf16").dtype == "bfloat16"
    for iteration, record in reference.items():
        assert bf16[iteration]["loss"] == pytest.approx(record["loss"], rel=2e-2)


def test_overlapped_communication_and_a_save_between_steps(tmp_path, megatron_clip, train_data):
    """DP2 with --dist-optim: the overlapped all-gather leaves each rank's parameters partly stale
    after a step until the next forward; a checkpoint saved then must hold the updated weights."""
    plain = _run(tmp_path, "plain", megatron_clip, train_data, nproc=2, dist_optim=True,
                 overlap_grad_reduce=False, overlap_param_gather=False)
    options = dict(nproc=2, dist_optim=True, save_interval=None)  # overlap is the default
    _run(tmp_path, "overlap", megatron_clip, train_data, exit_interval=2, **options)
    # Resumed without optimizer state: iteration 3's loss (computed before its update) depends on the
    # saved weights and data position alone.
    resumed = _run(tmp_path, "overlap", megatron_clip, train_data, **options)
    assert layout.find_snapshot(tmp_path / "overlap").run_config["execution"]["overlap_param_gather"] is True
    assert resumed[1]["loss"] == pytest.approx(plain[1]["loss"], rel=1e-6)
    assert resumed[2]["loss"] == pytest.approx(plain[2]["loss"], rel=1e-6)
    assert resumed[3]["samples_digest"] == plain[3]["samples_digest"]
    assert resumed[3]["loss"] == pytest.approx(plain[3]["loss"], rel=1e-6)
