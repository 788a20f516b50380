"""Layer scale (CaiT; InternViT's `lambda_1`, `lambda_2`): a learned per-channel factor on a residual
branch's output, applied before the residual add.

megatron-core's TransformerLayer has no slot for it, so the branch's last linear layer applies it:
attention's `linear_proj` and the MLP's `linear_fc2` are row-parallel, so their output (after the
all-reduce) has the full hidden size on every tensor-parallel rank. The bias is added first, since
the factor scales the whole branch output (HF: lambda * (W x + b)), and the layer hands no separate
bias to bias-dropout-add.
"""

from __future__ import annotations

from functools import cache

import torch


@cache
def layer_scaled(linear_cls: type) -> type:
    """`linear_cls` (megatron-core's RowParallelLinear or Transformer Engine's) with a layer scale,
    saved as `layer_scale` beside its weight (replicated across tensor-parallel ranks)."""

    class LayerScaled(linear_cls):
        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.layer_scale = torch.nn.Parameter(torch.ones(output_size, dtype=config.params_dtype))
            # With sequence parallelism each rank scales its own tokens: the gradients are summed
            # over the tensor-parallel group like a LayerNorm's.
            self.layer_scale.sequence_parallel = config.sequence_parallel

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            if bias is not None:
                output = output + bias
            return output * self.layer_scale, None

    LayerScaled.__name__ = LayerScaled.__qualname__ = f"LayerScaled{linear_cls.__name__}"
    return LayerScaled
