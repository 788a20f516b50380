"""Videos: uniform frame sampling with PyAV, OneVision's frame preprocessing and <video> count."""

from __future__ import annotations

import av
import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

from megatron_ext.data import video
from megatron_ext.data.anyres import FeatureLayout
from megatron_ext.data.video import VideoPreprocessor, read_frames, uniform_indices
from megatron_ext.errors import UserError
from tests.data import hf_processors
from tests.data.test_images import _photo

FRAMES = 10


def _write(path, codec: str, pix_fmt: str, frames=FRAMES):
    """A 32 x 24 video whose frame i is a flat grey of 20 i + 10 and carries a white dot at column i."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 24, pix_fmt
        for i in range(frames):
            pixels = np.full((24, 32, 3), 20 * i + 10, np.uint8)
            pixels[0, i] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def _indices(frames: np.ndarray) -> list[int]:
    return [round((float(f[1:].mean()) - 10) / 20) for f in frames]


def test_uniform_indices_are_lmms_evals():
    assert uniform_indices(10, 4) == [0, 3, 6, 9] == np.linspace(0, 9, 4, dtype=int).tolist()
    assert uniform_indices(100, 8) == [0, 14, 28, 42, 56, 70, 84, 99]
    assert uniform_indices(3, 8) == [0, 1, 2]
    assert uniform_indices(1, 4) == [0]


# mov/png and mkv/ffv1 are lossless (frames come back exact); mkv stores no frame count (counted
# from its packets); mp4/mpeg4 is lossy.
@pytest.mark.parametrize("name,codec,pix_fmt", [("v.mov", "png", "rgb24"), ("v.mkv", "ffv1", "bgr0"),
                                                ("v.mp4", "mpeg4", "yuv420p")])
def test_frames_sampled_uniformly(tmp_path, name, codec, pix_fmt):
    path = _write(tmp_path / name, codec, pix_fmt)
    frames = read_frames(path, 4)
    assert frames.dtype == np.uint8 and frames.shape == (4, 24, 32, 3)
    assert _indices(frames) == [0, 3, 6, 9]
    if codec != "mpeg4":
        assert [int(np.argmax(f[0, :, 0])) for f in frames] == [0, 3, 6, 9]
    assert np.array_equal(read_frames(path.read_bytes(), 4), frames)
    assert _indices(read_frames(path, 20)) == list(range(FRAMES))


def test_a_header_counting_too_many_frames(tmp_path, monkeypatch):
    path = _write(tmp_path / "v.mov", "png", "rgb24")
    monkeypatch.setattr(video, "_frame_count", lambda v: 2 * FRAMES)
    assert _indices(read_frames(path, 4)) == [0, 3, 6, 9]


def test_a_list_of_frame_images():
    images = [Image.new("RGB", (8, 6), (i, 0, 0)) for i in range(FRAMES)] + [Image.new("L", (8, 6), 200)]
    frames = read_frames(images, 3)
    assert frames.shape == (3, 6, 8, 3)
    assert frames[:, 0, 0].tolist() == [[0, 0, 0], [5, 0, 0], [200, 200, 200]]


@pytest.mark.parametrize("content", [b"", b"not a video at all" * 50])
def test_undecodable_video_is_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "clip.mp4"
    path.write_bytes(content)
    with pytest.raises(UserError) as error:
        read_frames(path, 4)
    message = str(error.value)
    assert message.startswith(f"{path}: cannot decode the video (") and "\n" not in message
    with pytest.raises(UserError, match="^shard 3/clip.mp4: cannot decode"):
        read_frames(content, 4, name="shard 3/clip.mp4")


def test_missing_video_file(tmp_path):
    with pytest.raises(UserError, match=f"^{tmp_path / 'absent.mp4'}: no such video file; check the path$"):
        read_frames(tmp_path / "absent.mp4", 4)


def test_frames_equal_onevisions_base_tile():
    """A frame's pixel_values are the base tile OneVision's PIL image processor makes of it as an image."""
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": 56, "width": 56},
                                                      image_grid_pinpoints=[[56, 112], [112, 56], [112, 112]])
    frames = np.stack([np.asarray(_photo(90, 60, seed=i)) for i in range(3)])
    got = VideoPreprocessor(hf_processors.PilVideoProcessor(size={"height": 56, "width": 56}))(frames)
    assert got.dtype == torch.float32 and got.shape == (3, 3, 56, 56)
    for frame, pixel_values in zip(frames, got):
        base_tile = image_processor(images=[Image.fromarray(frame)], return_tensors="pt")["pixel_values"][0, 0]
        assert torch.equal(pixel_values, base_tile)


def test_video_count_equals_the_hf_processor(tmp_path):
    processor = hf_processors.onevision(LlavaOnevisionImageProcessorPil(), num_image_tokens=729)
    frames = read_frames(_write(tmp_path / "v.mov", "png", "rgb24"), 4)
    expected = processor(videos=[frames], text=["<video> What happens?"], return_tensors="pt")
    assert expected["pixel_values_videos"].shape == (1, 4, 3, 384, 384)
    # 27 x 27 SigLIP features per frame pooled to 14 x 14, then one newline.
    assert FeatureLayout.of(processor).video_features(4) == 4 * 14 * 14 + 1 == hf_processors.count(expected["input_ids"], "<video>")
