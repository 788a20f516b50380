"""SigLIP's vision tower (and the fixed-resolution SigLIP 2 checkpoints, which transformers loads
as this same `siglip` architecture): no class token, no pre-norm, a patch bias; a post-norm and
pooling head LLaVA never uses. LLaVA reads the last layer's output, every patch."""

from megatron_ext.families.vit import ViTFamily


def _processor(image_size: int):
    from transformers import SiglipImageProcessor

    return SiglipImageProcessor(size={"height": image_size, "width": image_size})


FAMILY = ViTFamily(
    model_type="siglip_vision_model", full_model_type="siglip", subtype="siglip",
    class_token=False, pre_norm=False, patch_bias=True, feature_layer=-1, select_strategy="full",
    model_class="SiglipVisionModel", config_class="SiglipVisionConfig",
    image_processor=_processor,
)

REFUSED = {
    "siglip2_vision_model": "SigLIP 2 NaFlex towers take patches at a variable resolution (a linear patch embedding "
    "and resized position embeddings) that megatron-core's CLIPViTModel cannot compute; the fixed-resolution "
    "SigLIP 2 checkpoints are siglip_vision_model and supported",
    "siglip2": "SigLIP 2 NaFlex towers take patches at a variable resolution that megatron-core's CLIPViTModel cannot "
    "compute; the fixed-resolution SigLIP 2 checkpoints are siglip and supported",
}
