"""A sample put through a native-resolution task encoder (Qwen2.5-VL, Qwen3-VL), read back for the
page as `encoded_sample` reads a LLaVA's: tokens, roles and trained tokens the same way, and each
image or video as the model gets it: its pixel rows turned back into the smart-resized picture (a
video's frames, in frame pairs), with its grid_thw, whose merged patches are its pad tokens.

The encoder expands each `<|image_pad|>` to its merged patch count, so the ids hold every position
of an image; its grids are listed per kind, and follow the runs of pad tokens in the text (a
Qwen3-VL video's one run per frame pair, each after its time as text).
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from megatron_ext.data.native_resolution import QwenVision, VideoClip, frame_pair_stamp
from megatron_ext.data.native_resolution_encoder import with_vision_runs
from megatron_ext.data.shard_format import conversation_of, videos_of
from megatron_ext.pages.encoded_sample import (
    IMAGE,
    VIDEO,
    Inspected,
    NativeGrid,
    Run,
    SampleReader,
    Sequence,
    ShownMedia,
)


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
        grids, runs = self._layout(encoded)
        ids = encoded.input_ids.numpy()
        loss_mask = encoded.loss_mask.numpy() > 0
        # Truncation never cuts an image or video (the encoder skips such a sample).
        sequence = Sequence("", int((~np.isin(ids, list(self.media_tokens))).sum()), int(loss_mask.sum()),
                            sum(run.positions for run in runs))
        found.sequences = [sequence]
        found.images = len(encoded.image_grid_thw)
        found.truncated = bool(encoded.num_truncated)
        if not found.shown:
            return
        # The text as the encoder writes it: a Qwen3-VL video's timed frame pairs included.
        clips = self.encoder.read_clips(videos_of(sample), found.key)
        messages = with_vision_runs(messages, self.encoder.video_pads(clips))
        sequence.pieces = self._pieces(messages, len(ids), loss_mask, runs)
        found.media = self._shown(images, clips, encoded, grids, runs)

    def _layout(self, encoded) -> tuple[list[tuple[str, NativeGrid]], list[Run]]:
        """(kind, grid) of each image and video in token order, and each run of pad tokens in the
        ids, as long as the encoder made it: an image's or video's, or (Qwen3-VL) each of a video's
        frame pairs'."""
        ids = encoded.input_ids.numpy()
        media = np.isin(ids, list(self.media_tokens))
        edges = np.diff(np.concatenate([[False], media, [False]]).astype(np.int8))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        vision = self.encoder.vision
        listed = {self.encoder.image_token_id: (IMAGE, iter(encoded.image_grid_thw.tolist())),
                  self.encoder.video_token_id: (VIDEO, iter(encoded.video_grid_thw.tolist()))}
        grids, runs, at = [], [], 0
        while at < len(starts):
            kind, rows = listed[int(ids[starts[at]])]
            grid = next(rows)
            grids.append((kind, NativeGrid(*grid, vision.patch_size, vision.merge_size)))
            timed = kind == VIDEO and vision.tokens_per_second is None  # Qwen3-VL: a run per frame pair
            lengths = (ends - starts)[at:at + (grid[0] if timed else 1)].tolist()
            runs += [Run(len(grids) - 1, n, k + 1 if timed else None) for k, n in enumerate(lengths)]
            at += len(lengths)
        return grids, runs

    def _shown(self, images: list, clips: list[VideoClip], encoded, grids, runs: list[Run]) -> list[ShownMedia]:
        vision = self.encoder.vision
        rows = {IMAGE: iter(_split(encoded.pixel_values, encoded.image_grid_thw)),
                VIDEO: iter(_split(encoded.pixel_values_videos, encoded.video_grid_thw))}
        images, clips = iter(images), iter(clips)
        shown, numbers = [], {IMAGE: 0, VIDEO: 0}
        for index, (kind, grid) in enumerate(grids):
            numbers[kind] += 1
            frames = frames_of(next(rows[kind]), (grid.t, grid.h, grid.w), vision)
            own = [run.positions for run in runs if run.media == index]
            if kind == IMAGE:  # an image's pair is one frame twice
                shown.append(ShownMedia(IMAGE, numbers[IMAGE], sum(own), next(images), self.pixels.image(frames[:1]),
                                        grid=grid))
                continue
            clip = next(clips)
            times = clip.frame_pair_seconds(vision.temporal_patch_size)
            # Qwen3-VL writes each pair's time before the pair's own run of pads.
            timed = None if vision.tokens_per_second else [(frame_pair_stamp(s), n) for s, n in zip(times, own, strict=True)]
            shown.append(ShownMedia(VIDEO, numbers[VIDEO], sum(own), clip.frames, self.pixels.video(frames), times=times,
                                    grid=grid, timed_pairs=timed))
        return shown


def _split(rows: torch.Tensor, grids: torch.Tensor) -> list[torch.Tensor]:
    """Each image's (video's) rows of the concatenated pixel rows."""
    return list(rows.split([int(g.prod()) for g in grids])) if len(grids) else []
