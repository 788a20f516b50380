"""The energon task encoder that turns conversations with images and videos into batches for a
native-resolution model (Qwen2.5-VL, Qwen3-VL): every image keeps its own size, so a micro batch holds many.

Per sample (`preencode_sample`):
1. each `<image>` / `<video>` marker of the messages becomes the model's vision run
   (`<|vision_start|><|image_pad|><|vision_end|>`, as Qwen's own template renders an image part;
   inside a Qwen3-VL video's, each frame pair's `<s.s seconds>` and its own pad, as its processor
   writes them), then the chat template renders the conversation and marks the assistant's tokens
   (`chat_template.ChatTokenizer`, as for LLaVA);
2. pixel rows and grids as transformers' processors give them (`native_resolution`), and each pad
   token repeated to its image's (video's, frame pair's) merged patch count;
3. next-token labels, the loss mask (assistant tokens only), truncation at the end (never inside
   an image: such a sample is dropped as bad), and the sample's own mRoPE positions [3, L].

Packing (`--packing-seq-length`): samples grouped by `packing.knapsack_bins` and concatenated into
one row, each keeping its own positions from 0 (`native_resolution.pack_positions`); the model
attends within each (THD, `model.mrope_inputs`).

`batch`: rows padded at the end to one width (a multiple of the layout's alignment); pixel rows
concatenated in reading order, their grids listed, no image padded to the largest.

Batch contract (`NativeResolutionBatch.as_dict`, read by `model.mrope_inputs`), B rows of T tokens:
input_ids, labels long [B, T]; loss_mask float [B, T]; segment_ids long [B, T] (1..k: which packed
sample, 0 on padding); position_ids long [3, B, T] (0 on padding); pixel_values float [P, C*t*p*p] with
image_grid_thw long [N, 3]; pixel_values_videos, video_grid_thw likewise, with second_per_grid_ts
float [V] (each video's seconds per frame pair, which its positions were computed with); num_samples,
num_truncated, num_skipped.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from megatron.energon import Batch, Sample, TaskEncoder, edataclass, stateless

from megatron_ext import hf_loading
from megatron_ext.data.chat_template import ChatTokenizer, resolve_chat_template
from megatron_ext.data.conversation import IMAGE_MARKER, VIDEO_MARKER
from megatron_ext.data.native_resolution import (
    IMAGE_TOKEN,
    QWEN2_5_VL,
    QWEN3_VL,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    QwenVision,
    VideoClip,
    frame_pair_runs,
    image_inputs,
    image_processor,
    mrope_positions,
    pack_positions,
    read_clip,
    token_types,
    video_inputs,
    video_run_grids,
    with_pixel_bounds,
    with_saved_settings,
)
from megatron_ext.data.packing import knapsack_bins
from megatron_ext.data.shard_format import ImageModeKeepingDecoder, conversation_of, videos_of
from megatron_ext.data.task_encoder import take_bad_sample_count
from megatron_ext.errors import UserError
from megatron_ext.model.sequence_alignment import SequenceAlignment, round_up


@edataclass
class NativeResolutionSample(Sample):
    input_ids: torch.Tensor  # [L] long, each vision pad token expanded
    labels: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] float
    position_ids: torch.Tensor  # [3, L] long, from 0
    pixel_values: torch.Tensor  # [P, C*t*p*p] float, the images' rows in reading order
    image_grid_thw: torch.Tensor  # [N, 3] long
    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor  # [V] float
    num_truncated: int
    lengths: list[int]  # tokens of each packed conversation, in order


@edataclass
class NativeResolutionBatch(Batch):
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    pixel_values_videos: torch.Tensor
    video_grid_thw: torch.Tensor
    second_per_grid_ts: torch.Tensor
    num_samples: int
    num_truncated: int
    num_skipped: int

    def as_dict(self) -> dict:
        """The plain dict the forward step reads, plus the batch's sample keys."""
        out = {name: getattr(self, name) for name in _BATCH_FIELDS}
        out["keys"] = list(self.__key__)
        return out


_BATCH_FIELDS = ("input_ids", "labels", "loss_mask", "segment_ids", "position_ids", "pixel_values", "image_grid_thw",
                 "pixel_values_videos", "video_grid_thw", "second_per_grid_ts", "num_samples", "num_truncated",
                 "num_skipped")


def vision_of(arch, processor_dir: str | Path | None = None, min_pixels: int | None = None,
              max_pixels: int | None = None) -> QwenVision:
    """The input settings of `arch`'s family (Qwen2.5-VL's or Qwen3-VL's, by its name) with its
    checkpoint's patch, merge and temporal sizes, (Qwen2.5-VL's) video time scale, what the processor
    files in `processor_dir` save (`with_saved_settings`), and the run's --min-pixels / --max-pixels
    over them (`with_pixel_bounds`)."""
    config = arch.vision_config
    base = next(v for v in (QWEN2_5_VL, QWEN3_VL) if v.name == arch.name)
    vision = replace(base, patch_size=config["patch_size"], merge_size=config["spatial_merge_size"],
                     temporal_patch_size=config["temporal_patch_size"], tokens_per_second=config.get("tokens_per_second"))
    return with_pixel_bounds(with_saved_settings(vision, processor_dir), min_pixels, max_pixels)


class NativeResolutionTaskEncoder(TaskEncoder[Sample, NativeResolutionSample, NativeResolutionBatch,
                                              NativeResolutionBatch]):
    """Conversations -> `NativeResolutionBatch`es for one checkpoint's tokenizer and model."""

    decoder = ImageModeKeepingDecoder()

    def __init__(self, tokenizer_dir: str, *, vision: QwenVision, image_token_id: int, video_token_id: int,
                 seq_length: int, pad_token_id: int | None = None, chat_template: str | None = None, lang: str = "en",
                 family_template: str | None = None, video_frames: int = 32, packing_seq_length: int | None = None,
                 alignment: SequenceAlignment = SequenceAlignment()):
        if packing_seq_length is not None and packing_seq_length > seq_length:
            raise UserError(f"--packing-seq-length {packing_seq_length} exceeds --seq-length {seq_length}, the model's "
                            "sequence length")
        if seq_length % alignment.total:
            raise UserError(f"--seq-length {seq_length} must be a multiple of {alignment.total} (the parallel layout's "
                            "sequence alignment)")
        tokenizer = hf_loading.load_tokenizer(str(tokenizer_dir), "--tokenizer-load-dir")
        self.template_name, template = resolve_chat_template(chat_template, lang, tokenizer, family_default=family_template)
        # The `<image>` marker never reaches the tokenizer here (each becomes a vision run first), so
        # the image token ChatTokenizer checks it against is whatever the tokenizer makes of it.
        self.chat = ChatTokenizer(tokenizer, template, tokenizer.convert_tokens_to_ids(IMAGE_MARKER))
        self.pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if self.pad_token_id is None:
            raise UserError("the tokenizer has no pad token; give --pad-token-id")
        self.vision, self.processor = vision, image_processor(vision)
        self.image_token_id, self.video_token_id = image_token_id, video_token_id
        self.packing = packing_seq_length is not None  # what the loaders ask (`data.loader`)
        self.max_length = packing_seq_length or seq_length  # tokens a sample (or a pack) may take
        self.alignment, self.video_frames = alignment, video_frames
        self.row_width = 3 * vision.temporal_patch_size * vision.patch_size**2

    @classmethod
    def for_model(cls, tokenizer_dir: str, arch, min_pixels: int | None = None, max_pixels: int | None = None,
                  **kwargs) -> "NativeResolutionTaskEncoder":
        """Encoder for a native-resolution model's arch (`families.qwen2_5_vl.Qwen2_5_VLArch`), its
        images within the run's --min-pixels / --max-pixels (None: the bounds the processor files in
        `tokenizer_dir` save, else the family's)."""
        from megatron_ext import families

        return cls(tokenizer_dir, vision=vision_of(arch, tokenizer_dir, min_pixels, max_pixels), image_token_id=arch.image_token_id,
                   video_token_id=arch.video_token_id, family_template=families.of(arch).text.chat_template, **kwargs)

    @stateless
    def preencode_sample(self, sample: Sample) -> NativeResolutionSample:
        images, messages = conversation_of(sample)
        return self.encode_conversation(sample, messages, images, videos_of(sample))

    def encode_conversation(self, sample: Sample, messages: list[dict], images: list, videos: list,
                            completion: bool = False, media: tuple[dict, list[str]] | None = None) -> NativeResolutionSample:
        """One conversation's tokens, labels, loss mask, positions and pixels, fitted to the sequence
        length; `completion`: only the last message's completion trains (DPO's answer, `ChatTokenizer.encode`);
        `media`: the images' and videos' `_media`, where already computed."""
        media, video_pads = media or self._media(images, self.read_clips(videos, sample.__key__))
        ids, assistant = self.chat.encode(with_vision_runs(messages, video_pads), completion)
        counts = self._run_lengths(ids, media)
        ids, assistant = np.repeat(ids, counts), np.repeat(assistant, counts)
        labels = np.append(ids[1:], self.pad_token_id)
        loss_mask = np.append(assistant[1:], False)  # position t trains when token t + 1 is the assistant's
        truncated = len(ids) > self.max_length
        if np.isin(ids[self.max_length:], [self.image_token_id, self.video_token_id]).any():
            raise ValueError(f"an image does not fit in the sequence length {self.max_length}")
        ids, labels, loss_mask = ids[:self.max_length], labels[:self.max_length], loss_mask[:self.max_length]
        labels[-1], loss_mask[-1] = self.pad_token_id, False  # the last token's successor is not this sample's
        if not loss_mask.any():
            raise ValueError(f"no answer token fits in the sequence length {self.max_length}")
        return NativeResolutionSample.derive_from(
            sample, input_ids=torch.from_numpy(ids), labels=torch.from_numpy(labels),
            loss_mask=torch.from_numpy(loss_mask.astype(np.float32)), position_ids=self._positions(ids, media),
            pixel_values=media["pixel_values"], image_grid_thw=media["image_grid_thw"],
            pixel_values_videos=media["pixel_values_videos"], video_grid_thw=media["video_grid_thw"],
            second_per_grid_ts=media["second_per_grid_ts"], num_truncated=int(truncated), lengths=[len(ids)])

    def encode_prompt(self, messages: list[dict], images: list, clips: list[VideoClip]) -> dict:
        """A conversation and the prompt for the assistant's next turn, as generation continues it,
        by the steps that encode training's samples, untruncated: what transformers' model takes
        (input_ids [1, S] with the vision runs expanded, mm_token_type_ids [1, S], each kind of media's
        pixel rows and grids where the prompt holds it, Qwen2.5-VL's second_per_grid_ts with videos)
        and position_ids [3, 1, S], the mRoPE positions training computes."""
        media, video_pads = self._media(images, clips)
        ids = self.chat.encode_prompt(with_vision_runs(messages, video_pads))
        ids = np.repeat(ids, self._run_lengths(ids, media))
        types = token_types(ids, self.image_token_id, self.video_token_id)
        inputs = {"input_ids": torch.from_numpy(ids)[None], "mm_token_type_ids": torch.from_numpy(types)[None],
                  "position_ids": self._positions(ids, media)[:, None]}
        for pixels, grid in (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw")):
            if len(media[grid]):  # transformers takes no empty media
                inputs.update({pixels: media[pixels], grid: media[grid]})
        if len(media["video_grid_thw"]) and self.vision.tokens_per_second is not None:
            inputs["second_per_grid_ts"] = media["second_per_grid_ts"]
        return inputs

    def _run_lengths(self, ids: np.ndarray, media: dict) -> np.ndarray:
        """How many times each token of `ids` repeats: a pad its image's (video's) merged patch count, others once."""
        counts = np.ones(len(ids), dtype=np.int64)
        # One pad token per image and per video run (a Qwen3-VL video's frame pair), repeated to its merged patches.
        for token, grids in ((self.image_token_id, media["image_grid_thw"].tolist()),
                             (self.video_token_id, video_run_grids(media["video_grid_thw"], self.vision))):
            counts[ids == token] = [int(np.prod(g)) // self.vision.merge_size**2 for g in grids]
        return counts

    def _positions(self, ids: np.ndarray, media: dict) -> torch.Tensor:
        return mrope_positions(token_types(ids, self.image_token_id, self.video_token_id), self.vision,
                               media["image_grid_thw"], media["video_grid_thw"], media["second_per_grid_ts"])

    def read_clips(self, videos: list, key: str) -> list[VideoClip]:
        """A sample's videos (`key` names it in errors), each read into the frames the model samples."""
        return [read_clip(video, self.video_frames, key) for video in videos]

    def _media(self, images: list, clips: list[VideoClip]) -> tuple[dict, list[str]]:
        """Pixel rows and grids of a sample's images and videos (empty ones where it has none), and
        their `video_pads`."""
        media = {"pixel_values": torch.zeros(0, self.row_width), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long),
                 "pixel_values_videos": torch.zeros(0, self.row_width), "video_grid_thw": torch.zeros(0, 3, dtype=torch.long),
                 "second_per_grid_ts": torch.zeros(0)}
        if images:
            media.update(image_inputs(images, self.vision, self.processor))
        inputs = [video_inputs(clip, self.vision) for clip in clips]
        if inputs:
            media.update({name: torch.cat([clip[name] for clip in inputs]) for name in inputs[0]})
        return media, self.video_pads(clips)

    def video_pads(self, clips: list[VideoClip]) -> list[str]:
        """What each video's `<|video_pad|>` becomes in the text before the pads are repeated: itself,
        or Qwen3-VL's frame pairs, each with its time (`native_resolution.frame_pair_runs`)."""
        if self.vision.tokens_per_second is not None:
            return [VIDEO_TOKEN] * len(clips)
        return [frame_pair_runs(c.frame_pair_seconds(self.vision.temporal_patch_size), VIDEO_TOKEN) for c in clips]

    def select_samples_to_pack(self, samples: list[NativeResolutionSample]) -> list[list[NativeResolutionSample]]:
        bins = knapsack_bins([len(s.input_ids) for s in samples], self.max_length)
        return [[samples[i] for i in bin_] for bin_ in bins]

    @stateless
    def pack_selected_samples(self, samples: list[NativeResolutionSample]) -> NativeResolutionSample:
        """One row of the samples in order, each with its own positions (from 0), its media after the previous'."""
        return NativeResolutionSample.derive_from(
            samples[0], __key__=",".join(s.__key__ for s in samples),
            **{name: torch.cat([getattr(s, name) for s in samples]) for name in _TOKEN_FIELDS + _MEDIA_FIELDS},
            position_ids=pack_positions([s.position_ids for s in samples]),
            num_truncated=sum(s.num_truncated for s in samples), lengths=[n for s in samples for n in s.lengths])

    @stateless
    def batch(self, samples: list[NativeResolutionSample]) -> NativeResolutionBatch:
        """Rows padded at the end to the longest's length, rounded up to the alignment."""
        width = round_up(max(len(s.input_ids) for s in samples), self.alignment.total)
        shape = (len(samples), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        segment_ids = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros((3, *shape), dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s.input_ids)
            input_ids[row, :n], labels[row, :n], loss_mask[row, :n] = s.input_ids, s.labels, s.loss_mask
            segment_ids[row, :n] = torch.repeat_interleave(torch.arange(1, len(s.lengths) + 1), torch.tensor(s.lengths))
            position_ids[:, row, :n] = s.position_ids
        return NativeResolutionBatch(
            __key__=[s.__key__ for s in samples], __restore_key__=(), input_ids=input_ids, labels=labels,
            loss_mask=loss_mask, segment_ids=segment_ids, position_ids=position_ids,
            **{name: torch.cat([getattr(s, name) for s in samples]) for name in _MEDIA_FIELDS},
            num_samples=sum(len(s.lengths) for s in samples), num_truncated=sum(s.num_truncated for s in samples),
            num_skipped=take_bad_sample_count())


_TOKEN_FIELDS = ("input_ids", "labels", "loss_mask")
_MEDIA_FIELDS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")


def with_vision_runs(messages: list[dict], video_pads: list[str] = ()) -> list[dict]:
    """`messages` with each `<image>` / `<video>` marker replaced by the vision run the template renders
    (as Qwen's own template renders an image or video part), the videos' pads as `_media` gives them
    in turn (a Qwen3-VL video's timed frame pairs), else one `<|video_pad|>` each."""
    pads = iter(video_pads)

    def runs(content: str) -> str:
        content = content.replace(IMAGE_MARKER, VISION_START + IMAGE_TOKEN + VISION_END)
        return re.sub(re.escape(VIDEO_MARKER), lambda _: VISION_START + next(pads, VIDEO_TOKEN) + VISION_END, content)

    return [{**m, "content": runs(m["content"])} for m in messages]
