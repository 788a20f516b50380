"""A norm on a residual branch's output before the residual add (Gemma 2 / 3's
`post_attention_layernorm` and `post_feedforward_layernorm`).

megatron-core's TransformerLayer normalises only the branch inputs, so the branch's last linear
layer applies it: attention's `linear_proj` and the MLP's `linear_fc2` are row-parallel, so their
output (after the all-reduce) has the full hidden size on every tensor-parallel rank.
"""

from __future__ import annotations

from functools import cache


@cache
def post_normed(linear_cls: type, norm_cls: type) -> type:
    """`linear_cls` (megatron-core's RowParallelLinear or Transformer Engine's) followed by
    `norm_cls`, saved as `post_norm.weight` beside its weight (replicated)."""

    class PostNormed(linear_cls):
        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_norm = norm_cls(config=config, hidden_size=output_size, eps=config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            if bias is not None:
                output = output + bias
            return self.post_norm(output), None

    PostNormed.__name__ = PostNormed.__qualname__ = f"PostNormed{linear_cls.__name__}"
    return PostNormed
