"""Tiled LLaVAs (OneVision) trained on a prepared mix of anyres images, multi-image samples and
videos: bad input is reported by reason when the dataset is prepared, an over-long sample is
skipped and counted at train time, stage 1 (TP2) trains exactly the projector and the image
newline, stage 2 (PP2, the tower unfrozen at --vision-lr 0) the language model too, the loss falls;
each rank holds the parameters, gradients and optimizer state its memory plan counts.

Checked on the weights a user gets back: the checkpoints exported to HF, tensor by tensor.
"""

from __future__ import annotations

import json

import pytest

from megatron_ext.convert.compare import synthetic_image
from tests.support.helpers import run_script
from tests.support.tiled_data import SEQ, turns
from tests.support.training import assert_held_state_is_planned, launcher_args, metrics
from tests.train.test_stages import _changed_prefixes, _hf_tensors

pytestmark = [pytest.mark.multiprocess]

@pytest.mark.timeout(120)
def test_bad_input_is_reported_by_reason_when_prepared(tiled_mix):
    _, report = tiled_mix
    assert report.written == 15 and report.videos == 3 and report.multi_image == 3
    assert report.skipped == {"video cannot be decoded": 1, "missing video file": 1,
                              "number of <image> markers differs from the number of images": 1}
    broken = next(s for s in report.skipped_samples if s["id"] == "broken")
    assert "broken.mp4: cannot decode the video" in broken["detail"]


def _loss_falls(save) -> list[float]:
    losses = [record["loss"] for _, record in sorted(metrics(save).items())]
    assert sum(losses[-2:]) < sum(losses[:2]), losses
    return losses


@pytest.mark.timeout(900)
def test_stages_train_exactly_their_modules(tmp_path, llava_onevision_siglip, megatron_onevision, tiled_mix):
    from megatron_ext.convert.to_hf import convert

    data, _ = tiled_mix
    original = _hf_tensors(llava_onevision_siglip)
    common = dict(seq_length=SEQ, lr=1e-2, train_iters=8, video_frames=4,
                  max_tiles_per_sequence=64)
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    # Through the launcher, as a user runs it.
    run_script("train/run.py", *launcher_args(2, megatron_onevision, data, stage1, stage=1, tp=2, **common), timeout=400)
    run_script("train/run.py", *launcher_args(2, megatron_onevision, data, stage2, stage=2, pp=2, unfreeze_vit=True,
                                              vision_lr=0.0, **common), timeout=400)

    for save, expected in ((stage1, {"multi_modal_projector", "image_newline"}),
                           (stage2, {"multi_modal_projector", "image_newline", "language_model"})):
        _loss_falls(save)
        # Issue 36: each rank held what the memory plan counts (stage 1 at TP2; PP2, the tower trained).
        assert_held_state_is_planned(save)
        # 32 samples drawn at random from 15: the over-long ones among them are skipped and counted.
        assert max(r["skipped_samples"] for r in metrics(save).values()) >= 1
        prefixes, changed = _changed_prefixes(original, _hf_tensors(convert(save, tmp_path / f"hf_{save.name}")))
        assert prefixes == expected
        assert changed == {n for n in original if n.split(".")[0] in expected}


@pytest.mark.timeout(600)
def test_llava_next_stage2_at_tp2_through_run_py(tmp_path, llava_next_clip):
    """LLaVA-NeXT on anyres single- and two-image samples: stage 2 at TP2 through run.py trains the
    projector, the image newline and the language model, the tower stays bit-identical, loss falls."""
    from megatron_ext.convert.to_hf import convert
    from megatron_ext.convert.to_megatron import convert as to_megatron
    from megatron_ext.data.build import build_energon_dataset

    src = tmp_path / "src"
    src.mkdir()
    for i, size in enumerate([(83, 50), (50, 117), (70, 60)]):
        synthetic_image(i, size).save(src / f"{i}.png")
    records = [{"id": f"one{i}", "image": f"{i}.png", "conversations": turns("<image>\nWhat is it?", "Noise.")}
               for i in range(3)]
    records.append({"id": "two", "image": ["0.png", "1.png"], "conversations": turns("<image>\n<image>\nSame?", "No.")})
    (src / "next.json").write_text(json.dumps(records))
    data = build_energon_dataset(src / "next.json", tmp_path / "energon", split_ratio="1,0,0", samples_per_shard=8,
                                 num_workers=0).output_dir
    megatron = to_megatron(llava_next_clip, tmp_path / "megatron", tp=2, pp=1)
    save = tmp_path / "stage2"
    run_script("train/run.py", *launcher_args(2, megatron, data, save, stage=2, tp=2, seq_length=512, lr=1e-2,
                                              train_iters=6), timeout=400)
    _loss_falls(save)
    expected = {"multi_modal_projector", "image_newline", "language_model"}
    original = _hf_tensors(llava_next_clip)
    prefixes, changed = _changed_prefixes(original, _hf_tensors(convert(save, tmp_path / "hf")))
    assert prefixes == expected
    assert changed == {n for n in original if n.split(".")[0] in expected}


@pytest.mark.timeout(60)
def test_vision_lr_is_the_towers_peak_learning_rate(tmp_path):
    """megatron-core's parameter groups under --vision-lr: the tower's own max_lr; the rest --lr,
    biases without weight decay as before (one process, a process group of one)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from megatron_ext.train.model_setup import lr_overrides

    model = torch.nn.Module()
    model.vision_model, model.language_model = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    config = OptimizerConfig(lr=1e-5, min_lr=0.0, weight_decay=0.1)
    plan = SimpleNamespace(config=SimpleNamespace(vision_lr=2e-6, min_lr=0.0))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        groups = _get_param_groups([model], config, lr_overrides(config, plan))
    finally:
        dist.destroy_process_group()
    named = {id(p): name for name, p in model.named_parameters()}
    got = {tuple(sorted(named[id(p)] for p in g["params"])): (g["max_lr"], g["wd_mult"]) for g in groups if g["params"]}
    assert got == {("language_model.weight",): (1e-5, 1.0), ("language_model.bias",): (1e-5, 0.0),
                   ("vision_model.weight",): (2e-6, 1.0), ("vision_model.bias",): (2e-6, 0.0)}
