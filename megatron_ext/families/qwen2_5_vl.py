"""Qwen2.5-VL: a Qwen2 decoder (q/k/v bias) with 3-D multimodal RoPE in chunked sections
(megatron-core's `mrope`, equal to transformers' to the bit) and transformers' native-resolution
vision tower with windowed attention, held whole (`qwen_vl.py`)."""

from megatron_ext.families.qwen_vl import MRopeTextFamily, QwenVLFamily


def tower_inputs(tower, grid):
    """The values the tower computes from its grid, by the keywords it takes them under (`model/tower_inputs.py`)."""
    from transformers import vision_utils

    window_index, cu_window_seqlens = vision_utils.get_vision_window_index(
        grid, tower.spatial_merge_size, tower.window_size, tower.patch_size)
    return {"position_ids": vision_utils.get_vision_position_ids(grid, tower.spatial_merge_size),
            "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid),
            "window_index": window_index, "cu_window_seqlens": cu_window_seqlens}


FAMILY = QwenVLFamily(
    model_type="qwen2_5_vl", config_class="Qwen2_5_VLConfig", model_class="Qwen2_5_VLForConditionalGeneration",
    name="Qwen2.5-VL",
    # transformers' default sections when rope_parameters names none (configuration_qwen2_5_vl.py)
    text=MRopeTextFamily(model_type="qwen2_5_vl_text", config_class="Qwen2_5_VLTextConfig", qkv_bias=True,
                         chat_template="chatml", default_mrope_section=(16, 24, 24)),
    tower_class="transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel",
    hf_prefixes=(("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")),
    visual_prefix="visual.",
    tower_inputs=tower_inputs,
    stored_prefixes=(("model.language_model.", "model."), ("model.visual.", "visual.")),
)
