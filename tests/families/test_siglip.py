"""SigLIP 2: its fixed-resolution checkpoints are the SigLIP architecture (transformers loads them as
`siglip`), so they are the siglip family; its NaFlex towers are refused with the reason."""

from __future__ import annotations

import json

import pytest

from megatron_ext import families
from megatron_ext.errors import UserError


def test_a_fixed_resolution_siglip2_checkpoint_is_the_siglip_tower():
    from transformers import SiglipConfig

    # As google/siglip2-base-patch16-224 ships: a two-tower `siglip` config.
    config = SiglipConfig(vision_config={"patch_size": 16, "image_size": 224})
    tower = families.vision_tower(config, "--vision-model")
    assert (tower.config.model_type, tower.whole) == ("siglip_vision_model", True)
    family = tower.family
    assert (family.class_token, family.feature_layer, family.select_strategy) == (False, -1, "full")


@pytest.mark.parametrize("config_class", ["Siglip2Config", "Siglip2VisionConfig"])
def test_a_naflex_siglip2_tower_is_refused_with_the_reason(config_class):
    import transformers

    config = getattr(transformers, config_class)()
    with pytest.raises(UserError, match=r"^--vision-model: vision model_type 'siglip2(_vision_model)?' is not supported: "
                                        r"SigLIP 2 NaFlex towers .* fixed-resolution SigLIP 2 checkpoints are "
                                        r"siglip(_vision_model)? and supported \(supported: clip, clip_vision_model, "
                                        r"internvl, internvl_vision, siglip, siglip_vision_model\)$"):
        families.vision_tower(config, "--vision-model")


def test_llava_is_built_from_a_two_tower_siglip2_style_checkpoint(tiny_hf, tmp_path):
    """build_llava takes the vision tower out of a whole `siglip` checkpoint (image and text towers),
    as the fixed-resolution SigLIP 2 ones ship, and reads its features as SigLIP's."""
    import torch
    from transformers import LlavaForConditionalGeneration, SiglipConfig, SiglipImageProcessor, SiglipModel

    from megatron_ext.hf.build_llava import build_llava

    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 32, "patch_size": 16}
    text = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "vocab_size": 100}
    torch.manual_seed(0)
    two_tower = SiglipModel(SiglipConfig(vision_config=vision, text_config=text))
    two_tower.save_pretrained(tmp_path / "siglip2")
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path / "siglip2")

    llava = build_llava(tmp_path / "llava", str(tiny_hf["text"]), str(tmp_path / "siglip2"))
    config = json.loads((llava / "config.json").read_text())
    assert config["vision_config"]["model_type"] == "siglip_vision_model"
    assert (config["vision_feature_layer"], config["vision_feature_select_strategy"]) == (-1, "full")
    tower = LlavaForConditionalGeneration.from_pretrained(llava).model.vision_tower.state_dict()
    expected = two_tower.vision_model.state_dict()
    assert tower.keys() == expected.keys()
    assert all(torch.equal(tower[k], v) for k, v in expected.items())
