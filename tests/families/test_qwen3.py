"""Qwen3: per-head q/k RMSNorm and a head_dim other than hidden / heads. Conversion, bit-exact round
trip at TP/PP 1 and 2 and logit parity are in tests/convert/test_roundtrip.py (fixture "qwen3");
here: what is read from its config, greedy generation at TP2 and a stage-2 run."""

from __future__ import annotations

import json

import pytest

from megatron_ext import families
from megatron_ext.errors import UserError
from tests.families.checks import assert_greedy_at_tp2_equals_transformers, assert_stage2_trains_all_but_the_tower


def test_config_gives_per_head_qk_norms_and_its_own_head_dim(llava_qwen3_siglip):
    from megatron_ext.convert.mapping import llava_mapping

    arch = families.read_llava(json.loads((llava_qwen3_siglip / "config.json").read_text()))
    t = arch.text
    assert (t.hidden_size, t.num_attention_heads, t.kv_channels) == (64, 4, 32)
    assert t.qk_layernorm and not t.qkv_bias
    table = llava_mapping(arch)
    assert table["language_model.decoder.layers.1.self_attention.q_layernorm.weight"].hf == (
        "language_model.model.layers.1.self_attn.q_norm.weight",)
    assert "language_model.decoder.layers.0.self_attention.linear_qkv.bias" not in table


def test_attention_bias_is_refused():
    config = {"model_type": "qwen3", "attention_bias": True}
    with pytest.raises(UserError, match=r"^qwen3 models with attention_bias=true \(bias on o_proj too\) are not supported$"):
        families.text_family(config["model_type"]).read(config)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_greedy_tokens_at_tp2_equal_transformers_and_stage2_trains_the_language_model(
        llava_qwen3_siglip, train_data, tmp_path):
    megatron = assert_greedy_at_tp2_equals_transformers(llava_qwen3_siglip, tmp_path)
    changed = assert_stage2_trains_all_but_the_tower(llava_qwen3_siglip, megatron, train_data, tmp_path)
    assert "language_model.model.layers.1.self_attn.k_norm.weight" in changed
