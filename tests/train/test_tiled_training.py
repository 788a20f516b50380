"""Tiled LLaVAs (OneVision) trained on a prepared mix of anyres images, multi-image samples and
videos: bad input is reported by reason when the dataset is prepared, an over-long sample is
skipped and counted at train time, stage 1 (TP2) trains exactly the projector and the image
newline, stage 2 (PP2, the tower unfrozen at --vision-lr 0) the language model too, the loss falls.

Checked on the weights a user gets back: the checkpoints exported to HF, tensor by tensor.
"""

from __future__ import annotations

import json

import av
import numpy as np
import pytest

from megatron_ext.convert.compare import synthetic_image
from tests.train.conftest import metrics, train, trainer_args
from tests.train.test_stages import _changed_prefixes, _hf_tensors

pytestmark = [pytest.mark.multiprocess]

SEQ = 256


def _video(path, frames: int = 6):
    """A 64 x 48 video that brightens frame by frame."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=5)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            pixels = np.full((48, 64, 3), 30 * i + 20, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _turns(question: str, answer: str) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


@pytest.fixture(scope="module")
def tiled_mix(tmp_path_factory):
    """(prepared dataset, its build report): 12 good samples of every kind, 3 bad ones."""
    from megatron_ext.data.build import build_energon_dataset

    src = tmp_path_factory.mktemp("tiled_src")
    sizes = [(83, 50), (50, 117), (70, 60), (60, 70), (120, 40), (40, 40)]
    for i, size in enumerate(sizes):
        synthetic_image(i, size).save(src / f"{i}.png")
    _video(src / "clip.mp4")
    (src / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(200))
    records = []
    for i in range(12):
        kind = i % 4
        if kind == 0:
            records.append({"id": f"one{i}", "image": f"{i % 6}.png", "conversations": _turns("<image>\nWhat is it?", "Noise.")})
        elif kind == 1:
            records.append({"id": f"two{i}", "image": [f"{i % 6}.png", f"{(i + 1) % 6}.png"],
                            "conversations": _turns("<image>\n<image>\nSame?", "No, different noise.")})
        elif kind == 2:
            # LLaVA-Video's JSON marks the video with <image>.
            records.append({"id": f"video{i}", "video": "clip.mp4", "conversations": _turns("<image>\nWhat happens?", "It brightens.")})
        else:
            records.append({"id": f"text{i}", "conversations": _turns("Say hi.", "Hi.")})
    records += [
        {"id": "broken", "video": "broken.mp4", "conversations": _turns("<video>\nWhat happens?", "Nothing.")},
        {"id": "markers", "image": "0.png", "conversations": _turns("<image>\n<image>\nTwo?", "One.")},
        {"id": "missing", "video": "absent.mp4", "conversations": _turns("<video>\nWhat?", "Nothing.")},
        # Its image would start past the sequence length: skipped when trained on.
        {"id": "long", "image": "1.png", "conversations": _turns("lorem " * SEQ + "<image>", "Noise.")},
    ]
    (src / "mix.json").write_text(json.dumps(records))
    out = tmp_path_factory.mktemp("tiled_data") / "energon"
    report = build_energon_dataset(src / "mix.json", out, split_ratio="1,0,0", samples_per_shard=8, num_workers=0)
    return out, report


@pytest.fixture(scope="module")
def megatron_onevision(tmp_path_factory, llava_onevision_siglip):
    from megatron_ext.convert.to_megatron import convert

    return convert(llava_onevision_siglip, tmp_path_factory.mktemp("megatron_onevision") / "ckpt", tp=1, pp=1)


@pytest.mark.timeout(120)
def test_bad_input_is_reported_by_reason_when_prepared(tiled_mix):
    _, report = tiled_mix
    assert report.written == 13 and report.videos == 3 and report.multi_image == 3
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
    common = dict(seq_length=SEQ, lr=1e-2, train_iters=8, chat_template="plain", video_frames=4,
                  max_tiles_per_sequence=64)
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    train(2, *trainer_args(megatron_onevision, data, stage1, stage=1, tp=2, **common), timeout=400)
    train(2, *trainer_args(megatron_onevision, data, stage2, stage=2, pp=2, unfreeze_vit=True, vision_lr=0.0,
                           **common), timeout=400)

    for save, expected in ((stage1, {"multi_modal_projector", "image_newline"}),
                           (stage2, {"multi_modal_projector", "image_newline", "language_model"})):
        _loss_falls(save)
        # The over-long sample is met in every pass over the 13 samples (8 x 4 drawn), never trained.
        assert max(r["skipped_samples"] for r in metrics(save).values()) >= 2
        prefixes, changed = _changed_prefixes(original, _hf_tensors(convert(save, tmp_path / f"hf_{save.name}")))
        assert prefixes == expected
        assert changed == {n for n in original if n.split(".")[0] in expected}
