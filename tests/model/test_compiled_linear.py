"""model/compiled_linear.py: megatron-core's linear with gradient accumulation fusion and the input
gradient's all-reduce as one traceable autograd function. Training with it, compiled, at TP 1 and 2:
tests/train/test_compiled_layers.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.compat import wgrad_accumulation
from megatron_ext.model import compiled_linear


@pytest.fixture(autouse=True)
def _kernel():
    wgrad_accumulation.install()  # the kernel megatron-core's layers call, Apex's where it is installed


def _weight(out_features, in_features, main_grad=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen))
    weight.main_grad = torch.zeros(out_features, in_features) if main_grad is None else main_grad
    weight.grad_added_to_main_grad = False
    return weight


def test_the_weight_gradient_lands_in_main_grad_and_ddps_hook_is_told_to_skip_it():
    weight, bias = _weight(6, 4), torch.nn.Parameter(torch.randn(6))
    x = torch.randn(5, 2, 4, requires_grad=True)
    reference_weight = weight.detach().clone().requires_grad_()
    reference_bias, reference_x = bias.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    for _ in range(2):  # two micro batches: the second adds to the first
        compiled_linear.linear(x, weight, bias, True, False, False).square().sum().backward()
        F.linear(reference_x, reference_weight, reference_bias).square().sum().backward()
    assert weight.grad_added_to_main_grad
    assert torch.allclose(weight.main_grad, reference_weight.grad, rtol=1e-6, atol=1e-5)
    assert torch.allclose(bias.grad, reference_bias.grad, rtol=1e-6, atol=1e-5)
    assert torch.allclose(x.grad, reference_x.grad, rtol=1e-6, atol=1e-5)


def test_a_weight_shared_with_an_embedding_hands_autograd_zeros_beside_the_embeddings_gradient():
    """megatron-core's tied output layer (`zero_out_wgrad`): DDP's hook then adds the parameter's
    gradient, which must be the embedding's alone."""
    weight = _weight(10, 4)
    weight.zero_out_wgrad = True
    ids, hidden = torch.tensor([1, 3, 3, 7]), torch.randn(3, 4)
    (compiled_linear.linear(hidden, weight, None, True, False, False).sum() + F.embedding(ids, weight).square().sum()).backward()
    reference = weight.detach().clone().requires_grad_()
    F.embedding(ids, reference).square().sum().backward()
    assert torch.equal(weight.grad, reference.grad)
    assert torch.allclose(weight.main_grad, torch.ones(3, 10).t() @ hidden, rtol=1e-6)


@pytest.mark.multiprocess  # inductor starts the C++ compiler
@pytest.mark.timeout(300)
def test_it_compiles_whole_with_main_grads_that_are_views_of_one_bucket():
    """DDP's main_grads are views of one buffer, which share a version counter: saved for backward, each
    accumulation would fail the next one's check."""
    from torch._dynamo.utils import counters

    bucket = torch.zeros(2 * 8 * 4)
    first, second = _weight(8, 4, bucket[:32].view(8, 4), seed=1), _weight(4, 8, bucket[32:].view(4, 8), seed=2)

    def layer(x, weight):  # each a graph of its own, as each transformer layer is
        return F.gelu(compiled_linear.linear(x, weight, None, True, False, False))

    compiled = torch.compile(layer, dynamic=True)
    torch._dynamo.reset()
    counters.clear()
    reference = [w.detach().clone().requires_grad_() for w in (first, second)]
    for length in (5, 7):
        x = torch.randn(length, 4)
        compiled(compiled(x, first), second).sum().backward()
        F.gelu(F.linear(F.gelu(F.linear(x, reference[0])), reference[1])).sum().backward()
    assert not counters["graph_break"] and counters["frames"]["total"] == counters["frames"]["ok"] >= 1
    assert torch.allclose(first.main_grad, reference[0].grad, rtol=1e-5, atol=1e-5)
    assert torch.allclose(second.main_grad, reference[1].grad, rtol=1e-5, atol=1e-5)


def test_sequence_parallel_deferred_and_plain_calls_go_to_megatron_cores_own_function(monkeypatch):
    """What this module takes: fused accumulation, and the input gradient's all-reduce at TP > 1 (trained
    at TP 2 in tests/train/test_compiled_layers.py)."""
    calls = []
    monkeypatch.setattr(compiled_linear, "_ORIGINAL", lambda *args, **kwargs: calls.append(args) or "megatron-core's")
    weight = _weight(3, 2)
    for fused, allreduce_dgrad, sequence_parallel, buffer in ((True, False, True, None), (True, False, False, []),
                                                              (False, True, False, []), (False, False, False, None)):
        assert compiled_linear.linear(torch.randn(2, 2), weight, None, fused, allreduce_dgrad, sequence_parallel,
                                      buffer) == "megatron-core's"
    sharded = compiled_linear.linear(torch.randn(2, 2), weight, None, True, True, False, gtp_remat_size=2)
    assert sharded == "megatron-core's"
    assert len(calls) == 5 and not weight.grad_added_to_main_grad
