"""TP2 and PP2 runs give the same losses as TP1 from the same checkpoint and data."""

from __future__ import annotations

import pytest

from tests.train.conftest import metrics, train, trainer_args


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_tp2_and_pp2_match_tp1(tmp_path, megatron_clip, train_data):
    runs = {}
    for name, nproc, options in (("tp1", 1, {}), ("tp2", 2, {"tp": 2}), ("pp2", 2, {"pp": 2})):
        save = tmp_path / name
        train(nproc, *trainer_args(megatron_clip, train_data, save, train_iters=3, **options), timeout=300)
        runs[name] = metrics(save)

    reference = runs["tp1"]
    assert sorted(reference) == [1, 2, 3]
    for name in ("tp2", "pp2"):
        for iteration, record in reference.items():
            other = runs[name][iteration]
            # Same samples in the same order, the same token count and (to float noise) the same loss.
            assert other["samples_digest"] == record["samples_digest"]
            assert other["loss_tokens"] == record["loss_tokens"]
            assert other["loss"] == pytest.approx(record["loss"], rel=1e-5), (name, iteration)
            assert other["grad_norm"] == pytest.approx(record["grad_norm"], rel=1e-4), (name, iteration)
