"""The task encoder for tiled LLaVAs (LLaVA-NeXT, OneVision): a sample's ids, tiles and image sizes
are what transformers' processor gives for the same rendered conversation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_ext.convert.compare import synthetic_image
from megatron_ext.data.chat_template import needs_special_tokens
from megatron_ext.data.shard_format import ConversationSample
from megatron_ext.data.task_encoder import LlavaTaskEncoder
from megatron_ext.data.video import VideoPreprocessor
from megatron_ext.families import read_llava
from megatron_ext.hf.processors import load_processor
from megatron_ext.model.tiling import IMAGE, VIDEO
from tests.reference import hf_processors

FIXTURES = ["llava_next_clip", "llava_onevision_siglip"]


def _encoder(hf_dir, **kwargs):
    kwargs.setdefault("seq_length", 2048)
    return LlavaTaskEncoder.for_model(str(hf_dir), read_llava(json.loads((hf_dir / "config.json").read_text())),
                                      **kwargs)


def _sample(question: str, images=(), videos=()) -> ConversationSample:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": "A red square."}]
    return ConversationSample(__key__="k", __restore_key__=(), images=list(images), messages=messages, videos=list(videos))


def _encode(encoder, sample):
    return encoder.postencode_sample(encoder.preencode_sample(sample))


def _hf(processor, encoder, sample, **media):
    text, _ = encoder.chat.render(sample.messages)
    tokenizer = encoder.chat.tokenizer
    return processor(text=text, return_tensors="pt", add_special_tokens=needs_special_tokens(tokenizer, text), **media)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_two_images_equal_the_hf_processor(request, fixture):
    hf_dir = request.getfixturevalue(fixture)
    encoder = _encoder(hf_dir)
    # A wide and a tall picture (500x300, 300x700 at the tiny tower's scale).
    wide, tall = synthetic_image(0, (83, 50)), synthetic_image(1, (50, 117))
    sample = _sample("<image>\n<image>\nWhat differs?", [wide, tall])
    encoded = _encode(encoder, sample)
    expected = _hf(load_processor(hf_dir, "--hf-dir"), encoder, sample, images=[[wide, tall]])

    assert torch.equal(encoded.input_ids, expected["input_ids"][0])
    assert [[m.height, m.width] for m in encoded.media] == expected["image_sizes"].tolist() == [[50, 83], [117, 50]]
    tiles = [m.tiles for m in encoded.media]
    # LLaVA-NeXT: a base tile and a 1x2 / 3x1 grid; OneVision: one tile each (two images in a sample).
    assert tiles == ([3, 4] if fixture == "llava_next_clip" else [1, 1])
    want = torch.cat([pixels[:n] for pixels, n in zip(expected["pixel_values"], tiles)])
    assert torch.equal(torch.stack(encoded.images), want)
    image = encoded.input_ids == encoder.layout.image_token_index
    assert not encoded.loss_mask[image].any() and encoded.loss_mask.sum() > 0


@pytest.mark.parametrize("fixture", ["llava_onevision_siglip", "onevision_own_video_settings"])
def test_a_video_equals_the_hf_processor(request, fixture):
    hf_dir = request.getfixturevalue(fixture)
    encoder = _encoder(hf_dir, video_frames=4)
    frames = [np.asarray(synthetic_image(10 + i, (60, 60))) for i in range(6)]
    sample = _sample("<video>\nWhat happens?", videos=[frames])
    encoded = _encode(encoder, sample)
    # Frames 0, 1, 3 and 5 of 6, first and last included.
    picked = np.stack([frames[i] for i in (0, 1, 3, 5)])
    processor = load_processor(hf_dir, "--hf-dir")
    expected = _hf(hf_processors.with_video(processor, hf_dir), encoder, sample, videos=[picked])

    assert torch.equal(encoded.input_ids, expected["input_ids"][0])
    assert encoded.media == [(VIDEO, 4, 0, 0)]
    assert torch.equal(torch.stack(encoded.images), expected["pixel_values_videos"][0])
    # The frames are the video processor's, not the image processor's (they differ in the second).
    as_images = VideoPreprocessor(processor.image_processor)(picked)
    assert torch.equal(as_images, expected["pixel_values_videos"][0]) == (fixture == "llava_onevision_siglip")
    video = encoded.input_ids == encoder.media.video_token
    # 4 x 2 x 2 pooled features (SigLIP 4x4 per tile) and a newline.
    assert int(video.sum()) == 17 and not encoded.loss_mask[video].any()


def test_images_and_a_video_in_token_order(llava_onevision_siglip):
    encoder = _encoder(llava_onevision_siglip, video_frames=2)
    frames = [np.full((60, 60, 3), i * 40, dtype=np.uint8) for i in range(3)]
    image = synthetic_image(3, (70, 60))
    encoded = _encode(encoder, _sample("<video>\nand <image>\nsame?", [image], [frames]))
    assert [m.kind for m in encoded.media] == [VIDEO, IMAGE]
    assert len(encoded.images) == 2 + encoded.media[1].tiles


def test_a_text_only_sample_has_no_tiles(llava_onevision_siglip):
    encoder = _encoder(llava_onevision_siglip)
    encoded = _encode(encoder, _sample("Say hi."))
    assert encoded.images == [] and encoded.media == []
    assert encoder.batch([encoded]).media_layout.shape == (0, 4)


def test_a_template_that_drops_markers_is_a_bad_sample(llava_onevision_siglip):
    """LLaVA's `plain` pre-training template renders one image and the answer: a sample with two
    images is refused (and skipped by the loader's error handler), never trained with one."""
    encoder = _encoder(llava_onevision_siglip, chat_template="plain")
    images = [synthetic_image(0, (83, 50)), synthetic_image(1, (50, 117))]
    with pytest.raises(ValueError, match="rendered 1 image and 0 video markers for 2 images and 0 videos"):
        encoder.preencode_sample(_sample("<image>\n<image>\nSame?", images))


def test_a_video_in_a_shard_reaches_the_model(tmp_path, llava_onevision_siglip):
    """The builder's parts of a LLaVA-Video record (its file's bytes as `video.mp4`), decoded as the
    loader decodes them: the video's frames, one layout row, one <video> run."""
    from megatron_ext.data.shard_format import ImageModeKeepingDecoder, conversation_fields
    from megatron_ext.data.sources import shard_sample
    from tests.data.test_video import _write

    _write(tmp_path / "clip.mp4", "mpeg4", "yuv420p")
    record = {"id": "v", "video": "clip.mp4", "conversations": [{"from": "human", "value": "<image>\nWhat happens?"},
                                                                  {"from": "gpt", "value": "It brightens."}]}
    parts = shard_sample("llava", tmp_path, (0, record)).parts
    assert parts["video.mp4"] == (tmp_path / "clip.mp4").read_bytes()
    # As stored in the tar: every part as bytes.
    stored = {name: value.encode() if isinstance(value, str) and name != "__key__" else value for name, value in parts.items()}
    decoded = ImageModeKeepingDecoder()._decoder.decode(stored)
    sample = ConversationSample(__key__="v", __restore_key__=(), **conversation_fields(decoded))
    encoded = _encode(_encoder(llava_onevision_siglip, video_frames=4), sample)
    assert encoded.media == [(VIDEO, 4, 0, 0)] and len(encoded.images) == 4


def test_media_past_the_sequence_length_make_a_bad_sample(llava_next_clip):
    """As for LLaVA-1.5: text is cut at the end, an image never; a sample whose image would not fit
    is refused (the loader's error handler skips and counts it)."""
    encoder = _encoder(llava_next_clip, seq_length=64)
    with pytest.raises(ValueError, match="an image does not fit in the sequence length 64"):
        encoder.preencode_sample(_sample("lorem " * 40 + "<image>", [synthetic_image(0, (83, 50))]))
    with pytest.raises(ValueError, match="5 tiles exceed --max-tiles-per-sequence 4"):
        _encoder(llava_next_clip, max_tiles=4).preencode_sample(_sample("<image>\nIt?", [synthetic_image(0, (83, 83))]))
