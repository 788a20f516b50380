"""Qwen3-VL (dense): a Qwen3 decoder (per-head q/k RMSNorm before RoPE, no bias) with 3-D multimodal
RoPE whose sections interleave over the channels (`model/interleaved_mrope.py`), and transformers'
vision tower held whole (`qwen_vl.py`): learned position embedding, DeepStack mergers whose features
the model adds after the first decoder layers (`model/mrope_vlm.py`). Checkpoints store the names
transformers 5 uses in memory (`model.language_model.`, `model.visual.`)."""

from megatron_ext.families.qwen_vl import MRopeTextFamily, QwenVLFamily


def tower_inputs(tower, grid):
    """The values the tower computes from its grid, by the keywords it takes them under (`model/tower_inputs.py`)."""
    from transformers import vision_utils

    interp_indices, interp_weights = vision_utils.get_vision_interpolation_indices_and_weights(
        grid, tower.num_grid_per_side, tower.interpolation_mode, tower.interpolation_align_corners,
        tower.config.spatial_merge_size)
    return {"interp_indices": interp_indices, "interp_weights": interp_weights,
            "position_ids": vision_utils.get_vision_position_ids(grid, tower.spatial_merge_size),
            "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid)}


FAMILY = QwenVLFamily(
    model_type="qwen3_vl", config_class="Qwen3VLConfig", model_class="Qwen3VLForConditionalGeneration",
    name="Qwen3-VL",
    # transformers' default sections when rope_parameters names none (modeling_qwen3_vl.py)
    text=MRopeTextFamily(model_type="qwen3_vl_text", config_class="Qwen3VLTextConfig", qk_layernorm=True,
                         chat_template="chatml", default_mrope_section=(24, 20, 20), interleaved_mrope=True),
    tower_class="transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
    hf_prefixes=(("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head.")),
    visual_prefix="model.visual.",
    tower_inputs=tower_inputs,
    # Each DeepStack merger is a patch merger as the main one is (transformers' same class): each maps
    # merged ViT features into the decoder's width, so all of them are the projector.
    projections=("merger", "deepstack_merger_list"),
)
