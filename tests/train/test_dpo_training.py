"""--stage dpo through the trainer's command line: TRL's metric names in metrics.jsonl (train and
val) and TensorBoard, the reference unchanged over the run, a resumed run continuing exactly, and
precomputed reference log-probabilities giving the live reference's losses."""

from __future__ import annotations

import json

import pytest

from megatron_ext.objectives.dpo.loss import METRICS
from tests.support.training import metrics, train, trainer_args

DPO = {"stage": "dpo", "lr": 1e-3, "seq_length": 192, "global_batch_size": 4, "micro_batch_size": 2, "train_iters": 4,
       "lr_warmup_fraction": 0.0, "eval_interval": 2, "eval_iters": 2}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, megatron_clip, preference_data):
    save = tmp_path_factory.mktemp("dpo_whole")
    train(1, *trainer_args(megatron_clip, preference_data, save, **DPO))
    return save


def test_metrics_by_trl_names(whole_run):
    records = metrics(whole_run)
    assert sorted(records) == [1, 2, 3, 4]
    for record in records.values():
        assert set(METRICS) <= set(record) and record["loss_tokens"] == DPO["global_batch_size"]
        assert 0 <= record["rewards/accuracies"] <= 1
        assert record["rewards/margins"] == pytest.approx(record["rewards/chosen"] - record["rewards/rejected"], abs=1e-6)
    # The first step's policy is the reference: no reward yet (float noise between the two copies' forward
    # passes aside), loss log 2.
    assert records[1]["loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert records[1]["rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert records[4]["rewards/margins"] > 0
    val = metrics(whole_run, "val")
    assert sorted(val) == [2, 4] and set(METRICS) <= set(val[4]) and val[4]["pairs"] == 8
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(whole_run / "tensorboard")).Reload()
    assert {"train/rewards/accuracies", "val/rewards/margins", "train/logps/chosen"} <= set(events.Tags()["scalars"])


def test_resumed_run_continues_exactly(whole_run, tmp_path, megatron_clip, preference_data):
    first = trainer_args(megatron_clip, preference_data, tmp_path, exit_interval=2, save_optim=True, **DPO)
    train(1, *first)
    train(1, *trainer_args(megatron_clip, preference_data, tmp_path, save_optim=True, **DPO))
    resumed, whole = metrics(tmp_path), metrics(whole_run)
    assert [resumed[i]["loss"] for i in (3, 4)] == [whole[i]["loss"] for i in (3, 4)]
    assert [resumed[i]["rewards/margins"] for i in (3, 4)] == [whole[i]["rewards/margins"] for i in (3, 4)]


def test_precomputed_reference_gives_the_live_losses(whole_run, tmp_path, megatron_clip, preference_data):
    options = {**DPO, "reference_logprobs": "precompute", "save_optim": True}
    train(1, *trainer_args(megatron_clip, preference_data, tmp_path, exit_interval=2, **options))
    stored = json.loads((tmp_path / "reference_logps.json").read_text())
    # The train split's 80 pairs but those too long for --seq-length, and the val batches' 8.
    assert 40 < len(stored) <= 88
    train(1, *trainer_args(megatron_clip, preference_data, tmp_path, **options))  # resumed: reads them back
    precomputed, live = metrics(tmp_path), metrics(whole_run)
    for i in (1, 2, 3, 4):
        assert precomputed[i]["loss"] == pytest.approx(live[i]["loss"], rel=1e-6, abs=1e-7)
        # beta x sums of ~100 in float32: the rewards carry ~1e-6 of the two passes' summation noise.
        assert precomputed[i]["rewards/margins"] == pytest.approx(live[i]["rewards/margins"], abs=1e-5)


def test_dpo_checkpoint_exports_to_hf(whole_run, tmp_path):
    """A DPO run's checkpoint is a checkpoint like any other: convert_megatron_to_hf.py exports it and
    the HF model gives its logits."""
    from megatron_ext.convert.compare import compare
    from tests.support.helpers import run_script

    run_script("convert/convert_megatron_to_hf.py", "--megatron-dir", whole_run, "--hf-dir", tmp_path / "hf")
    assert compare(tmp_path / "hf", whole_run).max_abs <= 1e-4
