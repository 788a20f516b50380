"""Phi-3: q/k/v and gate/up fused in HF, a sliding window on every layer. Added as one module
(megatron_ext/families/phi3.py) the way ARCHITECTURE.md says; bit-exact round trips at TP/PP 1 and 2
and logit parity with transformers are in tests/convert/test_roundtrip.py (fixture "phi3"); here:
what its table and config say, what is refused, greedy generation at TP2 and a stage-2 run."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext import families
from megatron_ext.errors import UserError
from tests.families.checks import assert_greedy_at_tp2_equals_transformers, assert_stage2_trains_all_but_the_tower


def test_fused_hf_tensors_map_to_megatrons_and_back(llava_phi3_clip):
    from megatron_ext.convert.mapping import llava_mapping

    arch = families.read_llava(json.loads((llava_phi3_clip / "config.json").read_text()))
    t = arch.text
    assert (t.sliding_window, t.sliding_layers, t.num_query_groups) == (6, (True, True), 2)
    table = llava_mapping(arch)
    qkv = table["language_model.decoder.layers.1.self_attention.linear_qkv.weight"]
    fc1 = table["language_model.decoder.layers.1.mlp.linear_fc1.weight"]
    assert qkv.hf == ("language_model.model.layers.1.self_attn.qkv_proj.weight",)
    assert fc1.hf == ("language_model.model.layers.1.mlp.gate_up_proj.weight",)
    # 4 query heads in 2 groups of head_dim 16: HF [q0 q1 q2 q3 k0 k1 v0 v1], Megatron [q0 q1 k0 v0 q2 q3 k1 v1].
    heads = torch.arange(8.0).repeat_interleave(16)[:, None].expand(-1, 64)
    full = qkv.rule.hf_to_megatron([heads])
    assert full[::16, 0].tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert torch.equal(qkv.rule.megatron_to_hf(full)[0], heads)
    assert qkv.rule.shard(full, 1, 2)[::16, 0].tolist() == [2, 3, 5, 7]
    gate_up = torch.arange(256.0)[:, None]
    assert torch.equal(fc1.rule.shard(gate_up, 1, 2), torch.cat([gate_up[64:128], gate_up[192:]]))


def test_partial_rotary_embeddings_are_refused():
    config = {"model_type": "phi3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.75}}
    with pytest.raises(UserError, match=r"^phi3 models with partial_rotary_factor < 1 .* are not supported$"):
        families.text_family("phi3").read(config)


def test_longrope_scaling_is_refused():
    config = {"model_type": "phi3", "num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                  "long_factor": [2.0] * 8}}
    with pytest.raises(UserError, match=r"^RoPE scaling type 'longrope' is not supported \(supported: default, llama3\)$"):
        families.text_family("phi3").read(config)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_greedy_tokens_at_tp2_equal_transformers_and_stage2_trains_the_language_model(
        llava_phi3_clip, train_data, tmp_path):
    megatron = assert_greedy_at_tp2_equals_transformers(llava_phi3_clip, tmp_path)
    changed = assert_stage2_trains_all_but_the_tower(llava_phi3_clip, megatron, train_data, tmp_path)
    assert {"language_model.model.layers.1.self_attn.qkv_proj.weight",
            "language_model.model.layers.1.mlp.gate_up_proj.weight"} <= changed
