"""A tiled LLaVA's (LLaVA-NeXT, OneVision) images and videos in a sample: their tokens expanded
and their tiles, as the model takes them.

`expand` (preencode): every image token of the chat-encoded ids becomes as many image tokens as the
image has features, every video token as many video tokens as the video has (`anyres.FeatureLayout`):
the ids transformers' LlavaNextProcessor / LlavaOnevisionProcessor give for the same text. A
video is decoded here (`video.read_frames`, `frames` sampled uniformly) because its frame count
sets its length. The result, a `MediaGroup`, keeps the media of one conversation together, so
packing (which only concatenates groups) cannot mix up which images shared a sample (OneVision
gives each image of a multi-image sample one tile).

`tiles` (postencode): a group's tiles in token order, an image's base tile then its grid row by
row, a video's frames (`anyres.AnyresPreprocessor`, `video.VideoPreprocessor`); its `media` rows
are the model's `media_layout` (`model.tiling.Media`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_ext.data.anyres import AnyresPreprocessor, FeatureLayout
from megatron_ext.data.conversation import VIDEO_MARKER
from megatron_ext.data.video import VideoPreprocessor, read_frames
from megatron_ext.errors import UserError
from megatron_ext.model import tiling


@dataclass(frozen=True)
class MediaGroup:
    """One conversation's media: its images (PIL) and videos (uint8 frames [n, H, W, 3]) in marker
    order, and one layout row per image or video in token order."""

    images: list
    videos: list
    media: list[tiling.Media]


class TiledMedia:
    def __init__(self, image_processor, tokenizer, arch, video_frames: int, frame_settings=None):
        """`frame_settings`: the video processor's (`video.load_frame_settings`), for a model
        that takes videos."""
        self.anyres = AnyresPreprocessor(image_processor)
        self.layout = FeatureLayout(arch.tiling, arch.vision.image_size, arch.vision.patches_per_side,
                                    one_tile_when_several=self.anyres.one_tile_when_several)
        self.image_token = arch.image_token_index
        self.video_token = arch.tiling.video_token_index
        self.video_frames = video_frames
        self.video = None
        if self.video_token is not None:
            if tokenizer.convert_tokens_to_ids(VIDEO_MARKER) != self.video_token:
                raise UserError(f"the tokenizer's {VIDEO_MARKER} token is {tokenizer.convert_tokens_to_ids(VIDEO_MARKER)}, "
                                f"the model's video token is {self.video_token}; use the tokenizer saved with the checkpoint")
            self.video = VideoPreprocessor(frame_settings)

    def expand(self, ids: np.ndarray, assistant: np.ndarray, images: list, videos: list, name: str):
        """(ids, assistant mask, MediaGroup) with every image and video token expanded to its
        features; `name` names the sample in errors (ValueError: the error handler skips it)."""
        if videos and self.video is None:
            raise ValueError("the sample has a video, which this model does not take")
        frames = [read_frames(video, self.video_frames, name=f"{name}: video") for video in videos]
        several = len(images) > 1
        tokens = [self.image_token, self.video_token]
        rendered = int((ids == self.image_token).sum()), int((ids == self.video_token).sum())
        if rendered != (len(images), len(frames)):
            raise ValueError(f"the chat template rendered {rendered[0]} image and {rendered[1]} video markers for "
                             f"{len(images)} images and {len(frames)} videos; choose a template that keeps them all")
        media, counts = [], np.ones(len(ids), dtype=np.int64)
        next_image, next_video = iter(images), iter(frames)
        for position in np.flatnonzero(np.isin(ids, tokens)):
            if ids[position] == self.image_token:
                width, height = next(next_image).size
                one_tile = several and self.layout.one_tile_when_several
                rows, cols = tiling.grid_shape(height, width, self.layout.tiling, self.layout.tile)
                media.append(tiling.Media(tiling.IMAGE, 1 if one_tile else rows * cols + 1, height, width))
                counts[position] = self.layout.image_features((height, width), several)
            else:
                video = next(next_video)
                media.append(tiling.Media(tiling.VIDEO, len(video)))
                counts[position] = self.layout.video_features(len(video))
        # No loss on a feature, whatever the template marked.
        assistant = assistant & ~np.isin(ids, tokens)
        return np.repeat(ids, counts), np.repeat(assistant, counts), MediaGroup(images, frames, media)

    def tiles(self, group: MediaGroup) -> torch.Tensor:
        """float32 [tiles, 3, tile, tile]: the group's tiles in token order."""
        images = iter(self.anyres(group.images) if group.images else [])
        videos = iter(self.video(frames) for frames in group.videos)
        return torch.cat([next(images).pixel_values if m.kind == tiling.IMAGE else next(videos) for m in group.media])
