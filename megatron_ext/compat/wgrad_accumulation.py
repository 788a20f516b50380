"""Weight gradients added straight into megatron-core's fp32 gradient buffer, in PyTorch alone.

megatron-core's linear layers can add each weight-gradient GEMM's product into the parameter's
`main_grad` within the GEMM (`gradient_accumulation_fusion`), instead of writing a bf16 gradient
that a hook then adds to the fp32 buffer: one kernel and one tensor less per trained matrix per
micro batch (the ~1B LLaVA's profile: 60 ms of a 1.03 s busy step in those adds, ~1,300 launches).
They ask Apex's `fused_weight_gradient_mlp_cuda` for it, which plain installs lack. This module
offers the same two functions on torch's own GEMMs; `install()` hands it to megatron-core where
Apex's is missing.

CUDA's `baddbmm` with `out_dtype=float32` multiplies bf16 matrices with fp32 accumulation and adds
the product into its fp32 `out` (which it also reads as the addend), as Apex's kernel does; torch's
`addmm` would want a bf16 addend. Where that kernel does not exist (the CPU) the same sum is taken
on fp32 copies.
"""

from __future__ import annotations

import sys

import torch

from megatron_ext.errors import UserError


def accumulate_on_cuda(main_grad: torch.Tensor, grad_output_t: torch.Tensor, total_input: torch.Tensor) -> None:
    """main_grad (fp32) += grad_output_t @ total_input (bf16/fp16), accumulated in fp32 by one GEMM."""
    out = main_grad.unsqueeze(0)
    torch.baddbmm(out, grad_output_t.unsqueeze(0), total_input.unsqueeze(0), out_dtype=torch.float32, out=out)


def _accumulate(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input ([out, in] += [tokens, out]^T @ [tokens, in])."""
    if grad_output.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:
        accumulate_on_cuda(main_grad, grad_output.t(), total_input)
    else:
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Apex's entry point for an fp32 `main_grad`, with its argument order."""
    _accumulate(main_grad, grad_output, total_input)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """Apex's entry point for a bf16/fp16 `main_grad` (gradients reduced in the model's dtype)."""
    _accumulate(main_grad, grad_output, total_input)


def kernel_problem() -> str | None:
    """Why this process's CUDA cannot run `accumulate_on_cuda` (None: it can, checked on a small sum;
    also None without CUDA, where it is not called). The dtype overloads of torch's GEMMs are recent."""
    if not torch.cuda.is_available():
        return None
    main_grad = torch.ones(2, 3, device="cuda")
    grad_output_t = torch.full((2, 4), 0.5, dtype=torch.bfloat16, device="cuda")
    try:
        accumulate_on_cuda(main_grad, grad_output_t, torch.ones(4, 3, dtype=torch.bfloat16, device="cuda"))
    except (RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    if not bool((main_grad == 3).all()):
        return "the sum came out wrong"
    return None


def require_kernel() -> None:
    """UserError, one line, where megatron-core's layers would call this module's CUDA GEMM and it cannot run."""
    from megatron.core.tensor_parallel import layers

    if layers.fused_weight_gradient_mlp_cuda is not sys.modules[__name__]:
        return  # Apex's kernel
    problem = kernel_problem()
    if problem:
        raise UserError(f"--gradient-accumulation-fusion needs torch.baddbmm with out_dtype on CUDA (torch "
                        f"{torch.__version__}: {problem}); drop the flag or install Apex")


def install() -> None:
    """This module as megatron-core's `fused_weight_gradient_mlp_cuda` where Apex's is not importable;
    its linear layers call it only when a run asks for gradient_accumulation_fusion."""
    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
        layers._grad_accum_fusion_available = True
