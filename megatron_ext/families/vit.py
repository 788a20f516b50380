"""What CLIP-shaped vision towers share: pre-norm LayerNorm layers with biases, a patch
convolution and learned position embeddings (megatron-core's CLIPViTModel), and the HF names
`CLIPVisionModel` / `SiglipVisionModel` use. A tower module creates one `ViTFamily`; one whose
towers compute more subclasses it and overrides the hooks (`model/family_hooks.py`), as
`internvit.py` does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import get
from megatron_ext.model.arch import VisionArch
from megatron_ext.model.mapping_rules import COLUMN, HF_VIT, QKV, REPLICATED, ROW, VIT, Mapping, Reshaped, row


def layer_rows(v: VisionArch, layer: str, norm1: str, attention: str, out_proj: str, norm2: str) -> list[Mapping]:
    """The rows of a pre-norm ViT layer (LayerNorms, q/k/v and output projection with biases, a
    `mlp.fc1` / `mlp.fc2` MLP) under its HF names: `layer` is the layer's prefix (with `*`), the
    others are relative to it."""
    qkv = QKV(v.num_attention_heads, v.num_attention_heads, v.hidden_size // v.num_attention_heads)
    projections = tuple(layer + attention + f"{p}_proj." for p in "qkv")
    return [
        row(VIT + "self_attention.linear_qkv.layer_norm_weight", layer + norm1 + ".weight", REPLICATED),
        row(VIT + "self_attention.linear_qkv.layer_norm_bias", layer + norm1 + ".bias", REPLICATED),
        row(VIT + "self_attention.linear_qkv.weight", tuple(p + "weight" for p in projections), qkv),
        row(VIT + "self_attention.linear_qkv.bias", tuple(p + "bias" for p in projections), qkv),
        row(VIT + "self_attention.linear_proj.weight", layer + attention + out_proj + ".weight", ROW),
        row(VIT + "self_attention.linear_proj.bias", layer + attention + out_proj + ".bias", REPLICATED),
        row(VIT + "mlp.linear_fc1.layer_norm_weight", layer + norm2 + ".weight", REPLICATED),
        row(VIT + "mlp.linear_fc1.layer_norm_bias", layer + norm2 + ".bias", REPLICATED),
        row(VIT + "mlp.linear_fc1.weight", layer + "mlp.fc1.weight", COLUMN),
        row(VIT + "mlp.linear_fc1.bias", layer + "mlp.fc1.bias", COLUMN),
        row(VIT + "mlp.linear_fc2.weight", layer + "mlp.fc2.weight", ROW),
        row(VIT + "mlp.linear_fc2.bias", layer + "mlp.fc2.bias", REPLICATED),
    ]


def _square(size, key: str) -> int:
    """A size given as one number or as (height, width), which must be equal."""
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise UserError(f"vision {key} {list(size)} is not square; megatron-core's ViT takes square images and patches")
        return size[0]
    return size


@dataclass(frozen=True)
class ViTFamily:
    model_type: str  # the tower config's model_type
    full_model_type: str  # model_type of two-tower checkpoints (image + text) holding it as vision_config
    subtype: str  # megatron-core CLIPViTModel subtype
    class_token: bool  # a class token in front of the patches
    pre_norm: bool  # a LayerNorm before the first layer (CLIP's pre_layrnorm)
    patch_bias: bool  # the patch convolution has a bias
    # How LLaVA reads its features (as LLaVA-1.5 / LLaVA-NeXT-SigLIP do): the hidden_states index
    # (-2: the penultimate layer's output), and "default" (drop the class token) or "full".
    feature_layer: int
    select_strategy: str
    model_class: str  # transformers class of the tower alone
    config_class: str  # transformers config class of the tower
    image_processor: Callable[[int], Any]  # image size -> the tower's HF image processor
    hf_layers: str = "vision_tower.encoder.layers."  # HF name prefix of layer i's tensors (then "i.")
    hf_unused: tuple[str, ...] = ("post_layernorm", "head")  # tower modules LLaVA never runs
    # Where whole checkpoints of `full_model_type` keep the tower, when transformers does not load
    # the tower class from them on its own (names after transformers strips the "model." prefix).
    tower_prefix: str | None = None

    def read(self, cfg: Any, feature_layer: int) -> VisionArch:
        from megatron_ext.model.activation_names import hf_activation

        hf_layers = get(cfg, "num_hidden_layers")
        # hidden_states[0] is the embedding output, hidden_states[i] the output of layer i.
        used = feature_layer if feature_layer >= 0 else hf_layers + 1 + feature_layer
        if not 1 <= used <= hf_layers:
            raise UserError(f"vision_feature_layer {feature_layer} selects no transformer layer of a {hf_layers}-layer tower")
        return VisionArch(
            model_type=self.model_type,
            subtype=self.subtype,
            num_layers=used,
            hidden_size=get(cfg, "hidden_size"),
            ffn_hidden_size=get(cfg, "intermediate_size"),
            num_attention_heads=get(cfg, "num_attention_heads"),
            image_size=_square(get(cfg, "image_size"), "image_size"),
            patch_size=_square(get(cfg, "patch_size"), "patch_size"),
            norm_eps=float(get(cfg, "layer_norm_eps", 1e-5)),
            activation=hf_activation(get(cfg, "hidden_act")),
            class_token=self.class_token,
            init_std=float(get(cfg, "initializer_range", 0.02)),
        )

    def vision_config(self, v: VisionArch) -> dict:
        """megatron-core TransformerConfig fields of the ViT."""
        from megatron_ext.model.activation_functions import ACTIVATIONS

        return dict(
            num_layers=v.num_layers,
            hidden_size=v.hidden_size,
            ffn_hidden_size=v.ffn_hidden_size,
            num_attention_heads=v.num_attention_heads,
            kv_channels=v.hidden_size // v.num_attention_heads,
            normalization="LayerNorm",
            layernorm_epsilon=v.norm_eps,
            gated_linear_unit=False,
            activation_func=ACTIVATIONS[v.activation],
            add_bias_linear=True,
            add_qkv_bias=True,
        )

    def unused_names(self, v: VisionArch, hf_names: list[str]) -> list[str]:
        """The tower's HF tensors LLaVA never uses: layers after the feature layer, `hf_unused` modules."""
        layer_index = re.compile(re.escape(self.hf_layers) + r"(\d+)\.")
        unused_modules = tuple(f"vision_tower.{module}." for module in self.hf_unused)
        unused = []
        for name in hf_names:
            layer = layer_index.match(name)
            if (layer and int(layer.group(1)) >= v.num_layers) or name.startswith(unused_modules):
                unused.append(name)
        return unused

    def vision_spec(self, v: VisionArch, spec, backend: str):
        """megatron-core's ViT layer as it is: CLIP-shaped towers need nothing else."""
        return spec

    def rows(self, v: VisionArch) -> tuple[list[Mapping], list[Mapping]]:
        """(tensors held once, tensors of every layer `*`) of the tower."""
        layer = layer_rows(v, HF_VIT, norm1="layer_norm1", attention="self_attn.", out_proj="out_proj",
                           norm2="layer_norm2")
        once = [
            row("vision_model.conv1.weight", "vision_tower.embeddings.patch_embedding.weight", REPLICATED),
            row("vision_model.position_embeddings.weight", "vision_tower.embeddings.position_embedding.weight", REPLICATED),
        ]
        if self.patch_bias:
            once.append(row("vision_model.conv1.bias", "vision_tower.embeddings.patch_embedding.bias", REPLICATED))
        if self.class_token:
            once.append(row("vision_model.class_token", "vision_tower.embeddings.class_embedding",
                            Reshaped((1, 1, v.hidden_size))))
        if self.pre_norm:
            once += [row("vision_model.ln_pre.weight", "vision_tower.pre_layrnorm.weight", REPLICATED),
                     row("vision_model.ln_pre.bias", "vision_tower.pre_layrnorm.bias", REPLICATED)]
        return once, layer

    @property
    def extra_tokens(self) -> int:
        """Positions the tower puts in front of the patches."""
        return int(self.class_token)
