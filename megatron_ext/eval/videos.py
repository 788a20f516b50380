"""Videos in prompts (LLaVA-OneVision): a file decoded to N frames sampled uniformly
(`data.video.read_frames`); the checkpoint's processor (`hf.processors.load_processor`) computes
their pixel values as training does and expands every `<video>`.
"""

from __future__ import annotations

from pathlib import Path


def load_video(video, frames: int, flag: str = "--video"):
    """uint8 RGB frames [n, H, W, 3], `frames` of them sampled uniformly from `video` (a file, or
    a list of frame images as `read_frames` takes), or a one-line UserError naming it."""
    from megatron_ext.data.video import read_frames

    if isinstance(video, (str, Path)):
        return read_frames(Path(video).expanduser(), frames, name=f"{flag} {video}")
    return read_frames(video, frames, name=flag)
