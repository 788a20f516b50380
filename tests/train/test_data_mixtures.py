"""What LLaVA recipes feed the trainer: a mix665k-shaped dataset (text-only, multi-image, PNG and odd
image modes) blended by weight with a fraction of another dataset, packed, stage 2 at TP2, with
LLaVA-1.5's padded images; the image aspect mode travels with the checkpoint to generation."""

from __future__ import annotations

import math

import pytest
import yaml

from megatron_ext.checkpoint import layout
from megatron_ext.data.build import build_energon_dataset
from megatron_ext.data.prepared import split_counts
from tests.data.mix665k import GOOD, write_mix665k
from tests.support.training import metrics, train, trainer_args


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_stage2_packed_at_tp2_on_a_blend_with_a_mix665k_shaped_dataset(tmp_path, megatron_clip, train_data):
    mix = build_energon_dataset(write_mix665k(tmp_path / "src"), tmp_path / "mix", split_ratio="1,0,0", num_workers=0)
    blend = tmp_path / "blend.yaml"
    blend.write_text(yaml.safe_dump({
        "__module__": "megatron.energon", "__class__": "MetadatasetV2",
        "splits": {"train": {"blend": [{"weight": 3, "path": mix.output_dir},
                                       {"weight": 1, "path": str(train_data), "subset": {"range": ["0%", "5%"]}}]},
                   "val": {"path": str(train_data)}},
    }))
    assert split_counts(blend)["train"].samples == len(GOOD) + 4  # 14 + a twentieth of 80 (an epoch of few steps)
    save = tmp_path / "run"
    train(2, *trainer_args(megatron_clip, blend, save, tp=2, packing_seq_length=128, micro_batch_size=1,
                           train_iters=None, epochs=1, image_aspect="pad"), timeout=300)
    records = metrics(save)
    # With packing an epoch counts samples (18): the run ends at the first iteration that completes them.
    trained = [records[i]["samples"] for i in sorted(records)]
    assert sorted(records) == list(range(1, len(records) + 1)) and len(records) < math.ceil(18 / 4)
    assert sum(trained) >= 18 > sum(trained[:-1])
    assert all(r["update"] and math.isfinite(r["loss"]) for r in records.values())
    last = records[max(records)]
    assert last["skipped_samples"] == 0 and last["truncated_samples"] == 0
    assert layout.find_snapshot(save).trainer_options["image_aspect"] == "pad"

    from megatron_ext.eval.checkpoints import open_checkpoint

    assert open_checkpoint(str(save), None).image_aspect == "pad"
    assert open_checkpoint(str(save), None, image_aspect="crop").encoder.image_aspect == "crop"
