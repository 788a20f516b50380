"""An RMSNorm that scales by (1 + weight), computed in float32 (Gemma's; megatron-core's
`layernorm_zero_centered_gamma`), for the layer specs without Transformer Engine: megatron-core
has it only in TE's norms. The weight is stored as the checkpoint holds it (around 0), so a
conversion copies it unchanged."""

from __future__ import annotations

import torch


class OnePlusRMSNorm(torch.nn.Module):
    """Same constructor as megatron-core's norms (`config`, `hidden_size`, `eps`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        # With sequence parallelism the ranks see different tokens: megatron sums these gradients.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
