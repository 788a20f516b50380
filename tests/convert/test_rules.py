"""The split rules and the mapping table, on small hand-made tensors (no processes)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.convert import coverage
from megatron_ext.convert.mapping import hf_only_names, llava_mapping
from megatron_ext.families import read_llava
from megatron_ext.model.mapping_rules import GATED_MLP, QKV, VocabParallel


def _rows(n, tag, width=2):
    """n rows; row i is filled with tag + i, so every row says where it came from."""
    return torch.arange(n, dtype=torch.float32)[:, None].add(tag).expand(n, width).clone()


def test_qkv_interleaves_grouped_query_heads_per_group_and_splits_whole_groups():
    # 4 query heads, 2 KV groups, head_dim 1: group g holds q heads 2g, 2g+1, then k_g, then v_g.
    rule = QKV(num_heads=4, num_query_groups=2, head_dim=1)
    q, k, v = _rows(4, 100), _rows(2, 200), _rows(2, 300)
    full = rule.hf_to_megatron([q, k, v])
    assert full[:, 0].tolist() == [100, 101, 200, 300, 102, 103, 201, 301]
    assert rule.shard(full, 1, 2)[:, 0].tolist() == [102, 103, 201, 301]
    back = rule.megatron_to_hf(full)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_qkv_bias_uses_the_same_layout():
    rule = QKV(num_heads=4, num_query_groups=2, head_dim=2)
    q, k, v = torch.arange(8.0), torch.arange(4.0) + 10, torch.arange(4.0) + 20
    full = rule.hf_to_megatron([q, k, v])
    assert full.tolist() == [0, 1, 2, 3, 10, 11, 20, 21, 4, 5, 6, 7, 12, 13, 22, 23]
    assert all(torch.equal(a, b) for a, b in zip(rule.megatron_to_hf(full), (q, k, v)))


def test_gated_mlp_gives_each_rank_its_slice_of_gate_and_of_up():
    gate, up = _rows(4, 0), _rows(4, 10)
    full = GATED_MLP.hf_to_megatron([gate, up])
    assert GATED_MLP.shard(full, 0, 2)[:, 0].tolist() == [0, 1, 10, 11]
    assert GATED_MLP.shard(full, 1, 2)[:, 0].tolist() == [2, 3, 12, 13]
    assert all(torch.equal(a, b) for a, b in zip(GATED_MLP.megatron_to_hf(full), (gate, up)))


def test_vocab_rows_are_padded_with_zeros_and_the_padding_is_dropped_on_the_way_back():
    rule = VocabParallel(vocab_size=5, padded_vocab_size=8)
    table = _rows(5, 1)
    full = rule.hf_to_megatron([table])
    assert full.shape == (8, 2) and torch.equal(full[5:], torch.zeros(3, 2))
    assert rule.shard(full, 1, 2)[:, 0].tolist() == [5, 0, 0, 0]
    assert torch.equal(rule.megatron_to_hf(full)[0], table)
    with pytest.raises(ValueError, match="expected 5 vocabulary rows, found 6"):
        rule.hf_to_megatron([_rows(6, 0)])


@pytest.fixture(scope="module")
def clip_arch(llava_clip):
    return read_llava(json.loads((llava_clip / "config.json").read_text()))


def _hf_names(path):
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_table_and_kept_aside_tensors_cover_an_hf_checkpoint_exactly(llava_clip, clip_arch):
    table = llava_mapping(clip_arch)
    hf = _hf_names(llava_clip)
    used = [name for row in table.values() for name in row.hf]
    assert sorted(used + hf_only_names(clip_arch, hf)) == sorted(hf)
    # The 3-layer tiny CLIP feeds LLaVA from layer 2 (feature layer -2): layer index 2 is kept aside.
    assert "vision_tower.encoder.layers.2.mlp.fc1.weight" in hf_only_names(clip_arch, hf)


def test_coverage_lists_unused_missing_and_doubly_used_hf_tensors(llava_clip, clip_arch):
    table = llava_mapping(clip_arch)
    hf = _hf_names(llava_clip)
    extra = hf_only_names(clip_arch, hf)
    complete = coverage.FillReport(filled=list(table))
    assert coverage.hf_to_megatron_problems(table, [complete], hf, extra) == []

    partial = coverage.FillReport(filled=[name for name in table if name != "language_model.decoder.final_layernorm.weight"],
                                  missing_hf=["language_model.model.norm.weight"], unmapped=["language_model.new.weight"])
    problems = coverage.hf_to_megatron_problems(table, [partial], hf + ["stray.weight"], extra)
    text = "; ".join(problems)
    assert "no row in the mapping table (1): language_model.new.weight" in text
    assert "checkpoint lacks (1): language_model.model.norm.weight" in text
    assert "no Megatron tensor uses (2): language_model.model.norm.weight, stray.weight" in text


def test_reverse_coverage_finds_what_transformers_expects_but_nothing_writes(clip_arch, llava_clip):
    table = llava_mapping(clip_arch)
    hf = _hf_names(llava_clip)
    extra = hf_only_names(clip_arch, hf)
    assert coverage.megatron_to_hf_problems(table, list(table), extra) == []
    assert coverage.expected_hf_problems(coverage.hf_names_written(table, list(table), extra), hf) == []
    assert coverage.megatron_to_hf_problems(table, list(table), extra[1:]) == []  # names alone cannot tell
    problems = coverage.expected_hf_problems(coverage.hf_names_written(table, list(table), extra[1:]), hf)
    assert problems == [f"HF tensors transformers expects that nothing produces (1): {extra[0]}"]
    twice = coverage.megatron_to_hf_problems(table, list(table), extra + [extra[0]])
    assert twice == [f"HF tensors produced more than once (1): {extra[0]}"]


@pytest.mark.parametrize("fixture", ["llava_clip", "llava_qwen2_siglip"])
def test_expected_hf_names_are_what_transformers_saves(request, fixture):
    from megatron_ext.convert.hf_checkpoint import hf_model_names

    path = request.getfixturevalue(fixture)
    # With tied embeddings (the Qwen2 fixture) transformers saves embed_tokens only, no lm_head.
    assert sorted(hf_model_names(json.loads((path / "config.json").read_text()))) == sorted(_hf_names(path))


@pytest.mark.parametrize("dim", [0, 1])
def test_rules_concatenate_like_torch_cat(dim):
    from megatron_ext.model.mapping_rules import concat

    parts = [torch.randn(2, 3), torch.randn(4, 3)] if dim == 0 else [torch.randn(3, 2), torch.randn(3, 1)]
    assert torch.equal(concat(parts, dim), torch.cat(parts, dim))


def test_rules_refuse_to_concatenate_what_torch_cat_refuses():
    from megatron_ext.model.mapping_rules import concat

    # copy_ would broadcast the (2, 1) part over a (2, 3) slot and let a misfit pass the shape check
    with pytest.raises(ValueError, match="cannot concatenate"):
        concat([torch.zeros(2, 3), torch.zeros(2, 1)])

