"""The native-resolution task encoder (Qwen2.5-VL): ChatML conversations with images of any size
become expanded tokens, the answer's loss mask, mRoPE positions and pixel rows; a micro batch holds
images of many sizes, rows concatenated and grids listed; a pack keeps each sample's positions."""

from __future__ import annotations

import json

import pytest
import torch
from megatron.energon import Sample
from PIL import Image

from megatron_ext import families
from megatron_ext.data.native_resolution import QWEN2_5_VL, image_inputs, mrope_positions, token_types
from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder
from megatron_ext.errors import UserError
from tests.support.qwen2_5_vl import IMAGE_TOKEN, VIDEO_TOKEN, tiny_config
from tests.support.qwen_vl import tiny_tokenizer

VISION_START, VISION_END, IM_END = 502, 503, 505
QUESTION = [{"role": "user", "content": "<image>\nWhat is this? <image>"}, {"role": "assistant", "content": "A cat."}]
IMAGES = [Image.new("RGB", (91, 37), (1, 2, 3)), Image.new("RGB", (60, 40), (9, 9, 9))]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_5_vl_tokenizer")
    tiny_config().save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def _encoder(tokenizer_dir, **kwargs):
    arch = families.read_model(json.loads((tokenizer_dir / "config.json").read_text()))
    return NativeResolutionTaskEncoder.for_model(str(tokenizer_dir), arch, **{"seq_length": 128, **kwargs})


def _encoded(encoder, messages=QUESTION, images=IMAGES, key="a"):
    return encoder.encode_conversation(Sample(__key__=key, __restore_key__=()), messages, images, [])


def test_each_image_becomes_a_vision_run_of_its_merged_patch_count(tokenizer_dir):
    sample = _encoded(_encoder(tokenizer_dir))
    ids = sample.input_ids.tolist()
    # 91x37 is resized to 112x56 (grid 1x4x8: 8 merged tokens), 60x40 to 84x56 (1x4x6: 6).
    assert sample.image_grid_thw.tolist() == [[1, 4, 8], [1, 4, 6]]
    first = ids.index(VISION_START)
    assert ids[first:first + 10] == [VISION_START] + [IMAGE_TOKEN] * 8 + [VISION_END]
    second = ids.index(VISION_START, first + 1)
    assert ids[second:second + 8] == [VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END]
    assert len(ids) == 51 and ids.count(IMAGE_TOKEN) == 14
    expected = image_inputs(IMAGES, QWEN2_5_VL)
    assert torch.equal(sample.pixel_values, expected["pixel_values"]) and sample.pixel_values.shape == (56, 1176)
    assert torch.equal(sample.position_ids, mrope_positions(token_types(ids, IMAGE_TOKEN, VIDEO_TOKEN), QWEN2_5_VL,
                                                            expected["image_grid_thw"]))
    # The text after the second image starts at its start + max(4, 6) / 2 = 24 + 3.
    assert sample.position_ids[:, second + 7].tolist() == [27, 27, 27]


def test_the_loss_trains_the_answer_and_its_end_of_turn_only(tokenizer_dir):
    """The reply's completion as TRL trains it with ChatML: the answer, <|im_end|> and the newline after it."""
    encoder = _encoder(tokenizer_dir)
    sample = _encoded(encoder)
    trained = sample.labels[sample.loss_mask.bool()]
    assert encoder.chat.tokenizer.decode(trained) == "A cat.<|im_end|>\n" and trained[-2] == IM_END
    assert sample.loss_mask[-1] == 0 and int(sample.loss_mask.sum()) == len(trained) == 5


def test_a_micro_batch_holds_images_of_many_sizes_without_padding_them(tokenizer_dir):
    encoder = _encoder(tokenizer_dir)
    other = _encoded(encoder, [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "Yes."}],
                     [Image.new("RGB", (200, 300))], key="b")
    batch = encoder.batch([_encoded(encoder), other]).as_dict()
    assert batch["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 6], [1, 22, 14]]
    assert batch["pixel_values"].shape == (32 + 24 + 308, 1176) and batch["pixel_values_videos"].shape == (0, 1176)
    assert batch["input_ids"].shape == (2, 103) and batch["position_ids"].shape == (3, 2, 103)
    lengths = batch["segment_ids"].sum(1).tolist()
    assert lengths == [51, 103] and batch["keys"] == ["a", "b"] and batch["num_samples"] == 2
    assert (batch["position_ids"][:, 0, 51:] == 0).all() and (batch["loss_mask"][0, 51:] == 0).all()
    assert torch.equal(batch["position_ids"][:, 1], other.position_ids)


def test_truncation_never_cuts_an_image(tokenizer_dir):
    with pytest.raises(ValueError, match="^an image does not fit in the sequence length 32$"):
        _encoded(_encoder(tokenizer_dir, seq_length=32))
    with pytest.raises(UserError, match=r"^--packing-seq-length 256 exceeds --seq-length 128, the model's sequence "
                                        r"length$"):
        _encoder(tokenizer_dir, packing_seq_length=256)


def test_a_pack_keeps_each_samples_positions_and_media_in_order(tokenizer_dir):
    encoder = _encoder(tokenizer_dir, packing_seq_length=128)
    first = _encoded(encoder)
    second = _encoded(encoder, [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "Yes."}],
                      [Image.new("RGB", (60, 40))], key="b")
    assert [[s.__key__ for s in pack] for pack in encoder.select_samples_to_pack([first, second, first])] == [
        ["a", "a"], ["b"]]
    batch = encoder.batch([encoder.pack_selected_samples([first, second])]).as_dict()
    assert batch["input_ids"].shape == (1, 83) and batch["keys"] == ["a,b"] and batch["num_samples"] == 2
    assert batch["segment_ids"][0].tolist() == [1] * 51 + [2] * 32
    assert torch.equal(batch["position_ids"][:, 0, :51], first.position_ids)
    assert torch.equal(batch["position_ids"][:, 0, 51:], second.position_ids) and second.position_ids[0, 0] == 0
    assert batch["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 6], [1, 4, 6]]
    assert torch.equal(batch["pixel_values"], torch.cat([first.pixel_values, second.pixel_values]))


def test_a_video_becomes_its_frame_pairs_tokens_with_its_seconds_per_pair(tokenizer_dir, tmp_path):
    from tests.support.tiled_data import write_video

    write_video(tmp_path / "clip.mp4")  # 6 frames of 64 x 48
    encoder = _encoder(tokenizer_dir, video_frames=4, seq_length=512)
    messages = [{"role": "user", "content": "<video>\nWhat happens?"}, {"role": "assistant", "content": "It brightens."}]
    sample = encoder.encode_conversation(Sample(__key__="v", __restore_key__=()), messages, [],
                                         [(tmp_path / "clip.mp4").read_bytes()])
    batch = encoder.batch([sample]).as_dict()
    assert batch["video_grid_thw"].tolist() == [[2, 20, 28]] and batch["pixel_values_videos"].shape == (1120, 1176)
    assert int((batch["input_ids"] == VIDEO_TOKEN).sum()) == 280 and batch["image_grid_thw"].shape == (0, 3)
    assert batch["second_per_grid_ts"].tolist() == pytest.approx([0.6], abs=1e-7)
    # The second frame pair's T: 4 tokens per second x 0.6 s, floored: 2 after the first's.
    first = sample.input_ids.tolist().index(VIDEO_TOKEN)
    assert sample.position_ids[0, first + 140] - sample.position_ids[0, first] == 2


def test_a_qwen3_vl_video_becomes_its_frame_pairs_each_after_its_time_in_text(tmp_path):
    """As transformers 5.24's Qwen3VLProcessor writes it: inside the video's vision run, each frame pair's
    `<s.s seconds>` (the mean of its frames' times) and its own run of pads; no seconds per pair in the
    batch; each pair's positions a grid of its own (T constant) starting after its time's tokens."""
    from tests.support import qwen3_vl
    from tests.support.tiled_data import write_video

    qwen3_vl.tiny_config().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    write_video(tmp_path / "clip.mp4")  # 6 frames of 64 x 48 at 5 fps: frames 0, 1, 3, 5 sampled
    encoder = _encoder(tmp_path, video_frames=4, seq_length=512)
    messages = [{"role": "user", "content": "<video>\nWhat happens?"}, {"role": "assistant", "content": "It brightens."}]
    sample = encoder.encode_conversation(Sample(__key__="v", __restore_key__=()), messages, [],
                                         [(tmp_path / "clip.mp4").read_bytes()])
    # Resized up to the video pixel floor: 160 x 224, two frame pairs of 10 x 14 patches, 35 tokens each.
    assert sample.video_grid_thw.tolist() == [[2, 10, 14]] and sample.pixel_values_videos.shape == (280, 1536)
    assert sample.second_per_grid_ts.numel() == 0
    ids = sample.input_ids.tolist()
    pads = "<|video_pad|>" * 35
    video = (f"<|vision_start|><0.1 seconds><|vision_start|>{pads}<|vision_end|><0.8 seconds><|vision_start|>{pads}"
             "<|vision_end|><|vision_end|>")
    assert video in encoder.chat.tokenizer.decode(ids) and ids.count(VIDEO_TOKEN) == 70
    first = ids.index(VIDEO_TOKEN)
    second = ids.index(VIDEO_TOKEN, first + 35)
    for start in (first, second):
        pair = sample.position_ids[:, start:start + 35]
        assert (pair[0] == pair[0, 0]).all() and pair[:, 0].tolist() == [sample.position_ids[0, start - 1] + 1] * 3
    assert pair[1:, -1].tolist() == [pair[0, 0] + 4, pair[0, 0] + 6]  # the last merged patch: row 4, column 6
