"""Packing: the knapsack, the block-diagonal mask, and loss equality through the Megatron model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.data.packing import combined_segment_ids, combined_seq_len, knapsack_bins, packed_attention_mask
from tests.helpers import child_env

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


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_packed_loss_equals_token_weighted_unpacked_loss(tmp_path, llava_clip):
    out = tmp_path / "packing.json"
    proc = subprocess.run([sys.executable, str(WORKER), str(llava_clip), str(out)], capture_output=True, text=True,
                          timeout=240, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert max(result["pack_sizes"]) >= 3
    assert result["packed_tokens"] == result["unpacked_tokens"] == result["batch_tokens"]
    assert result["packed_loss"] == pytest.approx(result["unpacked_loss"], rel=1e-5)
    # Without the mask, packed samples see each other and the loss changes.
    assert abs(result["causal_only_loss"] - result["unpacked_loss"]) > 1e-3
