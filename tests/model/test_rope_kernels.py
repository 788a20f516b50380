"""RoPE over packed sequences without host reads: the same numbers as megatron-core's THD path, and it
runs on `meta` (which refuses every read of a value), where megatron-core's own path does not."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.model.rope_kernels import positions_in_sequences, rotary_thd

CU = torch.tensor([0, 4, 6, 11], dtype=torch.int32)


def _freqs(rows: int, dim: int = 8) -> torch.Tensor:
    inverse = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.outer(torch.arange(rows).float(), inverse)
    return torch.cat([angles, angles], -1)[:, None, None, :]


def test_positions_restart_in_each_sequence():
    assert positions_in_sequences(CU, 11).tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("rows", [5, 11], ids=["per-sequence", "whole-row"])
def test_equals_megatron_cores_thd_rope(rows):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    t = torch.randn(11, 3, 8, generator=torch.Generator().manual_seed(rows))
    expected = _apply_rotary_pos_emb_thd(t, CU, _freqs(rows), cp_group=_single_group())
    assert torch.equal(rotary_thd(t, CU, _freqs(rows)), expected)


def test_reads_nothing_back_to_the_host():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    t, cu, freqs = torch.randn(11, 3, 8, device="meta"), CU.to("meta"), _freqs(5).to("meta")
    assert rotary_thd(t, cu, freqs).shape == (11, 3, 8)
    with pytest.raises((RuntimeError, NotImplementedError)):
        _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_single_group())


def _single_group():
    from types import SimpleNamespace

    return SimpleNamespace(size=lambda: 1, rank=lambda: 0)
