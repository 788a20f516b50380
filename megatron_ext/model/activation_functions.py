"""Activation functions by our name (`activation_names.hf_activation` maps Hugging Face's `hidden_act`
strings to it), each computing exactly what transformers computes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"gelu": gelu, "gelu_tanh": gelu_tanh, "quick_gelu": quick_gelu, "silu": F.silu}
