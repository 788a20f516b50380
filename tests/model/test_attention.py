"""The sdpa core attention computes what plain softmax attention computes, in every form
megatron-core's attention layer hands it (no process group needed)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_ext.model.attention import SDPAttention

HEADS, GROUPS, DIM = 4, 2, 8


def _attention(mask_type: str, heads: int = HEADS, groups: int = GROUPS, tp: int = 1, layer: int = 1, **window):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=heads * DIM, num_attention_heads=heads,
                               num_query_groups=groups, kv_channels=DIM, attention_dropout=0.0,
                               use_cpu_initialization=True, **window)
    group = SimpleNamespace(size=lambda: tp)
    return SDPAttention(config, layer, AttnMaskType[mask_type], pg_collection=SimpleNamespace(tp=group))


def _reference(q, k, v, allowed):
    """softmax(q k^T / sqrt(d)) v with K/V repeated per query group. q: [b, h, sq, d]; allowed: [b|1, 1, sq, sk]."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def _qkv(s: int, b: int, heads: int = HEADS, groups: int = GROUPS):
    """megatron layout [s, b, heads, dim], float64 so differences are the kernels' and not rounding."""
    gen = torch.Generator().manual_seed(s * 10 + b)
    return [torch.randn(s, b, n, DIM, generator=gen, dtype=torch.float64, requires_grad=True)
            for n in (heads, groups, groups)]


def _bhsd(t):
    return t.permute(1, 2, 0, 3)


def _sbh(out):  # [b, h, s, d] -> [s, b, h * d]
    return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


def _check(got, expected, inputs):
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-10)
    grads = torch.autograd.grad((got * torch.arange(got.numel()).reshape(got.shape).cos()).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * torch.arange(got.numel()).reshape(got.shape).cos()).sum(), inputs)
    for a, b in zip(grads, expected_grads):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (4, 1)])
def test_causal_with_grouped_query_attention(heads, groups):
    q, k, v = _qkv(7, 2, heads, groups)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    got = _attention("causal", heads, groups)(q, k, v, None)
    _check(got, _sbh(_reference(_bhsd(q), _bhsd(k), _bhsd(v), causal)), (q, k, v))


def test_bidirectional_vision_attention():
    q, k, v = _qkv(5, 3)
    got = _attention("no_mask")(q, k, v, None)
    _check(got, _sbh(_reference(_bhsd(q), _bhsd(k), _bhsd(v), torch.ones(1, 1, 5, 5, dtype=torch.bool))), (q, k, v))


def test_dense_mask_in_megatrons_convention_replaces_the_causal_rule():
    from megatron_ext.model.packed_sequences import packed_attention_mask

    q, k, v = _qkv(6, 2)
    # Row 0: samples of 4 and 2 positions; row 1: one sample of 3, then padding.
    mask = packed_attention_mask(torch.tensor([[1, 2, 3, 4, 5, 6], [1, 2, 3, 0, 0, 0]]),
                                 torch.tensor([[1, 1, 1, 1, 2, 2], [1, 1, 1, 0, 0, 0]]), 99, 1, 6)
    got = _attention("causal")(q, k, v, mask)
    _check(got, _sbh(_reference(_bhsd(q), _bhsd(k), _bhsd(v), ~mask)), (q, k, v))


@pytest.mark.parametrize("padded", [False, True])
def test_thd_attends_each_sub_sequence_causally(padded):
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = (t[:, 0] for t in _qkv(9, 1))  # THD: [t, heads, dim]
    cu = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu if not padded else torch.tensor([0, 3, 5, 7]).int(),
                             cu_seqlens_kv=cu, cu_seqlens_q_padded=cu if padded else None,
                             cu_seqlens_kv_padded=cu if padded else None, max_seqlen_q=4, max_seqlen_kv=4)
    got = _attention("padding_causal")(q, k, v, None, packed_seq_params=params)
    segment = torch.repeat_interleave(torch.arange(3), cu.diff())
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    expected = _reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], allowed[None, None])
    _check(got, expected[0].transpose(0, 1).reshape(9, -1), (q, k, v))


def test_fewer_queries_than_keys_are_the_last_positions():
    q, k, v = _qkv(6, 1)
    q_last = q[-2:]
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[-2:][None, None]
    got = _attention("causal")(q_last, k, v, None)
    _check(got, _sbh(_reference(_bhsd(q_last), _bhsd(k), _bhsd(v), allowed)), (q, k, v))


def test_sliding_layers_see_the_window_and_the_others_everything_before():
    """megatron-core's window (3, 0) is HF's sliding_window 4: a query sees itself and 3 keys back;
    layers are chosen by `window_attn_skip_freq` (1 = sliding), as megatron's own attention does."""
    q, k, v = _qkv(8, 2)
    window = dict(window_size=(3, 0), window_attn_skip_freq=[1, 0])
    position = torch.arange(8)
    band = (position[None, :] <= position[:, None]) & (position[None, :] > position[:, None] - 4)
    got = _attention("causal", layer=1, **window)(q, k, v, None)
    _check(got, _sbh(_reference(_bhsd(q), _bhsd(k), _bhsd(v), band[None, None])), (q, k, v))
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    got = _attention("causal", layer=2, **window)(q, k, v, None)
    _check(got, _sbh(_reference(_bhsd(q), _bhsd(k), _bhsd(v), causal[None, None])), (q, k, v))
    # Decoding with a KV cache: the last query sees the last 4 keys.
    got = _attention("causal", layer=1, **window)(q[-1:], k, v, None)
    _check(got, _sbh(_reference(_bhsd(q[-1:]), _bhsd(k), _bhsd(v), band[-1:][None, None])), (q, k, v))


def test_heads_are_split_over_tensor_parallel_ranks():
    attention = _attention("causal", heads=8, groups=4, tp=2)
    assert (attention.heads, attention.groups) == (4, 2)
    q, k, v = _qkv(5, 1, 4, 2)  # this rank's share
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    _check(attention(q, k, v, None), _sbh(_reference(_bhsd(q), _bhsd(k), _bhsd(v), causal)), (q, k, v))


def test_refuses_what_it_cannot_compute():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, context_parallel_size=2)
    with pytest.raises(ValueError, match="context parallelism needs Transformer Engine"):
        SDPAttention(config, 1, AttnMaskType.causal, pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)))
    q, k, v = _qkv(3, 1)
    with pytest.raises(ValueError, match="attention bias"):
        _attention("causal")(q, k, v, None, attention_bias=torch.zeros(1))


def _recorded_calls(monkeypatch) -> list:
    """Every SDPA call of the backend, as kernel_rules sees it, with its mask object."""
    import torch.nn.functional as F

    from megatron_ext.model.kernel_rules import AttentionCall

    calls, sdpa = [], F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((AttentionCall.of(q, k, attn_mask, is_causal, enable_gqa), attn_mask))
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorded)
    return calls


def _thd_params(cu: torch.Tensor, longest: int):
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def test_every_masked_form_reaches_a_kernel_every_gpu_has(monkeypatch):
    """Grouped heads with a mask only run on the math kernel (flash takes no mask, memory-efficient no
    GQA): every form that needs a mask gets repeated K/V heads instead, and every call, were it in
    bf16 on a GPU, is one that flash or memory-efficient attention takes."""
    import dataclasses

    from megatron_ext.model.kernel_rules import PORTABLE, fused_kernels, why_not

    calls = _recorded_calls(monkeypatch)
    q, k, v = _qkv(8, 2)
    mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
    _attention("causal")(q, k, v, mask)  # dense mask (several packed rows)
    _attention("causal")(q[-2:], k, v, None)  # fewer queries than keys (a cache)
    _attention("causal", window_size=(3, 0))(q, k, v, None)  # band
    _attention("causal")(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=_thd_params(torch.tensor([0, 3, 8]).int(), 5))
    _attention("causal")(*(t.detach().bfloat16() for t in (q, k, v)), None)  # flash takes bf16 causal GQA as is
    assert len(calls) == 5
    for call, _ in calls:
        on_gpu = dataclasses.replace(call, dtype=torch.bfloat16)
        assert set(fused_kernels(on_gpu)) & set(PORTABLE), (call, why_not(on_gpu))
    assert [c.grouped for c, _ in calls] == [False, False, False, False, True]


def test_a_packed_mask_is_built_once_per_micro_batch(monkeypatch):
    """fp32 packing (CPU) takes one masked call per layer; the layers of one micro batch share the
    mask built for the first (it lives on their PackedSeqParams), the next micro batch gets its own."""
    calls = _recorded_calls(monkeypatch)
    q, k, v = (t[:, 0] for t in _qkv(9, 1))
    attention = _attention("causal")
    first, second = _thd_params(torch.tensor([0, 4, 9]).int(), 5), _thd_params(torch.tensor([0, 2, 9]).int(), 7)
    for params in (first, first, first, second):
        attention(q, k, v, None, packed_seq_params=params)
    masks = [mask for _, mask in calls]
    assert masks[0] is masks[1] is masks[2] and masks[3] is not masks[0]
    assert masks[0][3, 3] and not masks[0][4, 3] and masks[3][4, 3]


@pytest.mark.parametrize("window", [None, (3, 0)], ids=["causal", "window"])
def test_an_older_varlen_attn_gets_what_it_takes(monkeypatch, window):
    """torch releases before `varlen_attn` took `enable_gqa`/`scale`/`window_size` (an H100's torch
    2.11 refused `enable_gqa`): grouped K/V heads are repeated, causality is `is_causal`, and a
    sliding window, which it cannot apply, takes the masked SDPA path (on `meta`, CUDA's stand-in)."""
    from megatron_ext.model import attention as backend

    seen = []

    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        seen.append((query.shape, key.shape, value.shape, is_causal))
        return torch.empty_like(query)

    monkeypatch.setattr(backend, "varlen_attn", old_varlen_attn)
    calls = _recorded_calls(monkeypatch)
    q, k, v = (torch.randn(16, n, DIM, dtype=torch.bfloat16, device="meta") for n in (HEADS, GROUPS, GROUPS))
    cu = torch.tensor([0, 5, 16], dtype=torch.int32, device="meta")
    options = dict(window_size=window) if window else {}
    out = _attention("causal", **options)(q, k, v, None, packed_seq_params=_thd_params(cu, 11))
    assert out.shape == (16, HEADS * DIM)
    if window is None:
        assert seen == [((16, HEADS, DIM), (16, HEADS, DIM), (16, HEADS, DIM), True)] and calls == []
    else:
        assert seen == [] and len(calls) == 1 and not calls[0][0].grouped
