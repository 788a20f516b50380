"""A user's own small dataset: built with the defaults, it trains and evaluates without extra flags."""

from __future__ import annotations

import pytest

from megatron_ext.data.build import build_energon_dataset
from megatron_ext.demo.synthetic_data import SyntheticSpec, make_synthetic_dataset
from tests.support.helpers import run_ranks, run_script
from tests.support.training import metrics, train, trainer_args


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """37 synthetic samples built with the defaults: train 33, val 4."""
    root = tmp_path_factory.mktemp("small")
    source = make_synthetic_dataset(root / "src", SyntheticSpec(num_samples=37, seed=5))
    return build_energon_dataset(source, root / "energon", num_workers=0).output_dir


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_thirty_seven_samples_built_with_the_defaults_train_one_epoch_without_a_flag_more(tmp_path, megatron_clip,
                                                                                            small_data):
    save = tmp_path / "run"
    run_script("train/pretrain_llava.py", *trainer_args(megatron_clip, small_data, save, train_iters=None), timeout=300)
    # One epoch of the 33 training samples at global batch 4.
    assert sorted(metrics(save)) == list(range(1, 10))


def _one_val_sample(root, task: str):
    """37 synthetic samples (or pairs) built so that val holds one: train 36, val 1."""
    source = make_synthetic_dataset(root / "src", SyntheticSpec(num_samples=37, seed=5, task=task))
    return build_energon_dataset(source, root / "energon", split_ratio="36,1,0", num_workers=0, task=task).output_dir


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_val_split_smaller_than_a_global_batch_is_evaluated_on_every_data_parallel_rank(tmp_path, megatron_clip):
    data = _one_val_sample(tmp_path, "sft")
    save = tmp_path / "run"
    # Two data-parallel ranks of two micro batches each: one holds the val sample, the other none.
    train(2, *trainer_args(megatron_clip, data, save, micro_batch_size=1, train_iters=2, eval_interval=2), timeout=300)
    val = metrics(save, "val")[2]
    assert val["loss_tokens"] > 0 and val["loss"] == val["loss"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_val_pair_is_evaluated_by_dpo(tmp_path, megatron_clip):
    data = _one_val_sample(tmp_path, "preference")
    save = tmp_path / "run"
    train(1, *trainer_args(megatron_clip, data, save, stage="dpo", seq_length=192, train_iters=2, eval_interval=2),
          timeout=300)
    val = metrics(save, "val")[2]
    assert val["pairs"] == 1 and val["loss"] == val["loss"]


@pytest.mark.parametrize("name, counted", [("sft", "loss_tokens"), ("dpo", "pairs")])
def test_an_evaluation_that_scores_nothing_says_why_beside_its_nan(monkeypatch, caplog, name, counted):
    """Every val sample skipped (too long for --seq-length) or a rank's share used up: the objective's
    sums are all zero, and the nan in the val record comes with the one line saying why."""
    import math

    from megatron_ext.model import forward_step
    from megatron_ext.objectives.base import NOTHING_EVALUATED
    from megatron_ext.objectives.dpo import objective as dpo
    from megatron_ext.objectives.sft import SftObjective

    # A world of one whose loss functions returned nothing: every sum is zero, no all-reduce needed.
    for module in (forward_step, dpo):
        monkeypatch.setattr(module, "reduce_sums", lambda items, key, size: [0.0] * size)
    scored = object.__new__({"sft": SftObjective, "dpo": dpo.DpoObjective}[name])
    scored.evaluate_batch = lambda micro_batches: scored.reduce([])
    record = scored.evaluate([[], []])
    assert math.isnan(record["loss"]) and record[counted] == 0
    assert caplog.messages == [NOTHING_EVALUATED]


def _packed_epoch(tmp_path, megatron_clip, small_data, seq: int, runs: dict) -> tuple[dict, list[str]]:
    """One epoch with packing through the parity check's recording trainer (the real trainer, saving
    each global batch it trains on), once per entry of `runs` (extra options): its metrics records
    and the sample keys of every batch trained."""
    import json

    import torch

    from megatron_ext.verify.parity_run import batch_file

    config = {"megatron_load_dir": str(megatron_clip), "data_path": str(small_data), "save": True,
              "save_dir": str(tmp_path / "run"), "micro_batch_size": 2, "global_batch_size": 4, "seq_length": seq,
              "packing_seq_length": seq, "epochs": 1.0, "num_workers": 0, "stage": 2, "lr": 1e-3}
    for name, extra in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({**config, **extra}))
        run_ranks(1, "-m megatron_ext.verify.parity_run", tmp_path / "batches", tmp_path / f"{name}.json", timeout=300)
    records = metrics(tmp_path / "run")
    keys = [key for i in sorted(records) for b in torch.load(batch_file(tmp_path / "batches", i, 0))
            for row in b["keys"] for key in row.split(",")]
    return records, keys


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_epoch_with_packing_trains_each_training_sample_once(tmp_path, megatron_clip, small_data):
    records, keys = _packed_epoch(tmp_path, megatron_clip, small_data, 256, {"config": {}})
    # Every one of the 33 training samples (records 0-32) once, in fewer iterations than unpacked rows would take.
    assert sorted(keys) == [f"{i:09d}" for i in range(33)]
    assert sum(r["samples"] for r in records.values()) == 33 and len(records) < 9


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_packed_epoch_stopped_and_resumed_still_trains_each_sample_once(tmp_path, megatron_clip, small_data):
    records, keys = _packed_epoch(tmp_path, megatron_clip, small_data, 128, {"first": {"exit_interval": 1},
                                                                               "resumed": {}})
    # The first run stopped after iteration 1; the resumed one trained the rest of the pass.
    assert min(records) == 1 and max(records) > 2 and sorted(keys) == [f"{i:09d}" for i in range(33)]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_half_an_epoch_with_packing_trains_half_the_samples_once(tmp_path, megatron_clip, small_data):
    records, keys = _packed_epoch(tmp_path, megatron_clip, small_data, 256, {"half": {"epochs": 0.5}})
    # ceil(0.5 x 33) = 17 samples: the run ends at the first iteration that completes them, none twice.
    trained = [records[i]["samples"] for i in sorted(records)]
    assert len(set(keys)) == len(keys) == sum(trained) and sum(trained) >= 17 > sum(trained[:-1])


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_one_epoch_of_an_epochized_blend_with_packing_trains_each_sample_as_often_as_it_says(tmp_path, megatron_clip,
                                                                                              small_data):
    import yaml

    blend = tmp_path / "twice.yaml"
    blend.write_text(yaml.safe_dump({"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {
        "train": {"blend_epochized": [{"repetitions": 2, "path": str(small_data)}]}, "val": {"path": str(small_data)}}}))
    records, keys = _packed_epoch(tmp_path, megatron_clip, small_data, 256, {"blend": {"data_path": str(blend)}})
    assert sorted(keys) == sorted([f"{i:09d}" for i in range(33)] * 2)
