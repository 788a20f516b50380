"""megatron-core's LLaVA input assembly from a layout the host computes, so the device never waits.

megatron-core's `LLaVAModel._preprocess_data` finds where the image tokens are on the device
(`torch.where`, `.tolist()`, boolean-mask assignments) and so stops the host about 21 times per
micro batch on a GPU, plus twice in backward (an H200 under CUDA's sync debug mode,
`bench/gpu_profile.py --find-syncs`); each stop drains the queue and the host relaunches the tower
and every layer from an empty one. Everything it computes follows from the token ids, labels and
loss mask, which the host holds before they cross to the device (`model.inputs`). So the host
computes it (`combined_layout`, the same torch expressions run on host tensors), and the model
(`LaidOutLLaVAModel`) only gathers: one `index_select` over [text embeddings; image features;
a zero row] puts every combined position's embedding in place, and its backward is a scatter of
the gradient, equal to megatron-core's. Labels and loss mask arrive finished.

Without a layout (generation, or a caller that gives none) the model is megatron-core's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.models.multimodal.llava_model import IGNORE_INDEX, LLaVAModel


@dataclass(frozen=True)
class CombinedLayout:
    """Where each position of the image-expanded (combined) sequence takes its embedding from.

    `source` [b, s] indexes the rows of cat(text embeddings [b * t], image features in the order
    megatron-core fills them, one zero row): the row each position copies. `labels` and
    `loss_mask` [b, s] are the combined sequence's. `image_rows`: how many image feature rows the
    layout places (the model checks the tower gave as many). `loss_positions`: where the loss mask
    is set, as flat indices in the [s, b] order of hidden states (at least one position, so the
    output layer always takes part), when the model computes logits there only (`loss_positions.py`)."""
    source: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    image_rows: int
    loss_positions: torch.Tensor | None = None

    def to(self, move) -> "CombinedLayout":
        """The same layout with each tensor passed through `move` (to the device)."""
        positions = None if self.loss_positions is None else move(self.loss_positions)
        return CombinedLayout(move(self.source), move(self.labels), move(self.loss_mask), self.image_rows, positions)


def combined_layout(input_ids: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, image_token_index: int,
                    img_seq_len: int, max_length: int, pad_to_max: bool, loss_positions: bool = False) -> CombinedLayout:
    """megatron-core's `_preprocess_data` for one tile per image token (every caller of ours),
    on host tensors: each image token widened to `img_seq_len` positions, rows padded to the
    longest (with pipeline parallelism to `max_length`), cut at `max_length`; with
    `loss_positions`, also where the loss is taken."""
    batch, text_len = input_ids.shape
    image = input_ids == image_token_index
    # Each token's last combined position (megatron-core's new_position_ids).
    last = torch.where(image, img_seq_len, 1).cumsum(-1) - 1
    seq_lens = last[:, -1] + 1
    length = max(int(seq_lens.max()), max_length) if pad_to_max else int(seq_lens.max())
    rows, cols = torch.where(~image)
    text_positions = last[rows, cols]
    text = torch.zeros(batch, length, dtype=torch.bool)
    text[rows, text_positions] = True
    images = (torch.arange(length)[None] < seq_lens[:, None]) & ~text
    image_rows = int(images.sum())
    source = torch.full((batch, length), batch * text_len + image_rows)  # the zero row
    source[rows, text_positions] = rows * text_len + cols
    source[images] = batch * text_len + torch.arange(image_rows)
    final_labels = _labels(labels, rows, cols, text_positions, seq_lens, length)
    final_mask = _loss_mask(loss_mask, image, last, rows, cols, text_positions, images, length)
    cut = slice(0, min(length, max_length))
    final_mask = final_mask[:, cut].contiguous()
    positions = _positions(final_mask) if loss_positions else None
    return CombinedLayout(source[:, cut].contiguous(), final_labels[:, cut].contiguous(), final_mask, image_rows,
                          positions)


def _positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """Flat [s * b] indices of the set entries of a [b, s] mask; position 0 when none is set."""
    positions = torch.nonzero(loss_mask.t().reshape(-1)).reshape(-1)
    return positions if positions.numel() else torch.zeros(1, dtype=torch.long)


def _labels(labels, rows, cols, text_positions, seq_lens, length) -> torch.Tensor:
    """Labels shift left by one position; the last text label stays at each row's end."""
    out = torch.full((labels.shape[0], length), IGNORE_INDEX, dtype=labels.dtype)
    shifted = text_positions - 1
    valid_position, valid_col = shifted >= 0, cols - 1 >= 0
    source_rows = rows[valid_position]
    out[source_rows, shifted[valid_position]] = labels[source_rows, (cols - 1)[valid_col]]
    batch = torch.arange(labels.shape[0])
    out[batch, seq_lens - 1] = labels[batch, -1]
    return out


def _loss_mask(loss_mask, image, last, rows, cols, text_positions, images, length) -> torch.Tensor:
    """The text tokens' mask at their positions; image positions and the token just before an
    image (it would predict the image's first feature) are masked out."""
    out = torch.zeros(loss_mask.shape[0], length, dtype=loss_mask.dtype)
    out[rows, text_positions] = loss_mask[rows, cols]
    out[images] = 0
    image_rows, image_cols = torch.where(image)
    before = image_cols - 1 >= 0
    out[image_rows[before], last[image_rows[before], image_cols[before] - 1]] = 0
    return out


class LaidOutLLaVAModel(LLaVAModel):
    """megatron-core's LLaVAModel taking `layout=` (a `CombinedLayout` on the model's device) in
    forward; subclasses that rearrange image features (the tiled model) do so before this runs.
    A layout with loss positions has the last stage compute logits only there (`loss_positions`)."""

    _combined: CombinedLayout | None = None
    logits_where_loss = False  # set by the provider from ModelExecution: ModelInputs asks for positions

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._loss_positions = None
        if self.add_decoder and self.post_process:
            from megatron_ext.model import loss_positions

            self._loss_positions = loss_positions.attach(self.language_model)

    def forward(self, *args, layout: CombinedLayout | None = None, vision_features: torch.Tensor | None = None,
                **kwargs):
        """`vision_features`: the vision tower's output for this micro batch's images, computed once
        per step (`step_vision`); megatron-core's forward takes it where it would call the tower."""
        self._combined = layout
        if self._loss_positions is not None and layout is not None and kwargs.get("labels") is not None:
            self._loss_positions.positions = layout.loss_positions
        if vision_features is not None:
            # An instance attribute shadows the tower's forward for this call only (removed below).
            self.vision_model.forward = lambda images: vision_features
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._combined = None
            if self.vision_model is not None:
                self.vision_model.__dict__.pop("forward", None)
            if self._loss_positions is not None:
                self._loss_positions.positions = None

    def _preprocess_data(self, image_embeddings, language_embeddings, input_ids, loss_mask, labels, *args, **kwargs):
        layout = self._combined
        if layout is None or not (self.pre_process or self.post_process):
            return super()._preprocess_data(image_embeddings, language_embeddings, input_ids, loss_mask, labels,
                                            *args, **kwargs)
        embedding = self._gather(layout, image_embeddings, language_embeddings) if self.pre_process else None
        if self.post_process and labels is not None:
            return embedding, layout.labels, layout.loss_mask
        return embedding, None, None

    def _gather(self, layout: CombinedLayout, image_embeddings, language_embeddings) -> torch.Tensor:
        """[s, b, h] (megatron-core's layout; [b, s, h] under context parallelism)."""
        hidden = language_embeddings.shape[-1]
        parts = [language_embeddings.reshape(-1, hidden)]
        if image_embeddings is not None and image_embeddings.numel() > 0:
            # [img_seq_len, tiles, h] -> tiles in order, each tile's positions in order.
            parts.append(image_embeddings.permute(1, 0, 2).reshape(-1, hidden))
        features = sum(p.shape[0] for p in parts[1:])
        if features != layout.image_rows:
            raise ValueError(f"the images give {features} feature rows, the image tokens take {layout.image_rows}")
        parts.append(language_embeddings.new_zeros(1, hidden))
        # Gathered in the model's order rather than transposed after: a transposed [s, 1, h] lacks a contiguous
        # tensor's strides, and each compiled layer would recompile for them.
        order = layout.source if self.context_parallel_lm != 1 else layout.source.t()
        return torch.cat(parts).index_select(0, order.reshape(-1)).view(*order.shape, hidden)
