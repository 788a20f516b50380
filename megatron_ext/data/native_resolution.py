"""Native-resolution vision inputs for Qwen2.5-VL and Qwen3-VL: what transformers' processors and
`get_rope_index` (transformers 5.24) give, computed per sample on the host.

- Images: transformers' own `Qwen2VLImageProcessorPil` (no torchvision needed) with the family's
  settings: smart resize to a multiple of patch x merge within [min_pixels, max_pixels], rows in
  merge-block order, each row (C, t=2, p, p) flattened; `image_grid_thw` = (1, H/p, W/p).
- Videos: transformers' video processors need torchvision, so the steps are ours, with their values:
  frames resized as torchvision resizes uint8 tensors (`video.frame_resize`), rescaled and
  normalized as a torchvision-backend processor does (`FusedNormalize`), padded to an even count
  by repeating the last frame. Qwen2.5-VL adds `second_per_grid_ts`; Qwen3-VL carries time as text
  (a `<t seconds>` before each frame pair). Frame sampling is the project's (`video.read_frames`).
- Text: each `<|image_pad|>` / `<|video_pad|>` expanded to the merged patch count.
- mRoPE positions `[3, S]` (T, H, W) of one sample, from 0, so a pack of samples keeps each one's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

from megatron_ext.errors import UserError

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class QwenVision:
    """One family's vision input settings. Pixel bounds, mean and std are transformers' class
    defaults; a checkpoint's saved processor replaces them (`with_saved_settings`)."""

    name: str
    patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    min_pixels: int
    max_pixels: int
    video_min_pixels: int
    video_max_pixels: int
    # Qwen2.5-VL: video T advances tokens_per_second x second_per_grid_ts per frame pair (the
    # model config's vision_config.tokens_per_second). Qwen3-VL (None): each frame pair is a grid of
    # its own, with its timestamp as text.
    tokens_per_second: int | None
    video_processor_type: str  # transformers' class for its videos, named in a video processor file we write
    merge_size: int = 2
    temporal_patch_size: int = 2

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


QWEN2_5_VL = QwenVision("Qwen2.5-VL", 14, CLIP_MEAN, CLIP_STD, 56 * 56, 28 * 28 * 1280,
                        128 * 28 * 28, 28 * 28 * 768, tokens_per_second=4, video_processor_type="Qwen2VLVideoProcessor")
QWEN3_VL = QwenVision("Qwen3-VL", 16, (0.5,) * 3, (0.5,) * 3, 56 * 56, 28 * 28 * 1280,
                      128 * 32 * 32, 32 * 32 * 768, tokens_per_second=None, video_processor_type="Qwen3VLVideoProcessor")


def with_pixel_bounds(vision: QwenVision, min_pixels: int | None, max_pixels: int | None) -> QwenVision:
    """`vision` with a run's --min-pixels / --max-pixels (None: its own) as its images' bounds. Its
    videos' bounds are capped at --max-pixels, so that the largest image bounds every tower input
    (the memory plan counts it)."""
    area = vision.factor**2
    for flag, value in (("--min-pixels", min_pixels), ("--max-pixels", max_pixels)):
        if value is not None and value < area:
            raise UserError(f"{flag} {value} is below {vision.name}'s patch x merge area {area} ({vision.factor} x "
                            f"{vision.factor} pixels, one merged token); give at least {area}")
    low = vision.min_pixels if min_pixels is None else min_pixels
    high = vision.max_pixels if max_pixels is None else max_pixels
    if low > high:
        raise UserError(f"--min-pixels {low} is above --max-pixels {high} (where one is not given: the "
                        f"checkpoint's processor's, else {vision.name}'s default); give a --min-pixels at most the --max-pixels")
    # Capped only by the flag: without it, videos keep the bounds their processor gives them.
    video_high = vision.video_max_pixels if max_pixels is None else min(vision.video_max_pixels, high)
    return replace(vision, min_pixels=low, max_pixels=high, video_max_pixels=video_high,
                   video_min_pixels=min(vision.video_min_pixels, video_high))


def with_saved_settings(vision: QwenVision, processor_dir: str | Path | None) -> QwenVision:
    """`vision` with what a checkpoint's processor files save, read as transformers reads them when
    it loads the processor from that directory: the image processor's bounds, mean and std, and the
    video processor's bounds (found as transformers finds it, falling back to
    preprocessor_config.json). A published checkpoint's bounds are not the class defaults (Qwen2.5-VL
    saves 12,845,056 max pixels, the class has 1,003,520). Files absent: `vision` as it is."""
    if processor_dir is None:
        return vision
    _check_processor_files(Path(processor_dir))
    from transformers.image_processing_utils import ImageProcessingMixin
    from transformers.video_processing_utils import BaseVideoProcessor

    image = _saved(ImageProcessingMixin.get_image_processor_dict, processor_dir)
    video = _saved(BaseVideoProcessor.get_video_processor_dict, processor_dir)
    low, high = _saved_bounds(image, vision.min_pixels, vision.max_pixels)
    video_low, video_high = _saved_bounds(video, vision.video_min_pixels, vision.video_max_pixels)
    return replace(vision, min_pixels=low, max_pixels=high, video_min_pixels=video_low, video_max_pixels=video_high,
                   image_mean=tuple(image.get("image_mean", vision.image_mean)),
                   image_std=tuple(image.get("image_std", vision.image_std)))


_PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")


def save_pixel_bounds(vision: QwenVision, directory: Path) -> None:
    """Write `vision`'s image and video bounds, mean and std where transformers (and
    `with_saved_settings`) read them in `directory`: into the processor files there, and as
    preprocessor_config.json / video_preprocessor_config.json (`vision`'s whole settings) where it
    would find none. An HF export of a run trained with --min/--max-pixels then resizes as the run did."""
    nested_file, image_file, video_file = (directory / name for name in _PROCESSOR_FILES)
    normalized = {"image_mean": list(vision.image_mean), "image_std": list(vision.image_std)}
    bounds = {"image_processor": {**_bounds(vision.min_pixels, vision.max_pixels), **normalized},
              "video_processor": {**_bounds(vision.video_min_pixels, vision.video_max_pixels), **normalized}}
    nested = json.loads(nested_file.read_text()) if nested_file.is_file() else {}
    for key in bounds.keys() & nested.keys():
        nested[key].update(bounds[key])
    if nested:
        nested_file.write_text(json.dumps(nested, indent=2))
    settings = image_processor(vision).to_dict()
    video_settings = {**{k: v for k, v in settings.items() if k != "image_processor_type"},
                      "video_processor_type": vision.video_processor_type}
    for path, key, whole in ((image_file, "image_processor", settings), (video_file, "video_processor", video_settings)):
        if path.is_file():
            path.write_text(json.dumps({**json.loads(path.read_text()), **bounds[key]}, indent=2))
        elif key not in nested:
            path.write_text(json.dumps({**whole, **bounds[key]}, indent=2))


def _bounds(low: int, high: int) -> dict:
    """A Qwen-VL processor's bounds as transformers 5 saves them (size) and as earlier releases and
    the published files do (min_pixels / max_pixels, which override size where both are read)."""
    return {"min_pixels": low, "max_pixels": high, "size": {"shortest_edge": low, "longest_edge": high}}


def _check_processor_files(processor_dir: Path) -> None:
    """transformers' readers take a file that is not JSON for a missing one (both OSError): the
    defaults would then be used silently."""
    for path in (processor_dir / name for name in _PROCESSOR_FILES):
        if not path.is_file():
            continue
        try:
            json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise UserError(f"{path} is not valid JSON ({exc}); fix it or copy it again from the model's "
                            "published files") from None


def _saved(reader, processor_dir: str | Path) -> dict:
    try:
        return reader(str(processor_dir))[0]
    except OSError:  # no such file (`_check_processor_files` has refused a broken one)
        return {}


def _saved_bounds(saved: dict, low: int, high: int) -> tuple[int, int]:
    """(min, max) pixels of a saved processor: min_pixels / max_pixels where saved (its __init__ lets
    them override size), else size's shortest / longest edge, else the given ones."""
    size = saved.get("size") or {}
    return (saved.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or low,
            saved.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or high)


# ---------------------------------------------------------------- images

def image_processor(vision: QwenVision):
    """transformers' PIL-backend Qwen-VL image processor with `vision`'s settings."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=vision.patch_size, merge_size=vision.merge_size,
                                    temporal_patch_size=vision.temporal_patch_size, image_mean=list(vision.image_mean),
                                    image_std=list(vision.image_std), min_pixels=vision.min_pixels,
                                    max_pixels=vision.max_pixels)


def resized_size(vision: QwenVision, height: int, width: int, frames: int | None = None) -> tuple[int, int]:
    """(height, width) smart resize gives an image (`frames` None) or a video of `frames` frames."""
    if max(height, width) > 200 * min(height, width):
        what = "image" if frames is None else "video"
        raise UserError(f"{what} {width}x{height}: aspect ratio {max(height, width) / min(height, width):.0f} is above "
                        f"200, which {vision.name}'s smart resize refuses; crop or pad it to at most 200:1")
    if frames is not None and vision.tokens_per_second is None and frames < vision.temporal_patch_size:
        raise UserError(f"a video of {frames} frame: {vision.name} takes videos of at least {vision.temporal_patch_size} "
                        "frames; sample more frames or give it as an image")
    if frames is None:
        return _image_smart_resize(height, width, vision.factor, vision.min_pixels, vision.max_pixels)
    if vision.tokens_per_second is None:  # Qwen3-VL's video resize counts the frames in the pixel bounds
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        return smart_resize(frames, height, width, vision.temporal_patch_size, vision.factor,
                            vision.video_min_pixels, vision.video_max_pixels)
    return _image_smart_resize(height, width, vision.factor, vision.video_min_pixels, vision.video_max_pixels)


def _image_smart_resize(height, width, factor, min_pixels, max_pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    return smart_resize(height, width, factor, min_pixels, max_pixels)


def image_inputs(images: list[Image.Image], vision: QwenVision, processor=None) -> dict[str, torch.Tensor]:
    """{"pixel_values": float32 [patches, C*t*p*p], "image_grid_thw": int64 [images, 3]}, as the
    transformers processor gives (`processor`: `image_processor(vision)`, built once by the caller)."""
    for image in images:
        resized_size(vision, image.height, image.width)  # its refusal as one line
    processor = processor or image_processor(vision)
    batch = processor(images=images, return_tensors="pt")
    return {"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"]}


# ---------------------------------------------------------------- videos

@dataclass(frozen=True)
class VideoClip:
    """Sampled frames, uint8 [n, H, W, 3], and where they come from, as transformers' VideoMetadata
    says it: the source's frame rate, its frame count and the indices of the frames taken."""

    frames: np.ndarray
    fps: float
    indices: tuple[int, ...]
    total: int

    @property
    def sampled_fps(self) -> float:
        return len(self.indices) / self.total * self.fps

    def frame_pair_seconds(self, temporal_patch_size: int) -> list[float]:
        """Each temporal patch's time: the mean of its first and last frame's (Qwen3-VL's timestamps)."""
        seconds = [i / self.fps for i in self.indices]
        seconds += seconds[-1:] * (-len(seconds) % temporal_patch_size)
        return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2 for i in range(0, len(seconds), temporal_patch_size)]


def read_clip(video, frames: int, name: str | None = None) -> VideoClip:
    """`frames` frames sampled uniformly from `video` (a path or its bytes), decoded with PyAV, timed
    by the stream's frame rate and frame count (where a header counts more frames than the stream
    holds, `read_frames` samples the frames it has, and these times are off)."""
    from megatron_ext.data.video import frame_count, frame_rate, read_frames, uniform_indices

    picked = read_frames(video, frames, name)
    total = frame_count(video)
    rate = frame_rate(video)
    if not rate:
        raise UserError(f"{name or video}: the video states no frame rate, which Qwen-VL's frame timing needs; "
                        "re-encode it with one (e.g. ffmpeg -i IN -r 30 OUT.mp4)")
    return VideoClip(picked, rate, tuple(uniform_indices(total, frames)[:len(picked)]), total)


def video_inputs(clip: VideoClip, vision: QwenVision) -> dict[str, torch.Tensor]:
    """{"pixel_values_videos": float32 [patches, C*t*p*p], "video_grid_thw": int64 [1, 3]} of one
    clip, plus "second_per_grid_ts" (float32 [1]) for Qwen2.5-VL, as its video processor gives."""
    from megatron_ext.data.pixels import FusedNormalize
    from megatron_ext.data.video import frame_resize

    frames = torch.from_numpy(np.ascontiguousarray(clip.frames)).permute(0, 3, 1, 2)
    size = resized_size(vision, *frames.shape[-2:], frames=len(frames))
    if tuple(frames.shape[-2:]) != size:
        frames = frame_resize(Image.Resampling.BICUBIC)(frames, size)
    settings = SimpleNamespace(do_normalize=True, do_rescale=True, rescale_factor=1 / 255,
                               image_mean=vision.image_mean, image_std=vision.image_std)
    rows, grid = patch_rows(FusedNormalize(settings)(frames), vision)
    out = {"pixel_values_videos": rows, "video_grid_thw": torch.tensor([grid])}
    if vision.tokens_per_second is not None:
        out["second_per_grid_ts"] = torch.tensor([vision.temporal_patch_size / clip.sampled_fps])
    return out


def patch_rows(frames: torch.Tensor, vision: QwenVision) -> tuple[torch.Tensor, list[int]]:
    """float frames [n, C, H, W] -> (rows [t*h*w, C*t_p*p*p] in merge-block order, [t, h, w]):
    frame pairs, then merge blocks in raster order, then the patches inside a block."""
    if pad := -len(frames) % vision.temporal_patch_size:  # the last frame repeated
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    n, channels, height, width = frames.shape
    p, m, tp = vision.patch_size, vision.merge_size, vision.temporal_patch_size
    t, h, w = n // tp, height // p, width // p
    blocks = frames.reshape(t, tp, channels, h // m, m, p, w // m, m, p)
    # -> (t, block row, block col, row in block, col in block, C, frame in pair, p, p)
    blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return blocks.reshape(t * h * w, channels * tp * p * p), [t, h, w]


# ---------------------------------------------------------------- text

def expand_placeholders(text: str, vision: QwenVision, image_grid_thw=(), video_grid_thw=(),
                        video_seconds: list[list[float]] | None = None) -> str:
    """`text` with its i-th `<|image_pad|>` repeated t*h*w/merge² times for image i, and likewise
    each `<|video_pad|>`; for Qwen3-VL each video frame pair becomes `<s.s seconds>`, vision start,
    its pads and vision end (`video_seconds`: each video's `VideoClip.frame_pair_seconds`)."""
    grids = {IMAGE_TOKEN: iter(_rows(image_grid_thw)), VIDEO_TOKEN: iter(_rows(video_grid_thw))}
    seconds = iter(video_seconds or [])
    counts = {token: text.count(token) for token in grids}
    for token, given in ((IMAGE_TOKEN, len(_rows(image_grid_thw))), (VIDEO_TOKEN, len(_rows(video_grid_thw)))):
        if counts[token] != given:
            raise UserError(f"the text has {counts[token]} {token} but {given} grids were given; "
                            f"put one {token} where each image or video goes")
    if vision.tokens_per_second is None and counts[VIDEO_TOKEN] and len(video_seconds or []) != counts[VIDEO_TOKEN]:
        raise UserError(f"{vision.name} writes each video frame's time in the text: give video_seconds for every video")

    def expand(match) -> str:
        t, h, w = next(grids[match.group()])
        frame_tokens = h * w // vision.merge_size**2
        if match.group() == IMAGE_TOKEN or vision.tokens_per_second is not None:
            return match.group() * (t * frame_tokens)
        return frame_pair_runs(next(seconds), VIDEO_TOKEN * frame_tokens)

    return re.sub(f"{re.escape(IMAGE_TOKEN)}|{re.escape(VIDEO_TOKEN)}", expand, text)


def frame_pair_runs(seconds: list[float], pads: str) -> str:
    """What Qwen3-VL's processor writes for one video's `<|video_pad|>`: each frame pair's time
    (`seconds`, `VideoClip.frame_pair_seconds`) as `frame_pair_stamp`, then `pads` between vision start and end."""
    return "".join(f"{frame_pair_stamp(s)}{VISION_START}{pads}{VISION_END}" for s in seconds)


def frame_pair_stamp(seconds: float) -> str:
    """A Qwen3-VL frame pair's time as its processor writes it before the pair: `<s.s seconds>`."""
    return f"<{seconds:.1f} seconds>"


def token_types(input_ids, image_token_id: int, video_token_id: int) -> np.ndarray:
    """transformers' mm_token_type_ids of one sample: 0 text, 1 image, 2 video."""
    ids = np.asarray(input_ids)
    return np.where(ids == image_token_id, IMAGE, np.where(ids == video_token_id, VIDEO, TEXT))


# ---------------------------------------------------------------- mRoPE positions

def mrope_positions(types, vision: QwenVision, image_grid_thw=(), video_grid_thw=(),
                    second_per_grid_ts=None) -> torch.Tensor:
    """int64 [3, S] (T, H, W) positions of one sample from its token types (`token_types`), equal
    to transformers' `get_rope_index`. Text runs count on from the position after the last run on
    all three rows. A vision run of grid (t, h, w) merged to (t, h/m, w/m) gets T = start +
    floor(frame pair x interval), H = start + row, W = start + col; the next run starts at
    start + max(h, w)/m. The interval is 1, but tokens_per_second x second_per_grid_ts for a
    Qwen2.5-VL video; Qwen3-VL takes each frame pair of a video as a grid of its own."""
    types = np.asarray(types)
    grids = {IMAGE: iter(_rows(image_grid_thw)), VIDEO: iter(video_run_grids(video_grid_thw, vision))}
    seconds = iter(torch.as_tensor(second_per_grid_ts, dtype=torch.float32) if second_per_grid_ts is not None else [])
    pieces, start = [], 0
    for kind, length in _runs(types):
        if kind == TEXT:
            pieces.append(torch.arange(start, start + length).expand(3, -1))
            start += length
            continue
        t, h, w = _next_grid(grids[kind], kind)
        h, w = h // vision.merge_size, w // vision.merge_size
        if t * h * w != length:
            raise UserError(f"a run of {length} {'image' if kind == IMAGE else 'video'} tokens does not match its grid "
                            f"({t * h * w} merged patches); expand the placeholders with expand_placeholders")
        interval = 1
        if kind == VIDEO and vision.tokens_per_second is not None:
            # float32 as the model gets second_per_grid_ts from the processor; T floors after scaling
            interval = vision.tokens_per_second * next(seconds, 1)
        frame_t = (torch.arange(t) * interval).long() + start
        grid = torch.stack(torch.meshgrid(frame_t, torch.arange(h) + start, torch.arange(w) + start, indexing="ij"))
        pieces.append(grid.reshape(3, -1))
        start += max(h, w)
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)


def pack_positions(samples: list[torch.Tensor], padded_lengths: list[int] | None = None) -> torch.Tensor:
    """One THD row's [3, total] positions: each sample's own (each from 0), zeros in the padding
    up to its padded length (padded cu_seqlens)."""
    padded_lengths = padded_lengths or [s.shape[1] for s in samples]
    rows = [torch.nn.functional.pad(s, (0, padded - s.shape[1])) for s, padded in zip(samples, padded_lengths, strict=True)]
    return torch.cat(rows, dim=1)


def _rows(grid_thw) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in row) for row in (grid_thw.tolist() if hasattr(grid_thw, "tolist") else grid_thw)]


def video_run_grids(video_grid_thw, vision: QwenVision) -> list[tuple[int, int, int]]:
    """The grid of each run of video tokens: a video's, or (Qwen3-VL) each of its frame pairs'."""
    grids = _rows(video_grid_thw)
    if vision.tokens_per_second is None:
        return [(1, h, w) for t, h, w in grids for _ in range(t)]
    return grids


def _next_grid(grids, kind: int):
    grid = next(grids, None)
    if grid is None:
        raise UserError(f"the tokens hold more {'image' if kind == IMAGE else 'video'} runs than grids were given; "
                        "give one grid per image and video, in text order")
    return grid


def _runs(types: np.ndarray) -> list[tuple[int, int]]:
    """(type, length) of each run of equal token types."""
    if types.size == 0:
        return []
    starts = np.flatnonzero(np.diff(types)) + 1
    bounds = np.concatenate([[0], starts, [types.size]])
    return [(int(types[a]), int(b - a)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
