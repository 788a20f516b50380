"""The energon task encoder for preference pairs (DPO) of a native-resolution model (Qwen2.5-VL,
Qwen3-VL): each pair becomes one sample of two packed sequences, the prompt with the chosen answer
then the prompt with the rejected one, as `data.pairs` makes them for a LLaVA.

The pair's images and videos are processed once and held once: `image_uses` / `video_uses` list,
for each image (video) run of the tokens in reading order, which of the sample's images (videos) it
shows, and `model.mrope_vlm` runs the tower once on them and places its features at every use. Each
sequence keeps its own mRoPE positions from 0 (`native_resolution.pack_positions`) and the row goes
to the model as THD (`model.mrope_inputs`), so the rejected sequence never sees the chosen one. A
pair is never split or truncated (a cut answer is another preference): one that does not fit is a
bad sample. Only the final answer's completion trains, as TRL's DPO split makes it. Batch rows hold
whole pairs: segments 2k+1 and 2k+2 of a row are pair k's chosen and rejected sequences.
"""

from __future__ import annotations

from dataclasses import fields

import torch
from megatron.energon import Sample, edataclass, stateless

from megatron_ext.data.native_resolution import pack_positions
from megatron_ext.data.native_resolution_encoder import (
    NativeResolutionBatch,
    NativeResolutionSample,
    NativeResolutionTaskEncoder,
)
from megatron_ext.data.shard_format import preference_of

# Per media kind: its uses and the grids they index.
_USES = (("image_uses", "image_grid_thw"), ("video_uses", "video_grid_thw"))


@edataclass
class NativeResolutionPair(NativeResolutionSample):
    image_uses: torch.Tensor  # [uses] long: the image each image run shows, an index into image_grid_thw
    video_uses: torch.Tensor  # [uses] long, into video_grid_thw


@edataclass
class NativeResolutionPairBatch(NativeResolutionBatch):
    image_uses: torch.Tensor  # into the batch's images
    video_uses: torch.Tensor

    def as_dict(self) -> dict:
        # edataclass rebuilds the class, which zero-argument super() does not follow.
        return {**NativeResolutionBatch.as_dict(self), **{uses: getattr(self, uses) for uses, _ in _USES}}


def _with(cls, base, **changes):
    """`base` (a dataclass) as a `cls`, its fields kept, `changes` added."""
    return cls(**{f.name: getattr(base, f.name) for f in fields(base)}, **changes)


def _joined_uses(samples: list) -> dict:
    """The samples' uses, each counted from its own media's place among all of theirs."""
    joined = {}
    for uses, grid in _USES:
        offsets = torch.tensor([0] + [len(getattr(s, grid)) for s in samples[:-1]]).cumsum(0)
        joined[uses] = torch.cat([getattr(s, uses) + offset for s, offset in zip(samples, offsets)])
    return joined


class NativeResolutionPairTaskEncoder(NativeResolutionTaskEncoder):
    @stateless
    def preencode_sample(self, sample: Sample) -> NativeResolutionPair:
        images, prompt, chosen, rejected = preference_of(sample)
        media, video_pads = self._media(images, self.read_clips(sample.videos, sample.__key__))
        sequences = [self.encode_conversation(sample, [*prompt, {"role": "assistant", "content": answer}], images,
                                              sample.videos, completion=True, media=(media, video_pads))
                     for answer in (chosen, rejected)]
        if any(s.num_truncated for s in sequences) or sum(len(s.input_ids) for s in sequences) > self.max_length:
            raise ValueError(f"the pair (the prompt with each answer) does not fit in the sequence length {self.max_length}")
        # Both sequences show the pair's media, in the same order.
        return NativeResolutionPair.derive_from(
            sample, **{name: torch.cat([getattr(s, name) for s in sequences]) for name in ("input_ids", "labels", "loss_mask")},
            position_ids=pack_positions([s.position_ids for s in sequences]), **media,
            **{uses: torch.arange(len(media[grid])).repeat(2) for uses, grid in _USES},
            num_truncated=0, lengths=[len(s.input_ids) for s in sequences])

    @stateless
    def pack_selected_samples(self, samples: list[NativeResolutionPair]) -> NativeResolutionPair:
        return _with(NativeResolutionPair, super().pack_selected_samples(samples), **_joined_uses(samples))

    @stateless
    def batch(self, samples: list[NativeResolutionPair]) -> NativeResolutionPairBatch:
        return _with(NativeResolutionPairBatch, super().batch(samples), **_joined_uses(samples))
