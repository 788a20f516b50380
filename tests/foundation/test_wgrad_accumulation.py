"""compat/wgrad_accumulation: the weight-gradient GEMM that adds into megatron-core's gradient buffer
where Apex's kernel is missing (--gradient-accumulation-fusion). Training with it: test_parallel_losses;
its CUDA call's contract: the GPU rehearsal; its numbers on a GPU: tests/gpu."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.compat import wgrad_accumulation
from megatron_ext.errors import UserError


def _factors(dtype):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(7, 3, generator=gen).to(dtype), torch.randn(7, 5, generator=gen).to(dtype),
            torch.randn(3, 5, generator=gen))


def test_each_micro_batchs_weight_gradient_is_added_to_what_the_buffer_holds():
    grad_output, total_input, main_grad = _factors(torch.float32)
    before = main_grad.clone()
    wgrad_accumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    wgrad_accumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    expected = before.double() + 2 * grad_output.double().t().matmul(total_input.double())
    assert torch.allclose(main_grad.double(), expected, rtol=1e-6, atol=1e-6)


def test_half_precision_products_are_summed_in_fp32_into_an_fp32_buffer():
    grad_output, total_input, main_grad = _factors(torch.bfloat16)
    before = main_grad.clone()
    wgrad_accumulation.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    exact = before.double() + grad_output.double().t().matmul(total_input.double())
    assert torch.allclose(main_grad.double(), exact, rtol=1e-6, atol=1e-6)
    # What the hook's add does instead: the product rounded to bf16 first.
    rounded = before + grad_output.t().matmul(total_input).float()
    assert not torch.allclose(rounded.double(), exact, rtol=1e-6, atol=1e-6)


def test_a_half_precision_buffer_takes_the_sum_in_its_own_dtype():
    grad_output, total_input, main_grad = _factors(torch.bfloat16)
    main_grad = main_grad.bfloat16()
    expected = torch.addmm(main_grad, grad_output.t(), total_input)
    wgrad_accumulation.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
    assert torch.equal(main_grad, expected)


def test_it_stands_in_for_apex_only_where_apex_is_missing(monkeypatch):
    from megatron.core.tensor_parallel import layers

    apex = object()
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", True)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", apex, raising=False)
    wgrad_accumulation.install()
    assert layers.fused_weight_gradient_mlp_cuda is apex
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    wgrad_accumulation.install()
    assert layers.fused_weight_gradient_mlp_cuda is wgrad_accumulation and layers._grad_accum_fusion_available
    wgrad_accumulation.require_kernel()  # no CUDA here: nothing to check


def test_a_torch_whose_cuda_lacks_the_gemm_is_refused_in_one_line(monkeypatch):
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", wgrad_accumulation, raising=False)
    monkeypatch.setattr(wgrad_accumulation, "kernel_problem", lambda: "RuntimeError: no dtype overload")
    with pytest.raises(UserError) as info:
        wgrad_accumulation.require_kernel()
    message = str(info.value)
    assert message.startswith("--gradient-accumulation-fusion needs torch.baddbmm with out_dtype on CUDA")
    assert "no dtype overload" in message and "drop the flag or install Apex" in message and "\n" not in message
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", object())  # Apex's: not ours to check
    wgrad_accumulation.require_kernel()
