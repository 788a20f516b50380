"""SigLIP 2: its fixed-resolution checkpoints are the SigLIP architecture (transformers loads them as
`siglip`), so they are the siglip family; its NaFlex towers are refused with the reason."""

from __future__ import annotations

import pytest

from megatron_ext import families
from megatron_ext.errors import UserError


def test_a_fixed_resolution_siglip2_checkpoint_is_the_siglip_tower():
    from transformers import SiglipConfig

    # As google/siglip2-base-patch16-224 ships: a two-tower `siglip` config.
    config = SiglipConfig(vision_config={"patch_size": 16, "image_size": 224})
    tower = families.tower_config(config, "--vision-model")
    assert tower.model_type == "siglip_vision_model"
    family = families.vision_family(tower.model_type)
    assert (family.class_token, family.feature_layer, family.select_strategy) == (False, -1, "full")


@pytest.mark.parametrize("config_class", ["Siglip2Config", "Siglip2VisionConfig"])
def test_a_naflex_siglip2_tower_is_refused_with_the_reason(config_class):
    import transformers

    config = getattr(transformers, config_class)()
    with pytest.raises(UserError, match=r"^--vision-model: vision model_type 'siglip2(_vision_model)?' is not supported: "
                                        r"SigLIP 2 NaFlex towers .* fixed-resolution SigLIP 2 checkpoints are "
                                        r"siglip(_vision_model)? and supported \(supported: clip, clip_vision_model, "
                                        r"siglip, siglip_vision_model\)$"):
        families.tower_config(config, "--vision-model")
