"""InternViT-300M as a LLaVA tower: layer scale on every layer's attention and MLP outputs, a class
token LLaVA drops, the last layer read. Bit-exact round trip at TP/PP 1 and 2 and logit parity are in
tests/convert/test_roundtrip.py (fixture "internvit"); here: what is read from its config, what is
refused, the tower taken out of a whole InternVL checkpoint, greedy generation at TP2 and a stage-2
run that trains everything but the tower."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext import families
from megatron_ext.errors import UserError
from tests.families.checks import assert_greedy_at_tp2_equals_transformers, assert_stage2_trains_all_but_the_tower


def test_config_gives_layer_scale_the_last_layer_and_no_class_token(llava_internvit):
    from megatron_ext.convert.mapping import llava_mapping

    config = json.loads((llava_internvit / "config.json").read_text())
    arch = families.read_llava(config)
    v = arch.vision
    assert (v.subtype, v.class_token, v.num_layers) == ("internvit300M", True, 3)
    assert arch.img_seq_len == v.num_patches == 16 == config["image_seq_length"]
    table = llava_mapping(arch)
    assert table["vision_model.decoder.layers.2.mlp.linear_fc2.layer_scale.weight"].hf == (
        "vision_tower.encoder.layer.2.lambda_2",)
    assert table["vision_model.position_embeddings.weight"].rule.hf_shape == (1, 17, 32)


@pytest.mark.parametrize("backend", ["sdpa", "local"])
def test_the_family_puts_a_layer_scale_on_both_residual_branches(llava_internvit, llava_clip, backend):
    """InternViT's hook adds the layer scale to megatron-core's ViT layer; CLIP's leaves it as it is."""
    from megatron_ext.compat.releases import mlp_submodules
    from megatron_ext.model.provider import ModelOptions, transformer_configs
    from megatron_ext.model.specs import llava_specs

    for hf_dir, step in ((llava_internvit, "LayerScale"), (llava_clip, None)):
        arch = families.read_llava(json.loads((hf_dir / "config.json").read_text()))
        language = transformer_configs(arch, families.of(arch), ModelOptions(), backend, tp=1, pp=1)[0]
        spec = families.of(arch).vision.vision_spec(arch.vision, llava_specs(backend, language).vision, backend)
        outputs = (spec.submodules.self_attention.submodules.linear_proj, mlp_submodules(spec.submodules.mlp).linear_fc2)
        assert [layer.__name__ for layer in outputs] == [f"RowParallelLinearWith{step}" if step else
                                                         "RowParallelLinear"] * 2


@pytest.mark.parametrize("field,value,what", [
    ("use_qk_norm", True, r"use_qk_norm=true \(InternViT-6B's RMSNorm on q and k\)"),
    ("norm_type", "rms_norm", r"norm_type 'rms_norm' \(InternViT-6B's\)"),
    ("attention_bias", False, r"attention_bias=false \(InternViT-300M has q/k/v biases\)"),
])
def test_what_internvit_300m_lacks_is_refused(field, value, what):
    from transformers import InternVLVisionConfig

    config = InternVLVisionConfig(**{"attention_bias": True, field: value})
    with pytest.raises(UserError, match=rf"^InternViT towers with {what} are not supported "
                                        r"\(supported: InternViT-300M's layout\)$"):
        families.vision_family("internvl_vision").read(config, -1)


def test_a_non_square_tower_is_refused():
    from transformers import InternVLVisionConfig

    config = InternVLVisionConfig(attention_bias=True, image_size=[448, 224])
    with pytest.raises(UserError, match=r"^vision image_size \[448, 224\] is not square; megatron-core's ViT takes "
                                        r"square images and patches$"):
        families.vision_family("internvl_vision").read(config, -1)


def _whole_internvl(tiny_hf, path):
    """A whole InternVL checkpoint (tower, projector, Qwen2 text), as the -hf InternVL ones ship."""
    from transformers import AutoImageProcessor, InternVLConfig, InternVLForConditionalGeneration, InternVLVisionConfig

    tower = InternVLVisionConfig.from_pretrained(tiny_hf["vision-internvl"])
    text = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
    torch.manual_seed(1)
    whole = InternVLForConditionalGeneration(InternVLConfig(vision_config=tower.to_dict(), text_config=text,
                                                            image_token_id=99))
    whole.save_pretrained(path)
    AutoImageProcessor.from_pretrained(tiny_hf["vision-internvl"]).save_pretrained(path)
    return whole


def test_llava_takes_the_tower_out_of_a_whole_internvl_checkpoint(tiny_hf, tmp_path):
    from transformers import LlavaForConditionalGeneration

    from megatron_ext.hf.build_llava import build_llava

    whole = _whole_internvl(tiny_hf, tmp_path / "internvl")
    llava = build_llava(tmp_path / "llava", str(tiny_hf["text"]), str(tmp_path / "internvl"))
    assert json.loads((llava / "config.json").read_text())["vision_config"]["model_type"] == "internvl_vision"
    tower = LlavaForConditionalGeneration.from_pretrained(llava).model.vision_tower.state_dict()
    expected = whole.model.vision_tower.state_dict()
    assert tower.keys() == expected.keys()
    assert all(torch.equal(tower[name], expected[name]) for name in expected)


def test_a_tower_checkpoint_missing_tensors_is_refused_not_filled_at_random(tiny_hf, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_ext.hf.build_llava import build_llava

    tower = shutil.copytree(tiny_hf["vision-internvl"], tmp_path / "tower")
    tensors = load_file(tower / "model.safetensors")
    del tensors["encoder.layer.1.lambda_1"]
    save_file(tensors, tower / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=rf"^--vision-model {tower}: the checkpoint lacks 1 of the InternVLVisionModel "
                                        r"tensors \(e.g. encoder.layer.1.lambda_1\); give a internvl_vision or internvl "
                                        r"checkpoint$"):
        build_llava(tmp_path / "llava", str(tiny_hf["text"]), str(tower))
    assert not (tmp_path / "llava").exists()


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_greedy_tokens_at_tp2_equal_transformers_and_stage2_trains_all_but_the_tower(
        llava_internvit, train_data, tmp_path):
    megatron = assert_greedy_at_tp2_equals_transformers(llava_internvit, tmp_path)
    assert_stage2_trains_all_but_the_tower(llava_internvit, megatron, train_data, tmp_path)
