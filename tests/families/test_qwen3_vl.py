"""Qwen3-VL: its config read into the arch, its table, its interleaved mRoPE angles, its refusals, and
what its tiny model must hold for the planted defects (chunked mRoPE, a DeepStack feature after the
wrong layer) to show in the logits (the conversion itself: test_qwen_vl_conversion.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import families
from megatron_ext.errors import UserError
from tests.support.helpers import hf_tensors
from tests.support.qwen3_vl import TEXT, VISION, samples, tiny_config, write_tiny_model


def test_config_is_read_with_interleaved_sections_per_head_norms_and_top_level_tying():
    family = families.vision_language_family("qwen3_vl")
    arch = family.read(tiny_config())
    assert arch.text.mrope_section == (4, 6, 6) and family.text.interleaved_mrope
    assert (arch.text.qkv_bias, arch.text.qk_layernorm, arch.text.tie_word_embeddings) == (False, True, False)
    assert (arch.image_token_id, arch.video_token_id, arch.deepstack_features) == (500, 501, 2)
    assert family.read({**tiny_config().to_dict(), "tie_word_embeddings": True}).text.tie_word_embeddings


def test_interleaved_mrope_angles_equal_transformers_and_differ_from_chunked_ones():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from megatron_ext.compat import cpu_support
    from megatron_ext.model.interleaved_mrope import InterleavedMultimodalRotaryEmbedding

    cpu_support.apply()  # megatron-core places inv_freq on the current CUDA device

    positions = samples()["two images"]["position_ids"]
    ours = InterleavedMultimodalRotaryEmbedding(32, 1.0, rotary_base=1e6)(positions, [4, 6, 6])
    cos, _ = Qwen3VLTextRotaryEmbedding(tiny_config().text_config)(torch.zeros(1, dtype=torch.float32), positions)
    assert ours.shape == (positions.shape[-1], 1, 1, 32)
    assert torch.equal(ours[:, 0, 0].cos(), cos[0])
    chunked = MultimodalRotaryEmbedding(32, 1.0, rotary_base=1e6)(positions, [4, 6, 6])
    assert (chunked.cos() - ours.cos()).abs().max() > 0.5


def test_a_first_pipeline_stage_with_fewer_layers_than_deepstack_features_is_one_line():
    arch = families.vision_language_family("qwen3_vl").read(tiny_config())
    assert arch.parallel_problems(2, 2) == []
    with pytest.raises(UserError, match=r"^--pp 4 leaves 1 decoder layers on the first pipeline stage, fewer than the "
                                        r"2 that Qwen3-VL's DeepStack features are added after$"):
        arch.check_parallel(1, 4)


def test_what_the_model_cannot_run_with_yet_is_refused_in_one_line_each_before_building():
    from megatron_ext.model.execution import ModelExecution
    from megatron_ext.model.provider import ModelOptions

    family = families.vision_language_family("qwen3_vl")
    opts = ModelOptions(dtype="bfloat16", execution=ModelExecution(recompute_granularity="full"))
    with pytest.raises(UserError, match=r"^Qwen3-VL runs without full recomputation so far \(its DeepStack features are "
                                        r"added by hooks on the first decoder layers\); use --recompute-granularity "
                                        r"selective$"):
        family.build(family.read(tiny_config()), opts)


def test_every_tensor_of_the_checkpoint_has_one_row(tmp_path):
    family = families.vision_language_family("qwen3_vl")
    stored = hf_tensors(write_tiny_model(tmp_path / "hf"))
    rows = family.rows(family.read(tiny_config()))
    assert sorted(h for r in rows for h in r.hf) == sorted(stored)
    # decoder: 4 layers of 8, 3 once; tower: patch embed 2, pos_embed, 3 blocks of 12, 3 mergers of 6
    assert len({r.megatron for r in rows}) == len(rows) == 4 * 8 + 3 + 3 + 3 * 12 + 3 * 6


def test_the_tiny_model_adds_deepstack_features_after_two_layers_with_sections_chunking_would_place_elsewhere():
    # What makes chunked mRoPE or a feature added after the wrong layer change the logits.
    assert VISION["deepstack_visual_indexes"] == [0, 1] and TEXT["num_hidden_layers"] == 4
    assert TEXT["rope_parameters"]["mrope_section"] == [4, 6, 6]
