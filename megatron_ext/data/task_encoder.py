"""The energon task encoder that turns VQA samples into LLaVA training batches.

Input: a decoded `VQASample` whose `context` is the question string, or, for multi-turn samples
written by `scripts/data/build_energon_dataset.py`, the LLaVA turns (the field map
``context: json[conversations],json[question]`` picks them), and `answers` the answer text.

Steps (energon calls them in this order):
1. `preencode_sample`: chat template -> token ids with ONE image token per image, next-token
   labels, and a loss mask that is 1 only where the token to predict is the assistant's
   (every assistant turn, with its end-of-turn token); truncation to the sequence length;
2. `select_samples_to_pack` / `pack_selected_samples` (packing only): greedy knapsack over
   energon's packing buffer (`packing.knapsack_bins`), then concatenation;
3. `postencode_sample`: the checkpoint's own HF image processor (CLIP / SigLIP), through
   `images.ImagePreprocessor`, so pixels are what HF LLaVA sees;
4. `batch`: padding and stacking into a `LlavaBatch`.

Batch contract (`LlavaBatch`, consumed by the trainer), B rows of T tokens:
- images       float [N_img, 3, H, W]  every image of the micro batch in order of appearance
                                       (row by row); N_img may be 0
- input_ids    long  [B, T]  one `image_token_index` per image; padding = pad_token_id
- labels       long  [B, T]  labels[b, t] = token after position t (pad_token_id where ignored)
- loss_mask    float [B, T]  1 where labels[b, t] is an assistant token; 0 for prompts, system
                             text, image tokens, the last token of every packed sample, padding
- segment_ids  long  [B, T]  1..k: which packed sample a token belongs to; 0 = padding
- position_ids long  [B, T]  position of the token within its own sample in the combined
                             (image-expanded) sequence; 0 for padding. For the TE path only:
                             RoPE is relative, so the local path needs no restarting positions.
- num_samples, num_truncated, num_skipped: ints for the trainer's log. num_skipped counts the
  samples the energon error handler (`count_bad_sample`) dropped in the worker that built
  this batch since its previous batch (corrupt images, untrainable conversations, ...).

Lengths are counted in the combined space: a sample fits when its tokens plus (img_seq_len - 1)
per image fit in the sequence length. Truncation cuts text at the end, never inside (or before)
an image; a sample whose image or whole answer would be cut off is dropped as a bad sample.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from megatron.energon import Batch, Sample, SampleDecoder, TaskEncoder, VQASample, edataclass, stateless
from PIL import Image

from megatron_ext.data.chat_template import ChatTokenizer, resolve_chat_template
from megatron_ext.data.conversation import place_images, sample_messages
from megatron_ext.data.images import ImagePreprocessor
from megatron_ext.data.packing import knapsack_bins
from megatron_ext.errors import UserError
from megatron_ext.hf import loading

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


def _take_bad_sample_count() -> int:
    global _bad_samples
    count, _bad_samples = _bad_samples, 0
    return count


@edataclass
class EncodedSample(Sample):
    """One conversation, or several packed into one sequence."""

    input_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long
    loss_mask: torch.Tensor  # [L] float
    lengths: list[int]  # tokens of each packed conversation, in order
    images: list  # PIL images until postencode_sample, then [n, 3, H, W] float tensors
    num_truncated: int


@edataclass
class LlavaBatch(Batch):
    images: torch.Tensor
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    segment_ids: torch.Tensor
    position_ids: torch.Tensor
    num_samples: int
    num_truncated: int
    num_skipped: int


class LlavaTaskEncoder(TaskEncoder[VQASample, EncodedSample, LlavaBatch, LlavaBatch]):
    """VQA samples -> `LlavaBatch`es for one checkpoint's tokenizer, image processor and model."""

    # Images stay PIL until the HF image processor sees them, as HF LLaVA's processor does.
    decoder = SampleDecoder(image_decode="pil")

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
        packing_seq_length: int | None = None,
    ):
        tokenizer = loading.load_tokenizer(str(tokenizer_dir), "--tokenizer-load-dir")
        self.images = ImagePreprocessor(loading.load_image_processor(str(tokenizer_dir), "--tokenizer-load-dir"))
        self.template_name, template = resolve_chat_template(chat_template, lang, tokenizer)
        self.chat = ChatTokenizer(tokenizer, template, image_token_index)
        self.pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if self.pad_token_id is None:
            raise UserError("the tokenizer has no pad token; give --pad-token-id")
        if packing_seq_length is not None and packing_seq_length > seq_length:
            raise UserError(f"--packing-seq-length {packing_seq_length} exceeds --seq-length {seq_length}, the model's sequence length")
        self.packing = packing_seq_length is not None
        self.max_length = packing_seq_length or seq_length
        self.img_seq_len = img_seq_len
        self.image_token_index = image_token_index
        if img_seq_len + 2 > self.max_length:
            raise UserError(f"a sequence of {self.max_length} cannot hold an image ({img_seq_len} positions) and an answer")
        # Shape of a processed image, for batches that hold none.
        self.image_shape = tuple(self.images([Image.new("RGB", (8, 8))]).shape[1:])

    @classmethod
    def for_model(cls, tokenizer_dir: str, arch, **kwargs) -> "LlavaTaskEncoder":
        """Encoder for a model described by a `LlavaArch` (image token and count from it)."""
        return cls(tokenizer_dir, img_seq_len=arch.img_seq_len, image_token_index=arch.image_token_index, **kwargs)

    def combined_length(self, sample: EncodedSample) -> int:
        return len(sample.input_ids) + len(sample.images) * (self.img_seq_len - 1)

    @stateless
    def preencode_sample(self, sample: VQASample) -> EncodedSample:
        images = [sample.image] if sample.image is not None else []
        messages = place_images(sample_messages(sample.context, sample.answers), len(images))
        ids, assistant = self.chat.encode(messages)
        labels = np.append(ids[1:], self.pad_token_id)
        # Position t is trained when the token it predicts (t + 1) is the assistant's.
        loss_mask = np.append(assistant[1:], False)
        keep = self._fitting_tokens(ids)
        truncated = keep < len(ids)
        if truncated:
            ids, labels, loss_mask = ids[:keep], labels[:keep], loss_mask[:keep]
        # The last token's successor is not part of this sample (or of the packed sequence).
        labels[-1], loss_mask[-1] = self.pad_token_id, False
        if not loss_mask.any():
            raise ValueError(f"no answer token fits in the sequence length {self.max_length}")
        return EncodedSample.derive_from(
            sample,
            input_ids=torch.from_numpy(ids),
            labels=torch.from_numpy(labels),
            loss_mask=torch.from_numpy(loss_mask.astype(np.float32)),
            lengths=[len(ids)],
            images=images,
            num_truncated=int(truncated),
        )

    def _fitting_tokens(self, ids: np.ndarray) -> int:
        """How many leading tokens fit in max_length; never cuts an image (a bad sample then)."""
        ends = np.cumsum(np.where(ids == self.image_token_index, self.img_seq_len, 1))
        keep = int(np.searchsorted(ends, self.max_length, side="right"))
        if (ids[keep:] == self.image_token_index).any():
            raise ValueError(f"an image does not fit in the sequence length {self.max_length}")
        return keep

    @stateless
    def postencode_sample(self, sample: EncodedSample) -> EncodedSample:
        if sample.images:
            sample.images = list(self.images(sample.images))
        return sample

    def select_samples_to_pack(self, samples: list[EncodedSample]) -> list[list[EncodedSample]]:
        lengths = [self.combined_length(s) for s in samples]
        return [[samples[i] for i in bin_] for bin_ in knapsack_bins(lengths, self.max_length)]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedSample]) -> EncodedSample:
        return EncodedSample.derive_from(
            samples[0],
            __key__=",".join(s.__key__ for s in samples),
            input_ids=torch.cat([s.input_ids for s in samples]),
            labels=torch.cat([s.labels for s in samples]),
            loss_mask=torch.cat([s.loss_mask for s in samples]),
            lengths=[n for s in samples for n in s.lengths],
            images=[image for s in samples for image in s.images],
            num_truncated=sum(s.num_truncated for s in samples),
        )

    @stateless
    def batch(self, samples: list[EncodedSample]) -> LlavaBatch:
        width = max(len(s.input_ids) for s in samples)
        shape = (len(samples), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, self.pad_token_id, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.float32)
        segment_ids = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s.input_ids)
            input_ids[row, :n], labels[row, :n], loss_mask[row, :n] = s.input_ids, s.labels, s.loss_mask
            lengths = torch.tensor(s.lengths)
            segment_ids[row, :n] = torch.repeat_interleave(torch.arange(1, len(s.lengths) + 1), lengths)
            position_ids[row, :n] = self._positions(s.input_ids, lengths)
        images = [image for s in samples for image in s.images]
        return LlavaBatch(
            __key__=[s.__key__ for s in samples],
            __restore_key__=(),
            images=torch.stack(images) if images else torch.zeros((0, *self.image_shape)),
            input_ids=input_ids,
            labels=labels,
            loss_mask=loss_mask,
            segment_ids=segment_ids,
            position_ids=position_ids,
            num_samples=sum(len(s.lengths) for s in samples),
            num_truncated=sum(s.num_truncated for s in samples),
            num_skipped=_take_bad_sample_count(),
        )

    def _positions(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Combined-space start position of each token, restarting at 0 for every packed sample."""
        widths = torch.where(input_ids == self.image_token_index, self.img_seq_len, 1)
        starts = torch.cumsum(widths, 0) - widths
        sample_start = torch.repeat_interleave(starts[torch.cumsum(lengths, 0) - lengths], lengths)
        return starts - sample_start
