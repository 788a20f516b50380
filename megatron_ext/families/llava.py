"""LLaVA's own config: which text model and vision tower it joins, and how (feature layer and
strategy, projector, image token). Their parts are read by their families."""

from __future__ import annotations

from typing import Any

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import as_dict
from megatron_ext.model.arch import LlavaArch


def read_llava(cfg: Any, text_family, vision_family) -> LlavaArch:
    """The LlavaArch of an HF LLaVA config whose text config `text_family` and vision config
    `vision_family` read."""
    from megatron_ext.model.activation_names import hf_activation

    cfg = as_dict(cfg)
    if cfg.get("model_type") != "llava":
        raise UserError(f"model_type {cfg.get('model_type')!r} is not supported (supported: llava)")
    feature_layer = cfg.get("vision_feature_layer", -2)
    if not isinstance(feature_layer, int):
        raise UserError(f"vision_feature_layer {feature_layer} (several layers) is not supported")
    strategy = cfg.get("vision_feature_select_strategy", "default")
    vision = vision_family(cfg["vision_config"].get("model_type")).read(cfg["vision_config"], feature_layer)
    if strategy == "default" and not vision.class_token:
        raise UserError(f"vision_feature_select_strategy 'default' drops a class token, but {vision.model_type} "
                        "has none; use 'full'")
    image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
    text_config = cfg["text_config"]
    return LlavaArch(
        text=text_family(text_config.get("model_type")).read(text_config),
        vision=vision,
        projector_activation=hf_activation(cfg.get("projector_hidden_act", "gelu")),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        image_token_index=image_token,
        pad_token_id=cfg.get("pad_token_id", text_config.get("pad_token_id")),
        drop_class_token=strategy == "default",
    )
