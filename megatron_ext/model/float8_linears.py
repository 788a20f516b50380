"""The language model's trained linear layers computing their GEMMs in float8 through torchao
(`--fp8 --fp8-backend torchao`): FP8 training without Transformer Engine.

torchao's float8 training (`convert_to_float8_training`) swaps `torch.nn.Linear` modules for ones whose
forward and backward GEMMs take float8 operands with dynamic tensorwise scales (e4m3 activations and
weights, e5m2 gradients) and give results in the compute dtype. megatron-core's linear layers are not
nn.Linear, so each linear layer of the language model's decoder gets a twin: an nn.Linear holding the
layer's own weight Parameter (no copy), converted by torchao and kept outside the module tree, so
parameters, checkpoints and the optimizer see nothing new. megatron-core's linear function calls the
twin where it would communicate nothing (TP 1, no sequence parallelism); its weight gradient reaches
DDP's buffer as any other does (no gradient accumulation fusion). Frozen weights keep megatron-core's
frozen-weight function, and the vision tower, projector and output layer stay in the compute dtype, as
with Transformer Engine's recipe.
"""

from __future__ import annotations

import torch

from megatron_ext.errors import UserError
from megatron_ext.model.backends import TORCHAO_MISSING

TWIN = "float8_linear"  # the attribute of a weight Parameter holding its torchao twin
_PREVIOUS = None


def apply(model) -> None:
    """Give every linear layer of `model.language_model`'s decoder a torchao float8 twin, and have
    megatron-core's linear function use them."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    linears = [(name, module.weight) for name, module in model.language_model.decoder.named_modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear))]
    attach(linears)
    _install()


def attach(weights: list[tuple[str, torch.nn.Parameter]]) -> None:
    """Each named [out, in] weight gets its twin. UserError where torchao is missing or a weight's sizes
    are not multiples of 16 (float8 GEMMs need them)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError(TORCHAO_MISSING) from None
    twins = torch.nn.ModuleList()
    for name, weight in weights:
        out_features, in_features = weight.shape
        if in_features % 16 or out_features % 16:
            raise UserError(f"--fp8-backend torchao: the language model's {name} is {out_features} x {in_features}; "
                            "float8 GEMMs need both sizes multiples of 16 (use --fp8-backend te or drop --fp8)")
        with torch.device("meta"):
            twin = torch.nn.Linear(in_features, out_features, bias=False)
        twin.weight = weight
        twins.append(twin)
    convert_to_float8_training(twins, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    for (_, weight), twin in zip(weights, twins):
        setattr(weight, TWIN, twin)


def linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
           grad_output_buffer=None, wgrad_deferral_limit=0, *args, **kwargs):
    """megatron-core's `linear_with_grad_accumulation_and_async_allreduce`, through the weight's float8
    twin where it has one and nothing is communicated."""
    twin = getattr(weight, TWIN, None)
    if twin is None or allreduce_dgrad or sequence_parallel or grad_output_buffer is not None:
        return _PREVIOUS(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                         grad_output_buffer, wgrad_deferral_limit, *args, **kwargs)
    output = twin(input)
    return output + bias if bias is not None else output


def _install() -> None:
    """megatron-core's linear layers call `linear` from now on (once per process)."""
    global _PREVIOUS
    from megatron_ext.model import linear_function

    if _PREVIOUS is None:
        _PREVIOUS = linear_function.take_over(linear, "float8_linears")
