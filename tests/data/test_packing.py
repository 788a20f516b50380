"""Packing and alignment: the knapsack, the block-diagonal mask, THD boundaries, padded lengths.
Loss equality through the Megatron model: tests/model/test_backends.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ext.data.packing import knapsack_bins
from megatron_ext.model.packed_sequences import combined_segment_ids, combined_seq_len, packed_attention_mask

WORKER = Path(__file__).with_name("packing_equivalence_worker.py")


def test_knapsack_places_every_sample_once_within_capacity():
    lengths = [70, 10, 55, 40, 30, 25, 100, 5, 60]
    bins = knapsack_bins(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    assert [sum(lengths[i] for i in b) for b in bins] == [100, 100, 100, 95]
    assert knapsack_bins([150, 20], 100) == [[1], [0]]


def test_knapsack_fills_bins_where_first_fit_decreasing_leaves_gaps():
    # First-fit-decreasing: [40, 35] (75), [35, 30, 30] (95), [30]: three bins. Two are enough.
    lengths = [40, 35, 35, 30, 30, 30]
    bins = knapsack_bins(lengths, 100)
    assert [sum(lengths[i] for i in b) for b in bins] == [100, 100]


def test_mask_is_block_diagonal_causal_in_the_image_expanded_sequence():
    image = 99
    # Row 0: sample 1 = [a, IMG, b], sample 2 = [c, d]; row 1: one sample [e, f] then padding.
    input_ids = torch.tensor([[1, image, 2, 3, 4], [5, 6, 0, 0, 0]])
    segments = torch.tensor([[1, 1, 1, 2, 2], [1, 1, 0, 0, 0]])
    seq = combined_seq_len(input_ids, image, 3, max_len=100)
    assert seq == 7
    assert combined_segment_ids(input_ids, segments, image, 3, seq).tolist() == [[1, 1, 1, 1, 1, 2, 2], [1, 1, 0, 0, 0, 0, 0]]
    allowed = ~packed_attention_mask(input_ids, segments, image, 3, seq)[:, 0]
    expected_row0 = torch.zeros(7, 7, dtype=torch.bool)
    expected_row0[:5, :5] = torch.ones(5, 5, dtype=torch.bool).tril()
    expected_row0[5:, 5:] = torch.ones(2, 2, dtype=torch.bool).tril()
    assert torch.equal(allowed[0], expected_row0)
    # Padding attends only to itself (no empty softmax row) and nobody attends to it.
    assert torch.equal(allowed[1, 2:, :], torch.eye(7, dtype=torch.bool)[2:])
    assert not allowed[1, :2, 2:].any()
    # With pipeline parallelism the model pads to its sequence length; the mask follows.
    assert packed_attention_mask(input_ids, segments, image, 3, 9).shape == (2, 1, 9, 9)


def _layout(alignment):
    from megatron_ext.data.batching import BatchLayout

    return BatchLayout(pad_token_id=0, image_token_index=99, img_seq_len=5, max_length=64, image_shape=(3, 2, 2),
                       alignment=alignment)


def _samples(layout, texts):
    """Encoded samples from token lists (99 = an image, expanded to 5 positions); every token trained."""
    import numpy as np
    from megatron.energon import Sample

    samples = []
    for i, ids in enumerate(texts):
        ids = np.array(ids)
        images = [torch.zeros(3, 2, 2)] * int((ids == 99).sum())
        samples.append(layout.sample(Sample(__key__=str(i), __restore_key__=()), ids, ids + 1, ids != 99, images, False))
    return samples


@pytest.mark.parametrize("alignment", [(1, 1), (16, 4), (8, 1)])
def test_thd_boundaries_are_the_blocks_of_the_mask_and_aligned(alignment):
    """A packed micro batch with images: the THD sub-sequences hold exactly the positions the
    block-diagonal mask lets attend to each other; with context parallelism (per-sample 4) and
    FP8 (16), every sub-sequence and the whole row have the lengths those need."""
    from megatron_ext.model.inputs import ModelInputs
    from megatron_ext.model.sequence_alignment import SequenceAlignment

    layout = _layout(SequenceAlignment(*alignment))
    samples = _samples(layout, [[1, 99, 2, 3], [4, 5, 6], [7, 99, 8, 9, 10, 11, 99, 12]])
    batch = layout.batch([layout.pack(samples)])
    inputs = ModelInputs(99, 5, 64, False, "sdpa", torch.float32, torch.device("cpu"))
    length = inputs.combined_length(batch.input_ids)
    params = inputs(batch.as_dict())["packed_seq_params"]
    bounds = params.cu_seqlens_q_padded.tolist()
    assert bounds == params.cu_seqlens_q.tolist() and bounds[0] == 0 and bounds[-1] == length
    assert length % alignment[0] == 0
    assert all((b - a) % alignment[1] == 0 for a, b in zip(bounds[:-2], bounds[1:-1]))
    assert params.max_seqlen_q == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))

    thd_segment = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
    segments = combined_segment_ids(batch.input_ids, batch.segment_ids, 99, 5, length)[0]
    real = segments > 0
    assert segments[real].unique().numel() == len(bounds) - 1 == 3
    allowed = ~packed_attention_mask(batch.input_ids, batch.segment_ids, 99, 5, length)[0, 0]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same_thd = thd_segment[:, None] == thd_segment[None, :]
    pairs = real[:, None] & real[None, :] & causal
    assert torch.equal(allowed[pairs], same_thd[pairs])


def test_alignment_pads_samples_and_batches_with_padding_outside_every_sample():
    from megatron_ext.model.packed_sequences import sample_lengths
    from megatron_ext.model.sequence_alignment import SequenceAlignment

    layout = _layout(SequenceAlignment(total=16, per_sample=4))
    a, b = _samples(layout, [[1, 99, 2], [3, 4, 5, 6, 7]])
    assert (a.lengths, a.pads, b.lengths, b.pads) == ([3], [1], [5], [3])  # 7 -> 8 and 5 -> 8 positions
    assert a.loss_mask.tolist()[-1] == 0 and a.input_ids.tolist()[-1] == 0
    batch = layout.batch([layout.pack([a, b])])
    assert batch.segment_ids.tolist() == [[1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0, 0]]
    assert combined_seq_len(batch.input_ids, 99, 5, 64) == 16
    assert sample_lengths(batch.input_ids, batch.segment_ids, 99, 5).tolist() == [7, 5]
    # Rows of an unpacked micro batch: the widest row with the most images sets the aligned length.
    rows = layout.batch([a, b])
    assert combined_seq_len(rows.input_ids, 99, 5, 64) == 16 and rows.input_ids.shape[1] == 12


@pytest.mark.parametrize("tp,cp,sp,fp8,expected", [
    (4, 1, False, False, (1, 1)),
    (4, 1, True, False, (4, 1)),
    (1, 2, False, False, (4, 4)),
    (2, 2, True, False, (8, 4)),
    (1, 1, False, True, (16, 1)),
    (4, 1, False, True, (16, 1)),
    (8, 1, True, True, (128, 1)),  # 16 tokens on each of the 8 sequence-parallel ranks
    (32, 1, True, True, (512, 1)),
    (1, 4, False, True, (64, 8)),
    (2, 4, True, True, (128, 8)),
])
def test_sequence_alignment_is_what_sp_cp_and_fp8_need(tp, cp, sp, fp8, expected):
    from megatron_ext.model.sequence_alignment import sequence_alignment

    alignment = sequence_alignment(tp, cp, sp, fp8)
    assert (alignment.total, alignment.per_sample) == expected
    if fp8:  # every rank's share of a micro batch is a multiple of 16 tokens
        assert alignment.total // ((tp if sp else 1) * cp) % 16 == 0
