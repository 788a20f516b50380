"""Videos in prompts (LLaVA-OneVision): a file decoded to N frames sampled uniformly
(`data.video.read_frames`), their pixel values computed as training computes them
(`data.video.VideoPreprocessor`), each `<video>` expanded by the checkpoint's own HF processor.

transformers' video processors need torchvision, which this project does not install; so the
processor gets `FrameProcessor` in their place (the same pixel values, bit for bit, on CPU) and
still expands every `<video>` itself (its `replace_video_token`).
"""

from __future__ import annotations

import copy
from pathlib import Path


def load_video(video, frames: int, flag: str = "--video"):
    """uint8 RGB frames [n, H, W, 3], `frames` of them sampled uniformly from `video` (a file, or
    a list of frame images as `read_frames` takes), or a one-line UserError naming it."""
    from megatron_ext.data.video import read_frames

    if isinstance(video, (str, Path)):
        return read_frames(Path(video).expanduser(), frames, name=f"{flag} {video}")
    return read_frames(video, frames, name=flag)


class FrameProcessor:
    """The processor's video processor, as training computes frames."""

    def __init__(self, image_processor):
        from megatron_ext.data.video import VideoPreprocessor

        self.preprocess = VideoPreprocessor(image_processor)

    def __call__(self, videos, **unused) -> dict:
        return {"pixel_values_videos": [self.preprocess(frames) for frames in videos]}


def with_frame_processor(processor):
    """A copy of `processor` whose videos go through `FrameProcessor`; `processor` itself when its
    model takes no videos (no video token)."""
    if getattr(processor, "video_token", None) is None:
        return processor
    processor = copy.copy(processor)
    processor.video_processor = FrameProcessor(processor.image_processor)
    return processor
