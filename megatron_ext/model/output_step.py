"""A step on a residual branch's output before the residual add: a learned per-channel scale
(InternViT's `lambda_1` / `lambda_2`, CaiT's layer scale) or a norm (Gemma's
`post_attention_layernorm` / `post_feedforward_layernorm`).

megatron-core's TransformerLayer has no slot for either, so the branch's last linear layer applies
it: attention's `linear_proj` and the MLP's `linear_fc2` are row-parallel, so their output (after
the all-reduce) has the full hidden size on every tensor-parallel rank. The bias is added first,
since the step sees the whole branch output, and the layer hands no separate bias to
bias-dropout-add. A LoRA adapter on such a layer adds its share before the step (`linear_forward`,
`finish`), as PEFT's on the HF layer does.
"""

from __future__ import annotations

from functools import cache

import torch

from megatron_ext.compat.releases import mlp_submodules


class LayerScale(torch.nn.Module):
    """x * weight per channel; built like megatron-core's norms (`config`, `hidden_size`, `eps`)."""

    def __init__(self, config, hidden_size: int, eps: float = 0.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # With sequence parallelism each rank scales its own tokens: the gradients are summed over
        # the tensor-parallel group, as a LayerNorm's are.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


@cache
def with_output_step(linear_cls: type, name: str, step_cls: type) -> type:
    """`linear_cls` (megatron-core's RowParallelLinear or Transformer Engine's) whose output goes
    through a `step_cls` module saved as `name` (`...linear_proj.NAME.weight`, replicated)."""

    class WithOutputStep(linear_cls):
        wrapped_linear = linear_cls

        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.add_module(name, step_cls(config=config, hidden_size=output_size, eps=config.layernorm_epsilon))

        def linear_forward(self, *args, **kwargs):
            return linear_cls.forward(self, *args, **kwargs)

        def finish(self, output, bias):
            if bias is not None:
                output = output + bias
            return getattr(self, name)(output), None

        def forward(self, *args, **kwargs):
            return self.finish(*self.linear_forward(*args, **kwargs))

    WithOutputStep.__name__ = WithOutputStep.__qualname__ = f"{linear_cls.__name__}With{step_cls.__name__}"
    return WithOutputStep


def add_output_steps(spec, name: str, step_cls: type) -> None:
    """Put a `step_cls` on a layer spec's attention and MLP outputs, in place."""
    attention, mlp = spec.submodules.self_attention.submodules, mlp_submodules(spec.submodules.mlp)
    attention.linear_proj = with_output_step(attention.linear_proj, name, step_cls)
    mlp.linear_fc2 = with_output_step(mlp.linear_fc2, name, step_cls)
