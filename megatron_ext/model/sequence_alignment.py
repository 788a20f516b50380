"""Sequence lengths in the image-expanded (combined) sequence: a sample's, and the multiples the
parallel layout needs.

The task encoder pads samples and micro batches to them; the launcher and the trainer check
--seq-length against them. Imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# TE's FP8 GEMMs take token counts that are multiples of 16.
FP8_MULTIPLE = 16


@dataclass(frozen=True)
class SequenceAlignment:
    """Lengths (in the image-expanded sequence) that the parallel layout needs.

    `total`: the language-model sequence of every micro batch is a multiple of this (sequence
    parallelism splits it over TP ranks, context parallelism into 2 x CP chunks, FP8 GEMMs want 16
    tokens on every rank).
    `per_sample`: every packed sample is a multiple of this (context parallelism splits each THD
    sub-sequence into 2 x CP chunks).
    """

    total: int = 1
    per_sample: int = 1


def sequence_alignment(tp: int, cp: int, sequence_parallel: bool, fp8: bool) -> SequenceAlignment:
    # megatron-core's LLaVAModel asserts exactly these factors for SP, CP and both together.
    factor = (tp if sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
    # FP8 casts each rank's share of the sequence (SP splits it over TP, CP over CP ranks): the
    # share, not only the whole, must be a multiple of 16.
    ranks_sharing = (tp if sequence_parallel else 1) * cp
    total = math.lcm(factor, FP8_MULTIPLE * ranks_sharing) if fp8 else factor
    return SequenceAlignment(total=total, per_sample=2 * cp if cp > 1 else 1)


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def combined_length(num_tokens: int, num_images: int, img_seq_len: int) -> int:
    """Positions a token sequence takes in the language model once LLaVAModel expands each of its
    `num_images` image tokens into `img_seq_len` image embeddings."""
    return num_tokens + num_images * (img_seq_len - 1)
