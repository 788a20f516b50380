"""The kernel table of `model/kernel_rules.py` against CUDA itself: for a grid of attention calls
(dtype, head dim, grouped heads, mask, causal, fewer queries than keys), each fused kernel forced
alone runs exactly when the table says it accepts the call. The GPU rehearsal trusts this table on
CPU, so a GPU machine is where it is proven. Skipped without CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_ext.model.kernel_rules import AttentionCall, fused_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _calls():
    for dtype, head_dim, (heads, kv_heads), mask, causal, (queries, keys) in itertools.product(
            (torch.bfloat16, torch.float32), (64, 128, 256), ((8, 8), (8, 2)), (False, True), (False, True),
            ((256, 256), (1, 256), (128, 256))):
        if mask and causal:
            continue  # SDPA refuses both together
        yield AttentionCall(dtype=dtype, head_dim=head_dim, query_heads=heads, kv_heads=kv_heads, queries=queries,
                            keys=keys, has_mask=mask, is_causal=causal, enable_gqa=kv_heads != heads)


def _runs(call: AttentionCall, backend) -> bool:
    from torch.nn.attention import sdpa_kernel

    q = torch.randn(2, call.query_heads, call.queries, call.head_dim, dtype=call.dtype, device="cuda",
                    requires_grad=True)
    k, v = (torch.randn(2, call.kv_heads, call.keys, call.head_dim, dtype=call.dtype, device="cuda",
                        requires_grad=True) for _ in range(2))
    mask = torch.ones(call.queries, call.keys, dtype=torch.bool, device="cuda").tril(call.keys - call.queries) \
        if call.has_mask else None
    try:
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=call.is_causal,
                                                                   enable_gqa=call.enable_gqa)
            out.float().sum().backward()
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


def test_each_fused_kernel_runs_exactly_where_the_table_says():
    from torch.nn.attention import SDPBackend

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    wrong = []
    for call in _calls():
        table = set(fused_kernels(call))
        cuda = {name for name, backend in backends.items() if _runs(call, backend)}
        if table != cuda:
            wrong.append(f"{call}: table {sorted(table)}, CUDA ran {sorted(cuda)}")
    assert not wrong, f"{len(wrong)} calls:\n" + "\n".join(wrong)
