"""A sample put through a native-resolution task encoder (Qwen2.5-VL, Qwen3-VL), read back for the
page as `encoded_sample` reads a LLaVA's: tokens, roles and trained tokens the same way, and each
image or video as the model gets it: its pixel rows turned back into the smart-resized picture (a
video's frames, in frame pairs), with its grid_thw, whose merged patches are its pad tokens.

The encoder expands each `<|image_pad|>` to its merged patch count, so the ids hold every position
of an image; its grids are listed per kind, and follow the runs of pad tokens in the text.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from megatron_ext.data.native_resolution import QwenVision, read_clip
from megatron_ext.data.native_resolution_encoder import with_vision_runs
from megatron_ext.data.shard_format import conversation_of, videos_of
from megatron_ext.pages.encoded_sample import IMAGE, VIDEO, Inspected, NativeGrid, SampleReader, Sequence, ShownMedia


def frames_of(rows: torch.Tensor, grid: tuple[int, int, int], vision: QwenVision) -> torch.Tensor:
    """Pixel rows [t*h*w, C*tp*p*p] in merge-block order -> frames [t*tp, C, h*p, w*p]: what
    `native_resolution.patch_rows` made them from (an image's frame repeated to fill its pair)."""
    t, h, w = grid
    p, m, tp = vision.patch_size, vision.merge_size, vision.temporal_patch_size
    blocks = rows.reshape(t, h // m, w // m, m, m, -1, tp, p, p)
    # (t, block row, block col, row in block, col in block, C, frame in pair, p, p) -> (t, frame, C, H, W)
    frames = blocks.permute(0, 6, 5, 1, 3, 7, 2, 4, 8)
    return frames.reshape(t * tp, -1, h * p, w * p)


class NativeSampleReader(SampleReader):
    """`SampleReader` for a `NativeResolutionTaskEncoder` (one conversation a sample)."""

    expanded = True
    tiled = None

    def _media_tokens(self) -> set[int]:
        return {self.encoder.image_token_id, self.encoder.video_token_id}

    @property
    def row_capacity(self) -> int:
        return self.encoder.max_length

    def packed_length(self, encoded) -> int:
        return len(encoded.input_ids)

    def _packable(self, encoded):
        packable = copy.copy(encoded)
        packable.pixel_values = packable.pixel_values_videos = None  # packing reads token counts, not pixels
        return packable

    def _fill(self, found: Inspected, sample, encoded) -> None:
        images, messages = conversation_of(sample)
        messages = with_vision_runs(messages)
        grids = self._grids(encoded)
        positions = [grid.tokens for _, grid in grids]
        ids = encoded.input_ids.numpy()
        loss_mask = encoded.loss_mask.numpy() > 0
        # Truncation never cuts an image or video (the encoder skips such a sample).
        sequence = Sequence("", int((~np.isin(ids, list(self.media_tokens))).sum()), int(loss_mask.sum()),
                            sum(positions))
        if found.shown:
            sequence.pieces = self._pieces(messages, len(ids), loss_mask, positions)
        found.sequences = [sequence]
        found.images = len(encoded.image_grid_thw)
        found.truncated = bool(encoded.num_truncated)
        if found.shown:
            found.media = self._shown(images, videos_of(sample), encoded, grids, found.key)

    def _grids(self, encoded) -> list[tuple[str, NativeGrid]]:
        """(kind, grid) of each image and video in token order: one a run of its pad tokens."""
        ids = encoded.input_ids.numpy()
        media = np.isin(ids, list(self.media_tokens))
        starts = np.flatnonzero(media & ~np.concatenate([[False], media[:-1]]))
        vision = self.encoder.vision
        listed = {self.encoder.image_token_id: (IMAGE, iter(encoded.image_grid_thw.tolist())),
                  self.encoder.video_token_id: (VIDEO, iter(encoded.video_grid_thw.tolist()))}
        grids = []
        for start in starts:
            kind, rows = listed[int(ids[start])]
            grids.append((kind, NativeGrid(*next(rows), vision.patch_size, vision.merge_size)))
        return grids

    def _shown(self, images: list, videos: list, encoded, grids, key: str) -> list[ShownMedia]:
        vision = self.encoder.vision
        rows = {IMAGE: iter(_split(encoded.pixel_values, encoded.image_grid_thw)),
                VIDEO: iter(_split(encoded.pixel_values_videos, encoded.video_grid_thw))}
        originals = {IMAGE: iter(images), VIDEO: iter(videos)}
        shown, numbers = [], {IMAGE: 0, VIDEO: 0}
        for kind, grid in grids:
            numbers[kind] += 1
            frames = frames_of(next(rows[kind]), (grid.t, grid.h, grid.w), vision)
            original, times = next(originals[kind]), None
            if kind == VIDEO:
                clip = read_clip(original, self.encoder.video_frames, key)
                original, times = clip.frames, clip.frame_pair_seconds(vision.temporal_patch_size)
                pixels = self.pixels.video(frames)
            else:
                pixels = self.pixels.image(frames[:1])  # an image's pair is one frame twice
            shown.append(ShownMedia(kind, numbers[kind], grid.tokens, original, pixels, times=times, grid=grid))
        return shown


def _split(rows: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
    """Each image's (video's) rows of the concatenated pixel rows."""
    return list(rows.split([int(g.prod()) for g in grids])) if len(grids) else []
