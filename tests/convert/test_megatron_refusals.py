"""megatron-core's own checks, reached by a bad config.json or flag, become one line naming the
settings and their values (megatron_ext/model/build_errors.py), not a long traceback ending in a bare
`AssertionError`; anything else raised while building propagates as it is."""

from __future__ import annotations

import json
import re

import pytest

from megatron_ext import families
from megatron_ext.errors import UserError
from megatron_ext.model.build_errors import megatron_refusals
from megatron_ext.model.execution import ModelExecution
from megatron_ext.model.provider import ModelOptions, transformer_configs
from megatron_ext.model.specs import llava_specs


def _arch(llava_clip, **vision_config):
    config = json.loads((llava_clip / "config.json").read_text())
    config["vision_config"].update(vision_config)
    return families.read_llava(config)


def test_a_bare_assertion_in_megatron_core_names_the_config_fields_and_values(llava_clip):
    """An image off the ViT's patch grid, as the provider once passed it, fails megatron-core's
    `assert self.img_h % self.patch_dim == 0` (no message) in CLIPViTModel."""
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    arch = _arch(llava_clip, image_size=30)
    language, vision, _ = transformer_configs(arch, families.of(arch), ModelOptions(), "local", 1, 1)
    with pytest.raises(UserError) as info, megatron_refusals():
        CLIPViTModel(vision, llava_specs("local", language).vision, img_h=arch.vision.image_size,
                     img_w=arch.vision.image_size, patch_dim=arch.vision.patch_size, model_subtype=arch.vision.subtype)
    assert re.fullmatch(
        r"megatron-core cannot build this model: it requires `self\.img_h % self\.patch_dim == 0` "
        r"\(megatron/core/models/vision/clip_vit_model\.py:\d+\), where self\.img_h = 30 \(config\.json "
        r"vision_config\.image_size\), self\.patch_dim = 14 \(config\.json vision_config\.patch_size\); "
        r"change them in config\.json or on the command line", str(info.value)), str(info.value)


def test_a_transformer_config_refusal_names_the_flags(llava_clip):
    """Sequence parallelism without tensor parallelism, refused by megatron-core's ModelParallelConfig
    in its own words (run.py and the trainer refuse it first: tests/launch/test_refused_before_megatron.py)."""
    arch = _arch(llava_clip)
    options = ModelOptions(execution=ModelExecution(attention_backend="local", sequence_parallel=True))
    with pytest.raises(UserError) as info, megatron_refusals():
        transformer_configs(arch, families.of(arch), options, "local", 1, 1)
    assert re.fullmatch(
        r"megatron-core cannot build this model: it refuses `self\.sequence_parallel and "
        r"self\.tensor_model_parallel_size <= 1`: Cannot use sequence parallelism without tensor parallelism "
        r"\(megatron/core/model_parallel_config\.py:\d+\), where self\.sequence_parallel = True "
        r"\(--sequence-parallel\), self\.tensor_model_parallel_size = 1 \(--tp\); change them in config\.json or "
        r"on the command line", str(info.value)), str(info.value)


def test_what_megatron_core_did_not_raise_propagates_as_it_is():
    with pytest.raises(AssertionError), megatron_refusals():
        raise AssertionError
    with pytest.raises(ValueError, match="^not megatron-core's$"), megatron_refusals():
        raise ValueError("not megatron-core's")
