"""InternViT-300M (InternVL 2.5 / 3's tower; transformers' `internvl_vision`) as a LLaVA tower: a class
token, no pre-norm, a patch bias, q/k/v biases and a layer scale (`lambda_1`, `lambda_2`) on every
layer's attention and MLP outputs (megatron-core's `internvit300M` ViT subtype plus
`model/output_step.py`). LLaVA reads the last layer without the class token, as InternVL does.
InternVL's pixel shuffle (4 patches into one token) belongs to its own projector, which
transformers' LLaVA does not have, so a LLaVA with this tower sees every patch.

A tower can come from a whole InternVL checkpoint (`internvl`, e.g. `OpenGVLab/InternVL3-1B-hf`):
its vision config and `model.vision_tower.*` tensors are taken.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import get
from megatron_ext.families.vit import ViTFamily, layer_rows
from megatron_ext.model.arch import VisionArch
from megatron_ext.model.mapping_rules import REPLICATED, VIT, Mapping, Reshaped, row

_LAYER = "vision_tower.encoder.layer.*."
_EMBED = "vision_tower.embeddings."
# InternVL's normalisation of 448-pixel tiles (ImageNet's mean and std, bicubic resize).
_IMAGENET_MEAN, _IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _processor(image_size: int):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"height": image_size, "width": image_size}, do_center_crop=False, resample=3,
                              image_mean=_IMAGENET_MEAN, image_std=_IMAGENET_STD)


@dataclass(frozen=True)
class InternViTFamily(ViTFamily):
    def read(self, cfg: Any, feature_layer: int) -> VisionArch:
        refusals = [
            (get(cfg, "use_qk_norm", False), "use_qk_norm=true (InternViT-6B's RMSNorm on q and k)"),
            (get(cfg, "norm_type", "layer_norm") != "layer_norm", f"norm_type {get(cfg, 'norm_type')!r} (InternViT-6B's)"),
            (not get(cfg, "attention_bias", True), "attention_bias=false (InternViT-300M has q/k/v biases)"),
            (not get(cfg, "use_absolute_position_embeddings", True), "use_absolute_position_embeddings=false"),
        ]
        for refused, what in refusals:
            if refused:
                raise UserError(f"InternViT towers with {what} are not supported (supported: InternViT-300M's layout)")
        return super().read(cfg, feature_layer)

    def vision_spec(self, v: VisionArch, spec, backend: str):
        """The layer scale (`lambda_1`, `lambda_2`) on the attention's and MLP's outputs."""
        from megatron_ext.model.output_step import LayerScale, add_output_steps

        spec = copy.deepcopy(spec)
        add_output_steps(spec, "layer_scale", LayerScale)
        return spec

    def rows(self, v: VisionArch) -> tuple[list[Mapping], list[Mapping]]:
        layer = layer_rows(v, _LAYER, norm1="layernorm_before", attention="attention.", out_proj="projection_layer",
                           norm2="layernorm_after") + [
            row(VIT + "self_attention.linear_proj.layer_scale.weight", _LAYER + "lambda_1", REPLICATED),
            row(VIT + "mlp.linear_fc2.layer_scale.weight", _LAYER + "lambda_2", REPLICATED),
        ]
        positions = v.num_patches + 1
        once = [
            row("vision_model.conv1.weight", _EMBED + "patch_embeddings.projection.weight", REPLICATED),
            row("vision_model.conv1.bias", _EMBED + "patch_embeddings.projection.bias", REPLICATED),
            row("vision_model.position_embeddings.weight", _EMBED + "position_embeddings",
                Reshaped((positions, v.hidden_size), hf_shape=(1, positions, v.hidden_size))),
            row("vision_model.class_token", _EMBED + "cls_token", REPLICATED),
        ]
        return once, layer


FAMILY = InternViTFamily(
    model_type="internvl_vision", full_model_type="internvl", subtype="internvit300M",
    class_token=True, pre_norm=False, patch_bias=True, feature_layer=-1, select_strategy="default",
    model_class="InternVLVisionModel", config_class="InternVLVisionConfig",
    image_processor=_processor, hf_layers="vision_tower.encoder.layer.", hf_unused=("layernorm",),
    tower_prefix="vision_tower.",
)
