"""Hugging Face `hidden_act` strings -> the names of `activations.ACTIVATIONS`. Imports no torch: the
launcher reads model configs without it."""

from __future__ import annotations

from megatron_ext.errors import UserError

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
