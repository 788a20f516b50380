"""CLIP's vision tower (LLaVA-1.5's): a class token, a pre-norm, no patch bias; LLaVA reads the
penultimate layer's output and drops the class token."""

from megatron_ext.families.vit import ViTFamily


def _processor(image_size: int):
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})


FAMILY = ViTFamily(
    model_type="clip_vision_model", full_model_type="clip", subtype="clip",
    class_token=True, pre_norm=True, patch_bias=False, feature_layer=-2, select_strategy="default",
    model_class="CLIPVisionModel", config_class="CLIPVisionConfig",
    image_processor=_processor,
)
