"""Encoded samples -> micro batches: truncation, alignment padding, packing and stacking.

Everything here is about lengths in the model's *combined* sequence, where an image token is
`img_seq_len` positions wide. The task encoder (tokens, images) hands its samples to a
`BatchLayout`; the GPU benchmark builds synthetic samples and batches them through the same one.

Batch contract (`LlavaBatch`, consumed by the trainer through `model.inputs`), B rows of T tokens:
- images       float [N_img, 3, H, W]  every image of the micro batch in order of appearance
                                       (row by row); N_img may be 0. Tiled models: every tile,
                                       in the order of their media's tokens
- media_layout long  [M, 4]  tiled models: one `model.tiling.Media` row per image or video, in
                             token order across rows and packed samples; [0, 4] otherwise
- input_ids    long  [B, T]  one `image_token_index` per image (tiled models: per feature, and
                             video tokens per video feature); padding = pad_token_id
- labels       long  [B, T]  labels[b, t] = token after position t (pad_token_id where ignored)
- loss_mask    float [B, T]  1 where labels[b, t] is an assistant token; 0 for prompts, system
                             text, image tokens, the last token of every packed sample, padding
- segment_ids  long  [B, T]  1..k: which packed sample a token belongs to; 0 = padding (at the
                             end of a row, and after each sample when samples are aligned)
- image_index  long  [U]  preference pairs (`data.pairs`): which entry of `images` each image use of
                           the rows takes, in reading order (chosen and rejected share their pair's
                           images, held once); None otherwise (every image used once, in order)
- num_samples, num_truncated, num_skipped: ints for the trainer's log (pairs count as one sample). num_skipped counts the
  samples the energon error handler dropped in the worker that built this batch since its
  previous batch (corrupt images, untrainable conversations, ...).

Lengths the parallel layout needs (`alignment`, `model.sequence_alignment`): each sample is padded
to a multiple of `alignment.per_sample` (context parallelism splits every packed sample) before
packing, so packs account for it; each micro batch is padded to a combined length that is a
multiple of `alignment.total` (sequence parallelism, context parallelism, FP8).

`max_tiles` (--max-tiles-per-sequence) bounds the vision tower's batch: a sample with more tiles
(LLaVA-1.5: images) is refused (the task encoder's error handler skips and counts it), and packing
closes a pack before it would exceed the bound, so a micro batch holds at most
micro_batch_size x max_tiles tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from megatron.energon import Batch, Sample, edataclass

from megatron_ext.data.packing import knapsack_bins
from megatron_ext.model.sequence_alignment import SequenceAlignment, combined_length, round_up
from megatron_ext.model.tiling import layout_tensor


@edataclass
class EncodedSample(Sample):
    """One conversation, or several packed into one sequence."""

    input_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] float
    lengths: list[int]  # tokens of each packed conversation, in order
    pads: list[int]  # alignment padding tokens after each of them
    images: list  # PIL images (tiled models: `tiled_media.MediaGroup`s) until the task encoder's
    # postencode_sample, then [3, H, W] float tensors (tiles)
    num_truncated: int
    media: list  # tiled models: `model.tiling.Media` rows in token order; empty otherwise
    # Preference pairs, before postencode_sample: for each entry of `images`, the earlier entry it
    # repeats (-1: its own); after it: `image_index` (the batch's, for this sample's unique tiles).
    repeat_of: list | None = None
    image_index: list | None = None
    paired: bool = False  # the sample's sequences are (chosen, rejected) pairs


@edataclass
class LlavaBatch(Batch):
    images: torch.Tensor
    media_layout: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    num_samples: int
    num_truncated: int
    num_skipped: int
    image_index: torch.Tensor | None = None

    def as_dict(self) -> dict:
        """The plain dict the forward step (`model.inputs`) reads, plus the batch's sample keys."""
        out = {name: getattr(self, name) for name in _BATCH_FIELDS}
        if self.image_index is not None:
            out["image_index"] = self.image_index
        out["keys"] = list(self.__key__)
        return out


_BATCH_FIELDS = ("images", "media_layout", "input_ids", "labels", "loss_mask", "segment_ids", "num_samples", "num_truncated",
                 "num_skipped")


def _image_uses(sample: EncodedSample) -> int:
    """Image tokens of LLaVA-1.5's kind a sample holds: a pair uses its images twice."""
    return len(sample.image_index) if sample.image_index is not None else len(sample.images)


def _repeats(samples: list[EncodedSample]) -> list | None:
    """The packed samples' `repeat_of`, pointing into the pack's images."""
    if all(s.repeat_of is None for s in samples):
        return None
    out, offset = [], 0
    for s in samples:
        out += [r + offset if r >= 0 else -1 for r in (s.repeat_of or [-1] * len(s.images))]
        offset += len(s.images)
    return out


def _offset_index(samples: list[EncodedSample]) -> list | None:
    """The packed samples' `image_index`, pointing into the pack's images."""
    if all(s.image_index is None for s in samples):
        return None
    offsets = np.cumsum([0] + [len(s.images) for s in samples])
    return [i + int(offset) for s, offset in zip(samples, offsets) for i in (s.image_index or [])]


def _tiles(images: list, media: list) -> int:
    """Vision tower inputs of a sample: its media rows' tiles (tiled models), else its images."""
    return sum(m.tiles for m in media) if media else len(images)


@dataclass(frozen=True)
class BatchLayout:
    pad_token_id: int
    image_token_index: int
    img_seq_len: int
    max_length: int  # combined positions a sample (or a pack) may take
    image_shape: tuple[int, int, int]  # of a processed image, for batches that hold none
    alignment: SequenceAlignment = SequenceAlignment()
    video_token_index: int | None = None  # tiled models' video features: never cut, as image tokens
    max_tiles: int | None = None  # vision tower inputs a sample or a pack may hold

    @property
    def sample_limit(self) -> int:
        """Longest sample that still fits once padded to `alignment.per_sample`."""
        return self.max_length - self.max_length % self.alignment.per_sample

    def fitting_tokens(self, ids: np.ndarray) -> int:
        """How many leading tokens fit in the sample limit; never cuts an image (ValueError then:
        the task encoder's error handler reports the sample as bad)."""
        ends = np.cumsum(np.where(ids == self.image_token_index, self.img_seq_len, 1))
        keep = int(np.searchsorted(ends, self.sample_limit, side="right"))
        if np.isin(ids[keep:], [self.image_token_index, self.video_token_index]).any():
            raise ValueError(f"an image does not fit in the sequence length {self.sample_limit}")
        return keep

    def sample(self, base: Sample, ids: np.ndarray, labels: np.ndarray, loss_mask: np.ndarray, images: list,
               truncated: bool, media: list = ()) -> EncodedSample:
        """One conversation (already fitted), padded to the per-sample alignment; `media`: a tiled
        model's layout rows (their tiles counted against `max_tiles`, else the images are)."""
        tiles = _tiles(images, media)
        if self.max_tiles is not None and tiles > self.max_tiles:
            raise ValueError(f"{tiles} tiles exceed --max-tiles-per-sequence {self.max_tiles}")
        combined = combined_length(len(ids), len(images), self.img_seq_len)
        pad = round_up(combined, self.alignment.per_sample) - combined
        return EncodedSample.derive_from(
            base,
            input_ids=torch.from_numpy(np.append(ids, np.full(pad, self.pad_token_id, dtype=ids.dtype))),
            labels=torch.from_numpy(np.append(labels, np.full(pad, self.pad_token_id, dtype=labels.dtype))),
            loss_mask=torch.from_numpy(np.append(loss_mask, np.zeros(pad, dtype=bool)).astype(np.float32)),
            lengths=[len(ids)],
            pads=[pad],
            images=images,
            num_truncated=int(truncated),
            media=list(media),
        )

    def combined_length(self, sample: EncodedSample) -> int:
        return combined_length(len(sample.input_ids), _image_uses(sample), self.img_seq_len)

    def packs(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        """Samples grouped into sequences of at most `max_length` (`packing.knapsack_bins`)."""
        lengths = [self.combined_length(s) for s in samples]
        bins = [[samples[i] for i in bin_] for bin_ in knapsack_bins(lengths, self.max_length)]
        return bins if self.max_tiles is None else [part for bin_ in bins for part in self._within_tiles(bin_)]

    def _within_tiles(self, bin_: list[EncodedSample]) -> list[list[EncodedSample]]:
        """`bin_` cut, in order, into packs of at most `max_tiles` tiles."""
        parts, tiles = [[]], 0
        for s in bin_:
            count = _tiles(s.images, s.media)
            if parts[-1] and tiles + count > self.max_tiles:
                parts.append([])
                tiles = 0
            parts[-1].append(s)
            tiles += count
        return parts

    @staticmethod
    def pack(samples: list[EncodedSample]) -> EncodedSample:
        return EncodedSample.derive_from(
            samples[0],
            __key__=",".join(s.__key__ for s in samples),
            input_ids=torch.cat([s.input_ids for s in samples]),
            labels=torch.cat([s.labels for s in samples]),
            loss_mask=torch.cat([s.loss_mask for s in samples]),
            lengths=[n for s in samples for n in s.lengths],
            pads=[n for s in samples for n in s.pads],
            images=[image for s in samples for image in s.images],
            num_truncated=sum(s.num_truncated for s in samples),
            media=[m for s in samples for m in s.media],
            repeat_of=_repeats(samples),
            image_index=_offset_index(samples),
            paired=samples[0].paired,
        )

    def batch(self, samples: list[EncodedSample], num_skipped: int = 0) -> LlavaBatch:
        """Rows padded to one width whose combined length is a multiple of `alignment.total`."""
        width = max(len(s.input_ids) for s in samples)
        # LLaVAModel's combined length: the row width plus the most images any row expands.
        combined = combined_length(width, max(_image_uses(s) for s in samples), self.img_seq_len)
        width += round_up(combined, self.alignment.total) - combined
        shape = (len(samples), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        segment_ids = torch.zeros(shape, dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s.input_ids)
            input_ids[row, :n], labels[row, :n], loss_mask[row, :n] = s.input_ids, s.labels, s.loss_mask
            numbers = torch.arange(1, len(s.lengths) + 1)
            runs = torch.stack([numbers, torch.zeros_like(numbers)], 1).flatten()
            segment_ids[row, :n] = torch.repeat_interleave(runs, torch.tensor([s.lengths, s.pads]).T.flatten())
        images = [image for s in samples for image in s.images]
        index = _offset_index(samples)
        return LlavaBatch(
            __key__=[s.__key__ for s in samples],
            __restore_key__=(),
            images=torch.stack(images) if images else torch.zeros((0, *self.image_shape)),
            media_layout=layout_tensor([m for s in samples for m in s.media]),
            input_ids=input_ids,
            labels=labels,
            loss_mask=loss_mask,
            segment_ids=segment_ids,
            num_samples=sum(len(s.lengths) // (2 if s.paired else 1) for s in samples),
            num_truncated=sum(s.num_truncated for s in samples),
            num_skipped=num_skipped,
            image_index=None if index is None else torch.tensor(index, dtype=torch.long),
        )
