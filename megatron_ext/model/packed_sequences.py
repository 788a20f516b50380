"""Packed sequences in the model's combined space: lengths, and the attention that keeps samples apart.

Batches carry ONE image token per image (megatron-core's LLaVAModel expands it into
`img_seq_len` embeddings itself), so lengths and masks here are computed in the model's
*combined* space, where an image token is `img_seq_len` positions wide.

Two ways to confine attention to each packed sample (`model.inputs` picks one per backend):
- `packed_attention_mask`: a bool mask [B, 1, S, S] (True = masked out), block-diagonal causal.
  megatron's local DotProductAttention honours it (`FusedScaleMaskSoftmax` applies a given mask
  instead of its own causal one), and so does the sdpa backend.
- `thd_boundaries`: where each sample starts in a one-row micro batch, for THD attention
  (Transformer Engine, and the sdpa backend) through megatron-core's `PackedSeqParams`.
"""

from __future__ import annotations

import torch


def token_widths(input_ids: torch.Tensor, image_token_index: int, img_seq_len: int) -> torch.Tensor:
    """Positions each token occupies in the combined sequence (img_seq_len for an image token)."""
    return torch.where(input_ids == image_token_index, img_seq_len, 1)


def combined_seq_len(input_ids: torch.Tensor, image_token_index: int, img_seq_len: int, max_len: int,
                     pad_to_max: bool = False) -> int:
    """The combined length LLaVAModel gives a batch: its longest row with images expanded, cut
    to the model's `max_len`; with pipeline parallelism (`pad_to_max`) always `max_len`."""
    if pad_to_max:
        return max_len
    return min(int(token_widths(input_ids, image_token_index, img_seq_len).sum(1).max()), max_len)


def combined_segment_ids(input_ids: torch.Tensor, segment_ids: torch.Tensor, image_token_index: int,
                         img_seq_len: int, seq_len: int) -> torch.Tensor:
    """[B, seq_len] segment id of every combined position (0 = padding), truncated or 0-padded
    to `seq_len` as LLaVAModel truncates or pads its combined sequence. Computed where the inputs
    are (on the GPU for the model's masks), with no value read back to the host."""
    ends = token_widths(input_ids, image_token_index, img_seq_len).cumsum(1)
    positions = torch.arange(seq_len, device=input_ids.device).expand(input_ids.shape[0], seq_len).contiguous()
    token = torch.searchsorted(ends, positions, right=True)  # the token holding each position
    # Past a row's last token (index = its length): padding.
    return torch.nn.functional.pad(segment_ids, (0, 1)).gather(1, token)


def packed_attention_mask(input_ids: torch.Tensor, segment_ids: torch.Tensor, image_token_index: int,
                          img_seq_len: int, seq_len: int) -> torch.Tensor:
    """Bool attention mask [B, 1, seq_len, seq_len], True where attention is NOT allowed, on the
    inputs' device (give it the model's copies: the mask is never built on the host for a GPU).

    `seq_len` is the combined length LLaVAModel computes: the longest row's tokens plus
    (img_seq_len - 1) per image, capped at, or with pipeline parallelism padded to, the model's
    sequence length. A position sees the earlier positions of its own sample; padding sees only
    itself, so no softmax row is empty.
    """
    segments = combined_segment_ids(input_ids, segment_ids, image_token_index, img_seq_len, seq_len)
    same = segments[:, :, None] == segments[:, None, :]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=segments.device).tril()
    allowed = same & causal & (segments[:, :, None] > 0)
    allowed |= torch.eye(seq_len, dtype=torch.bool, device=segments.device)
    return (~allowed).unsqueeze(1)


def thd_boundaries(input_ids: torch.Tensor, segment_ids: torch.Tensor, image_token_index: int,
                   img_seq_len: int, seq_len: int) -> list[int]:
    """cu_seqlens of a one-row micro batch: the combined position where each sample starts, then
    `seq_len`. Padding after a sample (alignment or the row's end) belongs to that sample's
    sub-sequence: nothing before it attends to it, and its own outputs carry no loss. Read from
    the host batch token by token (a few microseconds; no position-sized tensor)."""
    if input_ids.shape[0] != 1:
        raise ValueError("THD attention takes one sequence per micro batch (--micro-batch-size 1)")
    widths = token_widths(input_ids[0], image_token_index, img_seq_len)
    token_starts = widths.cumsum(0) - widths
    segments = segment_ids[0]
    previous = torch.cat([segments.new_zeros(1), segments[:-1]])
    starts = token_starts[(segments > 0) & (segments != previous)].tolist()
    return sorted({0, *(start for start in starts if start < seq_len), seq_len})


def sample_lengths(input_ids: torch.Tensor, segment_ids: torch.Tensor, image_token_index: int,
                   img_seq_len: int) -> torch.Tensor:
    """Combined length of every sample of a batch (padding excluded), row by row."""
    widths = token_widths(input_ids, image_token_index, img_seq_len)
    return torch.cat([torch.bincount(segment_ids[row], weights=widths[row].double())[1:]
                      for row in range(input_ids.shape[0])]).long()
