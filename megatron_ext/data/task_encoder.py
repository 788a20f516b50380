"""The energon task encoder that turns conversations with images into LLaVA training batches.

Input: a conversation with zero, one or several images: a `ConversationSample` loaded from the
shards `scripts/data/build_energon_dataset.py` writes, or a `VQASample` (datasets prepared with the
original README's field map). `shard_format.conversation_of` reads both.

Steps (energon calls them in this order):
1. `preencode_sample`: chat template -> token ids with ONE image token per image, next-token
   labels, and a loss mask that is 1 only where the token to predict is the assistant's
   (every assistant turn's trained span, `chat_template.ChatTokenizer`); truncation to the sequence length;
2. `select_samples_to_pack` / `pack_selected_samples` (packing only): greedy knapsack over
   energon's packing buffer (`packing.knapsack_bins`), then concatenation;
3. `postencode_sample`: the checkpoint's own HF image processor (CLIP / SigLIP), through
   `images.ImagePreprocessor`, so pixels are what HF LLaVA sees;
   tiled models (LLaVA-NeXT, OneVision; `arch.tiling`): `tiled_media.TiledMedia` expands each
   `<image>` / `<video>` token to its features in step 1 (the ids HF's processor gives; a video's
   frames are decoded there, `--video-frames` of them) and makes the tiles and media layout here;
4. `batch`: padding and stacking into a `LlavaBatch` (the batch contract: `batching.py`).

Lengths, truncation, alignment padding, packing and stacking are the `batching.BatchLayout`'s.
Lengths are counted in the combined space: a sample fits when its tokens plus (img_seq_len - 1)
per image fit in the sequence length. Truncation cuts text at the end, never inside (or before)
an image; a sample whose image or whole answer would be cut off is dropped as a bad sample.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from megatron.energon import Sample, TaskEncoder, stateless
from PIL import Image

from megatron_ext import hf_loading
from megatron_ext.data.batching import BatchLayout, EncodedSample, LlavaBatch
from megatron_ext.data.chat_template import ChatTokenizer, resolve_chat_template
from megatron_ext.data.images import ImagePreprocessor
from megatron_ext.data.shard_format import ImageModeKeepingDecoder, conversation_of, videos_of
from megatron_ext.data.tiled_media import TiledMedia
from megatron_ext.data.video import load_frame_settings
from megatron_ext.errors import UserError
from megatron_ext.model.sequence_alignment import SequenceAlignment

log = logging.getLogger(__name__)

# Samples the error handler dropped in this process since the last batch it built.
_bad_samples = 0


def count_bad_sample(exc: Exception, sample: Any, sources=None) -> None:
    """energon `global_error_handler`: log the bad sample in one line and count it."""
    global _bad_samples
    _bad_samples += 1
    where = ", ".join(f"{s.dataset_path}/{s.shard_name}: {'/'.join(s.file_names)}" for s in sources or [])
    if not where:
        key = sample.get("__key__") if isinstance(sample, dict) else getattr(sample, "__key__", None)
        where = f"key {key or getattr(exc, 'key', None)}"
    # webdataset's DecodingError carries no message; what went wrong is its cause.
    detail = str(exc) or str(exc.__cause__ or "")
    log.warning("skipped a bad sample (%s): %s: %s", where, type(exc).__name__, detail)


def take_bad_sample_count() -> int:
    global _bad_samples
    count, _bad_samples = _bad_samples, 0
    return count


class LlavaTaskEncoder(TaskEncoder[Sample, EncodedSample, LlavaBatch, LlavaBatch]):
    """Conversations -> `LlavaBatch`es for one checkpoint's tokenizer, image processor and model."""

    # Images stay PIL, in their own mode, until the image processor sees them, as in HF LLaVA's processor.
    decoder = ImageModeKeepingDecoder()

    def __init__(
        self,
        tokenizer_dir: str,
        *,
        seq_length: int,
        img_seq_len: int,
        image_token_index: int,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        lang: str = "en",
        family_template: str | None = None,
        image_aspect: str = "crop",
        packing_seq_length: int | None = None,
        alignment: SequenceAlignment = SequenceAlignment(),
        tiled_model=None,
        video_frames: int = 32,
        max_tiles: int | None = None,
    ):
        """`tiled_model`: the `LlavaArch` of a tiled model (its images are tiled, its videos
        decoded to `video_frames` frames); None: LLaVA-1.5's one image per image token."""
        tokenizer = hf_loading.load_tokenizer(str(tokenizer_dir), "--tokenizer-load-dir")
        image_processor = hf_loading.load_image_processor(str(tokenizer_dir), "--tokenizer-load-dir")
        # A tiled model's images are tiled as its processor tiles them (`--image-aspect` does not apply).
        self.images = ImagePreprocessor(image_processor, image_aspect) if tiled_model is None else None
        self.media = None
        if tiled_model is not None:
            frames = None
            if tiled_model.tiling.video_token_index is not None:  # a model that takes videos
                frames = load_frame_settings(tokenizer_dir, "--tokenizer-load-dir", image_processor)
            self.media = TiledMedia(image_processor, tokenizer, tiled_model, video_frames, frames)
        self.template_name, template = resolve_chat_template(chat_template, lang, tokenizer,
                                                                    family_default=family_template)
        self.chat = ChatTokenizer(tokenizer, template, image_token_index)
        self.pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if self.pad_token_id is None:
            raise UserError("the tokenizer has no pad token; give --pad-token-id")
        if packing_seq_length is not None and packing_seq_length > seq_length:
            raise UserError(f"--packing-seq-length {packing_seq_length} exceeds --seq-length {seq_length}, the model's sequence length")
        if seq_length % alignment.total:
            raise UserError(f"--seq-length {seq_length} must be a multiple of {alignment.total} (the parallel layout's "
                            "sequence alignment)")
        self.packing = packing_seq_length is not None
        self.layout = BatchLayout(
            pad_token_id=self.pad_token_id, image_token_index=image_token_index, img_seq_len=img_seq_len,
            max_length=packing_seq_length or seq_length, alignment=alignment,
            image_shape=tuple(self.images([Image.new("RGB", (8, 8))]).shape[1:]) if self.media is None
            else (3, tiled_model.vision.image_size, tiled_model.vision.image_size),
            video_token_index=None if self.media is None else self.media.video_token, max_tiles=max_tiles,
        )
        if img_seq_len + 2 > self.layout.sample_limit:
            raise UserError(f"a sequence of {self.layout.max_length} cannot hold an image ({img_seq_len} positions) "
                            "and an answer")

    @classmethod
    def for_model(cls, tokenizer_dir: str, arch, **kwargs) -> "LlavaTaskEncoder":
        """Encoder for a model described by a `LlavaArch` (image token and count from it, chat
        template default from its text family)."""
        from megatron_ext import families

        return cls(tokenizer_dir, img_seq_len=arch.img_seq_len, image_token_index=arch.image_token_index,
                   family_template=families.of(arch).text.chat_template,
                   tiled_model=arch if arch.tiling is not None else None, **kwargs)

    @stateless
    def preencode_sample(self, sample: Sample) -> EncodedSample:
        images, messages = conversation_of(sample)
        return self.encode_conversation(sample, messages, images, videos_of(sample))

    def encode_conversation(self, sample: Sample, messages: list[dict], images: list, videos: list,
                            completion: bool = False) -> EncodedSample:
        """One conversation's tokens, labels, loss mask and media, fitted to the sequence length
        (`completion`: as `ChatTokenizer.encode`)."""
        ids, assistant = self.chat.encode(messages, completion)
        media = ()
        if self.media is not None:
            ids, assistant, group = self.media.expand(ids, assistant, images, videos, sample.__key__)
            # A text-only conversation has no group: nothing for the vision tower.
            images, media = ([group], group.media) if group.media else ([], [])
        elif videos:
            raise ValueError("the sample has a video, which this model does not take")
        labels = np.append(ids[1:], self.pad_token_id)
        # Position t is trained when the token it predicts (t + 1) is the assistant's.
        loss_mask = np.append(assistant[1:], False)
        keep = self.layout.fitting_tokens(ids)
        truncated = keep < len(ids)
        if truncated:
            ids, labels, loss_mask = ids[:keep], labels[:keep], loss_mask[:keep]
        # The last token's successor is not part of this sample (or of the packed sequence).
        labels[-1], loss_mask[-1] = self.pad_token_id, False
        if not loss_mask.any():
            raise ValueError(f"no answer token fits in the sequence length {self.layout.max_length}")
        return self.layout.sample(sample, ids, labels, loss_mask, images, truncated, media)

    @stateless
    def postencode_sample(self, sample: EncodedSample) -> EncodedSample:
        if sample.images and self.media is not None:
            sample.images = [tile for group in sample.images for tile in self.media.tiles(group)]
        elif sample.images:
            sample.images = list(self.images(sample.images))
        return sample

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        return self.layout.packs(samples)

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
        return self.layout.pack(samples)

    @stateless
    def batch(self, samples: list[EncodedSample]) -> LlavaBatch:
        return self.layout.batch(samples, num_skipped=take_bad_sample_count())
