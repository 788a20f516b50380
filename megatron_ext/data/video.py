"""Videos for LLaVA-OneVision: N frames sampled uniformly, each preprocessed as OneVision's video
processor does with the settings the checkpoint saves (`load_frame_settings`).

Sampling (`--video-frames N`): frame indices `np.linspace(0, total - 1, N, dtype=int)`, first and
last frame included, the rule of lmms-eval's LLaVA-OneVision / llava_hf video loaders and of
LLaVA-NeXT's training code with `frames_upbound` N and `force_sample` (without it, that code
takes one frame a second when that gives at most N). transformers' own `default_sample_indices_fn`
(`arange(N) * total // N`) differs: it stops short of the last frame unless N = total. A video
with fewer than N frames gives all its frames, as lmms-eval's PyAV loader does.
"""

from __future__ import annotations

import io
import platform
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from megatron_ext.data.images import rgb
from megatron_ext.data.pixels import FusedNormalize
from megatron_ext.errors import UserError


def uniform_indices(total: int, frames: int) -> list[int]:
    """Indices of `frames` frames spread evenly over `total`, first and last included."""
    return np.linspace(0, total - 1, min(frames, total), dtype=int).tolist()


def read_frames(video, frames: int, name: str | None = None) -> np.ndarray:
    """uint8 RGB frames [n, H, W, 3] sampled uniformly from `video`: a file path, the file's bytes,
    or a list of frame images (PIL or uint8 [H, W, 3] arrays). `name` names the video in errors."""
    if isinstance(video, (list, tuple)):
        return np.stack([np.asarray(rgb(f)) if isinstance(f, Image.Image) else np.asarray(f)
                         for f in (video[i] for i in uniform_indices(len(video), frames))])
    name = name or (str(video) if isinstance(video, (str, Path)) else "video bytes")
    import av

    try:
        total = frame_count(video)
        picked, decoded = _decode(video, uniform_indices(total, frames))
        if len(picked) < min(frames, total):
            # The header counted more frames than the stream holds: sample the frames it has.
            picked, _ = _decode(video, uniform_indices(decoded, frames))
    except FileNotFoundError as exc:
        raise UserError(f"{name}: no such video file; check the path") from exc
    except (av.FFmpegError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        raise UserError(f"{name}: cannot decode the video ({reason}); re-encode it (e.g. ffmpeg -i IN OUT.mp4) or drop the sample") from exc
    return np.stack(picked)


def sampled_frame_times(video, frames: int) -> list[float] | None:
    """Seconds into `video` (a file path or its bytes) of the frames `read_frames` samples; None
    for a list of frames or a stream without a frame rate."""
    if isinstance(video, (list, tuple)):
        return None
    rate = frame_rate(video)
    if not rate:
        return None
    return [index / rate for index in uniform_indices(frame_count(video), frames)]


def frame_rate(video) -> float | None:
    """Frames per second of the first video stream (a file path or its bytes); None when it states none."""
    with _open(video) as container:
        rate = container.streams.video[0].average_rate
    return float(rate) if rate else None


def _open(video):
    import av

    return av.open(io.BytesIO(video) if isinstance(video, bytes) else str(video))


def frame_count(video) -> int:
    """Frames of the first video stream: the header's count, else its packets (not every container
    stores a count)."""
    with _open(video) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        total = container.streams.video[0].frames or sum(1 for p in container.demux(video=0) if p.size)
    if total == 0:
        raise ValueError("no frames")
    return total


def _decode(video, indices: list[int]) -> tuple[list[np.ndarray], int]:
    """(the frames at `indices` as uint8 RGB arrays, frames decoded)."""
    wanted, picked, decoded = set(indices), [], 0
    with _open(video) as container:
        for decoded, frame in enumerate(container.decode(video=0), start=1):
            if decoded - 1 in wanted:
                picked.append(frame.to_ndarray(format="rgb24"))
            if decoded > indices[-1]:
                break
    return picked, decoded


def load_frame_settings(source: str | Path, flag: str, image_processor):
    """What a video's frames are preprocessed with (size, resample, rescale, normalize): the video
    processor `source` saves, found as transformers finds it (processor_config.json's
    `video_processor`, else video_preprocessor_config.json, else preprocessor_config.json) and
    built by its class; `image_processor`, the one `source` saves, where it saves no video
    processor (a directory transformers itself could not load one from)."""
    from transformers.video_processing_utils import BaseVideoProcessor

    from megatron_ext.families import llava_kinds

    try:
        saved, _ = BaseVideoProcessor.get_video_processor_dict(str(source))
    except OSError:
        saved = {}
    name = saved.get("video_processor_type")
    if name is None:
        return image_processor
    classes = {kind.video_processor_class: kind for kind in llava_kinds().values() if kind.video}
    if name not in classes:
        raise UserError(f"{flag} {source}: its video processor {name} is not supported (supported: {', '.join(classes)})")
    return classes[name].video_processor_type().from_dict(saved)


class VideoPreprocessor:
    """Callable: uint8 frames [n, H, W, 3] -> float32 pixel_values [n, 3, height, width], bit for
    bit what LlavaOnevisionVideoProcessor (transformers 5.x, on CPU) computes: each frame resized to
    `size` (height, width; aspect ratio not kept) by torch's interpolate on the uint8 frames, with
    antialiasing, as torchvision's `resize` calls it, then rescaled and normalized in one float32
    step (`FusedNormalize`). torchvision itself is not needed (the project does not install it).
    `processor` is the video processor, or the image processor: both carry these settings.
    """

    def __init__(self, processor):
        self.size = (int(processor.size.height), int(processor.size.width))
        self.resize = frame_resize(processor.resample)
        self.normalize = FusedNormalize(processor)

    def __call__(self, frames: np.ndarray) -> torch.Tensor:
        # A channels-last view: interpolate gives the values of HF's contiguous copy, without the copy.
        frames = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        if tuple(frames.shape[-2:]) != self.size:
            frames = self.resize(frames, self.size)
        return self.normalize(frames)


def frame_resize(resample):
    """torchvision's `resize` of a uint8 [n, 3, H, W] tensor on CPU for a PIL resample filter (HF
    maps the filter to torchvision's mode): bilinear and bicubic with antialiasing, on the uint8
    values where torchvision does so (bicubic always, bilinear with AVX2/AVX512 or on ARM), else in
    float32, rounded back to uint8."""
    import torch.nn.functional as F

    resample = int(resample) if resample is not None else int(Image.Resampling.BILINEAR)
    if resample == Image.Resampling.NEAREST:
        return lambda frames, size: F.interpolate(frames, size=size, mode="nearest-exact")
    modes = {int(Image.Resampling.BILINEAR): "bilinear", int(Image.Resampling.BICUBIC): "bicubic"}
    if resample not in modes:
        raise UserError(f"the video processor's resample filter {Image.Resampling(resample).name} is not supported for "
                        "videos; set \"resample\" to 2 (bilinear) or 3 (bicubic) in the checkpoint's processor_config.json")
    mode = modes[resample]
    native = (mode == "bicubic" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
              or platform.machine() in ("aarch64", "arm64"))

    def resize(frames: torch.Tensor, size) -> torch.Tensor:
        if native:
            return F.interpolate(frames, size=size, mode=mode, align_corners=False, antialias=True)
        resized = F.interpolate(frames.float(), size=size, mode=mode, align_corners=False, antialias=True)
        return resized.round_().to(torch.uint8)

    return resize
