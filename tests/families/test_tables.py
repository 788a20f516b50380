"""Every family's table names exactly the tensors transformers gives a model of that family (tiny
random models, no processes): a family whose rows miss or invent a tensor fails here first."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import families
from megatron_ext.demo.tiny_models import TinyTextSpec, TinyVisionSpec, tiny_text_config, tiny_tower
from megatron_ext.demo.tiny_presets import TOWER_PRESETS


def _used(once, layer, num_layers) -> list[str]:
    rows = once + [r.at_layer(i) for i in range(num_layers) for r in layer]
    return [name for r in rows if not r.tied for name in r.hf]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("model_type", sorted(families.text_families()))
def test_text_rows_use_every_tensor_of_the_hf_model_once(model_type, tied):
    from transformers import AutoModelForCausalLM

    spec = TinyTextSpec(vocab_size=64, num_layers=2)
    family = families.text_family(model_type)
    config = tiny_text_config(model_type, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                              intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                              num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                              max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=tied)
    names = AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict().keys()
    if tied:
        names = [n for n in names if n != "lm_head.weight"]
    once, layer = family.rows(family.read(config))
    used = _used(once, layer, spec.num_layers)
    assert sorted(used) == sorted(f"language_model.{n}" for n in names)


@pytest.mark.parametrize("kind", sorted(f.full_model_type for f in families.vision_families().values()))
def test_vision_rows_and_the_unused_tensors_cover_the_hf_tower(kind):
    family = next(f for f in families.vision_families().values() if f.full_model_type == kind)
    spec = TinyVisionSpec()
    fields = dict(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                  num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, patch_size=spec.patch_size)
    tower, _ = tiny_tower(family, fields, TOWER_PRESETS[kind].image_size)
    vision = family.read(tower.config, family.feature_layer)
    once, layer = family.rows(vision)
    names = [f"vision_tower.{n}" for n in tower.state_dict()]
    unused = family.unused_names(vision, names)
    assert sorted(_used(once, layer, vision.num_layers) + unused) == sorted(names)
