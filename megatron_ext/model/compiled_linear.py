"""megatron-core's linear layer in a form torch.compile traces whole: with gradient accumulation fusion,
and with the tensor-parallel communication of its input gradient.

With `--gradient-accumulation-fusion`, megatron-core's linear adds each weight gradient into the
parameter's fp32 `main_grad` inside its backward, and marks the parameter (`grad_added_to_main_grad`)
so that DDP's hook does not add the placeholder gradient it returns. Those attribute writes in a
backward are what torch.compile cannot trace: a compiled layer would break its graph at every linear.
Here the same step is one autograd function whose backward calls the accumulation as a custom
operator that mutates `main_grad` (inductor calls it in place, on the buffer itself), and the mark is
set in forward, where torch.compile replays attribute writes after its graph.

At `--tp` > 1 megatron-core's column-parallel linear all-reduces its input gradient with `async_op=True`,
where torch.compile breaks its graph. Here the all-reduce is torch's functional collective, which it
traces: issued where megatron-core issues it and waited for where megatron-core waits, after the weight
gradient's GEMM, which the communication still overlaps. What this function does not take (sequence
parallelism, which runs with Transformer Engine's layers only; deferred or sharded weight gradients) goes
to megatron-core's own function.
"""

from __future__ import annotations

import torch

_ORIGINAL = None


@torch.library.custom_op("megatron_ext::wgrad_accumulate", mutates_args=("main_grad",))
def wgrad_accumulate(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    """main_grad += grad_output^T @ total_input, by the kernel megatron-core was given (Apex's, or
    `compat.wgrad_accumulation`)."""
    from megatron.core.tensor_parallel import layers

    kernel = layers.fused_weight_gradient_mlp_cuda
    accumulate = kernel.wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32 else kernel.wgrad_gemm_accum_fp16
    accumulate(total_input, grad_output, main_grad)


@wgrad_accumulate.register_fake
def _(main_grad, grad_output, total_input) -> None:
    return None


class _TraceableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, main_grad, zero_placeholder: bool, allreduce_dgrad: bool, group):
        ctx.save_for_backward(input, weight)
        # Not saved for backward: every parameter's main_grad is a view of one bucket, whose version
        # counter the other parameters' accumulations advance (as megatron-core's own function does).
        ctx.main_grad = main_grad
        ctx.use_bias, ctx.zero_placeholder = bias is not None, zero_placeholder
        ctx.allreduce_dgrad, ctx.group = allreduce_dgrad, group
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.allreduce_dgrad:  # issued now, waited for after the weight gradient
            grad_input = torch.ops._c10d_functional.all_reduce(grad_input, "sum", ctx.group.group_name)
        grad_output_2d = grad_output.reshape(-1, grad_output.shape[-1])
        input_2d = input.reshape(-1, input.shape[-1])
        if ctx.main_grad is None:
            grad_weight = grad_output_2d.t().matmul(input_2d)
        else:
            wgrad_accumulate(ctx.main_grad, grad_output_2d, input_2d)
            # What autograd hands DDP's hook, which skips it: zeros where the weight is shared with a layer
            # whose gradient is a real one (megatron-core's tied output layer, `zero_out_wgrad`).
            grad_weight = torch.zeros_like(weight) if ctx.zero_placeholder else torch.empty_like(weight)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias else None
        if ctx.allreduce_dgrad:
            grad_input = torch.ops._c10d_functional.wait_tensor(grad_input)
        return grad_input, grad_weight, grad_bias, None, None, None, None


def linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
           grad_output_buffer=None, wgrad_deferral_limit=0, *args, **kwargs):
    """megatron-core's `linear_with_grad_accumulation_and_async_allreduce`, this module's function where it
    fuses the weight gradient's accumulation or all-reduces the input gradient."""
    fused = gradient_accumulation_fusion and hasattr(weight, "main_grad")
    # megatron-core 0.19's weight sharding for rematerialisation (`gtp_remat_size` > 1) is its own too.
    theirs = sequence_parallel or grad_output_buffer is not None or kwargs.get("gtp_remat_size", 1) > 1
    if theirs or not (fused or allreduce_dgrad):
        return _ORIGINAL(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                         grad_output_buffer, wgrad_deferral_limit, *args, **kwargs)
    from megatron.core.tensor_parallel import layers

    group = layers.get_tensor_model_parallel_group_if_none(kwargs.get("tp_group")) if allreduce_dgrad else None
    if fused:
        weight.grad_added_to_main_grad = True
    return _TraceableLinear.apply(input, weight, bias, weight.main_grad if fused else None,
                                  getattr(weight, "zero_out_wgrad", False), allreduce_dgrad, group)


def use() -> None:
    """megatron-core's linear layers call `linear` from now on (idempotent); UserError, nothing changed,
    where the installed megatron-core lacks the function replaced."""
    global _ORIGINAL
    from megatron_ext.model import linear_function

    if _ORIGINAL is None:
        _ORIGINAL = linear_function.take_over(linear, "compiled_linear",
                                              also_needed=("LinearWithGradAccumulationAndAsyncCommunication",))
