"""Activation functions by name, matching Hugging Face's `hidden_act` strings exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext.errors import UserError


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "quick_gelu": quick_gelu, "silu": F.silu}
# HF name -> our name (several HF names are the same function).
_HF_NAMES = {
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "quick_gelu": "quick_gelu",
    "silu": "silu",
    "swish": "silu",
}


def hf_activation(name: str) -> str:
    if name not in _HF_NAMES:
        raise UserError(f"activation {name!r} is not supported (supported: {', '.join(sorted(_HF_NAMES))})")
    return _HF_NAMES[name]
