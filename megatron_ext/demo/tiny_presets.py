"""What the tiny test and demo models of each family look like beyond their sizes: the config fields
and initial weights that make each family's differences show in a model small enough for a CPU.

The families (`megatron_ext/families/`) describe the published models only; these presets are the
one place outside them that names a family, as the key of its tiny model (`TEXT_PRESETS` by the text
model_type `--text-arch` accepts, `TOWER_PRESETS` by the model_type of the checkpoints holding the
tower). No torch or transformers here: the demo command's options read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

# The text family of the tiny models the demo and most tests build.
DEFAULT_TEXT_ARCH = "llama"


@dataclass(frozen=True)
class TextPreset:
    """Config fields a tiny text model of one family sets over its sizes."""

    norm_eps: float = 1e-6
    fields: dict[str, Any] = field(default_factory=dict)  # set whatever the sizes are
    fields_of: Callable[[dict], dict] | None = None  # fields that depend on the sizes and tokens
    weights: Callable[[Any], None] | None = None  # adjusts the freshly initialised model


@dataclass(frozen=True)
class TowerPreset:
    """Config fields and initial weights of a tiny vision tower of one family."""

    hidden_act: str  # unless the config given names one
    image_size: int = 56  # in pixels (4 x 4 patches of 14)
    fields: dict[str, Any] = field(default_factory=dict)
    weights: Callable[[Any], None] | None = None


def _pad_is_eos(fields: dict) -> dict:
    # Phi-3's default pad token (32000) lies beyond a tiny vocabulary.
    return {"pad_token_id": fields.get("eos_token_id")}


def _sliding_and_full_layers(fields: dict) -> dict:
    # Sliding and full layers on every pipeline stage of two.
    return {"layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(fields["num_hidden_layers"])]}


def _random_norms(model) -> None:
    import torch

    # transformers starts every (1 + w) norm at w = 0; random ones show each is mapped and computed.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.5)


def _random_layer_scales(model) -> None:
    import torch

    # transformers starts every layer scale at one constant; random ones show each is mapped.
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.lambda_1.uniform_(0.5, 1.5)
            layer.lambda_2.uniform_(0.5, 1.5)


# A sliding window shorter than the test prompts, so the window matters.
_SHORT_WINDOW = {"sliding_window": 6}

TEXT_PRESETS = {
    "llama": TextPreset(norm_eps=1e-5),
    "mistral": TextPreset(norm_eps=1e-5, fields=_SHORT_WINDOW),
    "phi3": TextPreset(norm_eps=1e-5, fields=_SHORT_WINDOW, fields_of=_pad_is_eos),
    "qwen2": TextPreset(),
    # A head_dim that is not hidden_size / heads, so the tests see the difference.
    "qwen3": TextPreset(fields={"head_dim": 32}),
    # A window shorter than the test prompts, RoPE bases that differ, and an attention scale that is
    # not 1 / sqrt(head_dim).
    "gemma3_text": TextPreset(
        fields={"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 5,
                "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
        fields_of=_sliding_and_full_layers, weights=_random_norms),
}

TOWER_PRESETS = {
    "clip": TowerPreset(hidden_act="quick_gelu"),
    # Off the patch grid as so400m-patch14-384 is (27 patches per side, 6 pixels never seen): 4 patches
    # and 6 pixels, so every test of a SigLIP model checks what such towers need.
    "siglip": TowerPreset(hidden_act="gelu_pytorch_tanh", image_size=62),
    "internvl": TowerPreset(hidden_act="gelu", fields={"attention_bias": True}, weights=_random_layer_scales),
}
