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
from tests.data.test_images import _photo
from tests.reference import hf_processors

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
    monkeypatch.setattr(video, "frame_count", lambda v: 2 * FRAMES)
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


# (settings, frame sizes (height, width), cpu capability): SigLIP's and CLIP's published settings,
# each resize filter (bilinear on the uint8 values with AVX2, in float32 without), rescale or
# normalize alone, and frames already at the size (no resize).
SETTINGS = {
    "siglip 384 bicubic": ({"size": {"height": 384, "width": 384}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, [(480, 640)], None),
    "clip 56 bicubic": ({"size": {"height": 56, "width": 56}}, [(60, 90), (24, 32), (56, 56)], None),
    "bilinear": ({"size": {"height": 40, "width": 72}, "resample": 2}, [(60, 90), (24, 32)], None),
    "bilinear without avx": ({"size": {"height": 40, "width": 72}, "resample": 2}, [(60, 90)], "DEFAULT"),
    "nearest": ({"size": {"height": 56, "width": 56}, "resample": 0}, [(60, 90)], None),
    "rescale only": ({"size": {"height": 56, "width": 56}, "do_normalize": False}, [(60, 90)], None),
    "normalize only": ({"size": {"height": 56, "width": 56}, "do_rescale": False}, [(60, 90)], None),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_frames_equal_transformers_video_processor(tmp_path, monkeypatch):
    """VideoPreprocessor gives LlavaOnevisionVideoProcessor's pixel_values_videos bit for bit
    (transformers with torchvision, in a child: tests/reference/torchvision_child)."""
    from tests.reference import torchvision_child

    videos = {name: [np.stack([np.asarray(_photo(w, h, seed=10 * i + j)) for j in range(3)]) for i, (h, w) in enumerate(sizes)]
              for name, (_, sizes, _) in SETTINGS.items()}
    # Every setting in one child: its start (torch, transformers, torchvision) is most of the time.
    results = torchvision_child.call_many(tmp_path, [("video_processor", {"settings": settings, "videos": videos[name],
                                                                     "cpu_capability": capability})
                                                for name, (settings, _, capability) in SETTINGS.items()])
    for (name, (settings, _, capability)), result in zip(SETTINGS.items(), results, strict=True):
        expected = result["pixel_values_videos"]
        with monkeypatch.context() as patch:
            if capability is not None:
                patch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
            preprocess = VideoPreprocessor(hf_processors.FrameVideoProcessor(**settings))
        for frames, want in zip(videos[name], expected, strict=True):
            got = preprocess(frames)
            assert got.dtype == torch.float32 and got.shape == want.shape and got.is_contiguous(), name
            assert torch.equal(got, want), name


def test_a_resize_filter_transformers_maps_elsewhere_is_one_line():
    with pytest.raises(UserError, match="^the video processor's resample filter LANCZOS is not supported for videos; set"):
        VideoPreprocessor(hf_processors.FrameVideoProcessor(resample=Image.Resampling.LANCZOS))


def test_video_count_equals_the_hf_processor(tmp_path):
    processor = hf_processors.onevision(LlavaOnevisionImageProcessorPil(), num_image_tokens=729)
    frames = read_frames(_write(tmp_path / "v.mov", "png", "rgb24"), 4)
    expected = processor(videos=[frames], text=["<video> What happens?"], return_tensors="pt")
    assert expected["pixel_values_videos"].shape == (1, 4, 3, 384, 384)
    # 27 x 27 SigLIP features per frame pooled to 14 x 14, then one newline.
    assert FeatureLayout.of(processor).video_features(4) == 4 * 14 * 14 + 1 == hf_processors.count(expected["input_ids"], "<video>")
