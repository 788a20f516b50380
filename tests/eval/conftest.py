"""Fixtures for the evaluation tests: images, a video, a OneVision checkpoint whose answers depend on
its media, and transformers' greedy answers to compare with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf_generate import HFReference


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> list[Path]:
    """Two PNG images of random noise (different sizes, so the processor resizes both)."""
    from megatron_ext.convert.compare import synthetic_image

    folder = tmp_path_factory.mktemp("eval_images")
    paths = [folder / "noise0.png", folder / "noise1.png"]
    synthetic_image(0).save(paths[0])
    synthetic_image(1, size=(90, 40)).save(paths[1])
    return paths


@pytest.fixture(scope="session")
def video_file(tmp_path_factory) -> Path:
    """An 8-frame lossless video of random noise, 64 x 48."""
    import av
    import numpy as np

    from megatron_ext.convert.compare import synthetic_image

    path = tmp_path_factory.mktemp("eval_video") / "clip.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("ffv1", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "bgr0"
        for i in range(8):
            frame = np.asarray(synthetic_image(20 + i, (64, 48)))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="session")
def onevision_small_features(tmp_path_factory, llava_onevision_siglip) -> Path:
    """The tiny OneVision with its projector's output scaled down: at full scale its image features
    swamp the tiny text model, which then answers every image alike."""
    import shutil

    from safetensors.torch import load_file, save_file

    onevision = tmp_path_factory.mktemp("onevision_small_features") / "hf"
    shutil.copytree(llava_onevision_siglip, onevision)
    weights = load_file(onevision / "model.safetensors")
    for name in ("multi_modal_projector.linear_2.weight", "multi_modal_projector.linear_2.bias", "image_newline"):
        weights[name] = weights[name] * 0.002
    save_file(weights, onevision / "model.safetensors", metadata={"format": "pt"})
    return onevision


@pytest.fixture(scope="session")
def hf_reference(llava_clip) -> HFReference:
    return HFReference(llava_clip)
