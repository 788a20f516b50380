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


def test_every_layer_of_a_micro_batch_reuses_one_rotation_and_a_new_micro_batch_gets_its_own(monkeypatch):
    """The positions, gather and cos/sin run once per micro batch (the same cu_seqlens and freqs
    tensors for every layer); another micro batch of the same length but other sequences gets
    megatron-core's numbers for its own boundaries, never the last one's."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from megatron_ext.model import rope_kernels

    found = []
    monkeypatch.setattr(rope_kernels, "_rotation", rope_kernels._Rotation())
    monkeypatch.setattr(rope_kernels, "positions_in_sequences",
                        lambda cu, tokens: found.append(cu) or positions_in_sequences(cu, tokens))
    freqs, gen = _freqs(6), torch.Generator().manual_seed(0)
    for cu in (CU, torch.tensor([0, 2, 7, 11], dtype=torch.int32)):
        for _layer in range(3):
            for t in (torch.randn(11, 3, 8, generator=gen), torch.randn(11, 1, 8, generator=gen)):
                expected = _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_single_group())
                assert torch.equal(rotary_thd(t, cu, freqs), expected)
    assert len(found) == 2


def test_unpacked_rows_reuse_one_rotation_with_megatron_cores_numbers():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_ext.model.rope_kernels import rotary_bshd

    gen = torch.Generator().manual_seed(1)
    for freqs in (_freqs(7), _freqs(7, dim=4)):  # the second rotates half of each head
        for _layer in range(2):
            t = torch.randn(7, 2, 3, 8, generator=gen)
            assert torch.equal(rotary_bshd(t, freqs), _apply_rotary_pos_emb_bshd(t, freqs))


def test_reads_nothing_back_to_the_host():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    t, cu, freqs = torch.randn(11, 3, 8, device="meta"), CU.to("meta"), _freqs(5).to("meta")
    assert rotary_thd(t, cu, freqs).shape == (11, 3, 8)
    with pytest.raises((RuntimeError, NotImplementedError)):
        _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=_single_group())


def _single_group():
    from types import SimpleNamespace

    return SimpleNamespace(size=lambda: 1, rank=lambda: 0)


def test_a_compiled_caller_computes_each_micro_batchs_rotation_without_recompiling():
    """Inside torch.compile (--compile-layers) the rotation is computed in the graph: a cache held across
    calls would make it guard on each micro batch's tensors and compile again for every one."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps them: graphs compiled earlier in this process would count
    compiled = torch.compile(rotary_thd, dynamic=True, backend="eager")  # dynamo guards alone decide recompiling
    freqs, gen = _freqs(6), torch.Generator().manual_seed(0)
    for cu in (CU, torch.tensor([0, 2, 7, 11], dtype=torch.int32), torch.tensor([0, 5, 9, 11], dtype=torch.int32)):
        t = torch.randn(11, 3, 8, generator=gen)
        torch.testing.assert_close(compiled(t, cu, freqs), rotary_thd(t, cu, freqs), rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
