"""Qwen2.5-VL: its config read into the arch, its table, its refusals, and what its tiny model must hold
for the planted defects to show in the logits (the conversion itself: test_qwen_vl_conversion.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import families
from megatron_ext.errors import UserError
from tests.support.qwen2_5_vl import TEXT, VISION, hf_logits, samples, tiny_config, write_tiny_model


def test_config_is_read_with_its_mrope_sections_and_top_level_tying():
    arch = families.vision_language_family("qwen2_5_vl").read(tiny_config())
    assert arch.text.mrope_section == (4, 6, 6)
    assert (arch.text.qkv_bias, arch.text.tie_word_embeddings, arch.text.kv_channels) == (True, False, 32)
    assert (arch.image_token_id, arch.video_token_id, arch.vision_config["depth"]) == (500, 501, 3)
    assert arch.vision_config["fullatt_block_indexes"] == [1]


def test_mrope_sections_not_covering_half_the_head_are_one_line():
    config = tiny_config()
    config.text_config.rope_parameters["mrope_section"] = [4, 6, 5]
    with pytest.raises(UserError, match=r"^text_config.rope_parameters.mrope_section \[4, 6, 5\] must add up to half "
                                        r"the head size \(16\)$"):
        families.vision_language_family("qwen2_5_vl").read(config)


def test_the_vision_tower_splits_no_parallel_size_but_the_decoder_does():
    arch = families.vision_language_family("qwen2_5_vl").read(tiny_config())
    assert arch.parallel_problems(2, 2) == []
    assert arch.parallel_problems(4, 3) == ["--tp 4 does not divide the text KV heads (num_key_value_heads) (2)",
                                            "--pp 3 does not divide the text layers (4)"]


def test_what_the_model_cannot_run_with_yet_is_refused_in_one_line_each_before_building():
    from megatron_ext.model.execution import ModelExecution
    from megatron_ext.model.provider import ModelOptions

    family = families.vision_language_family("qwen2_5_vl")
    opts = ModelOptions(dtype="bfloat16", execution=ModelExecution(sequence_parallel=True))
    with pytest.raises(UserError, match=r"^Qwen2.5-VL runs without sequence or context parallelism so far$"):
        family.build(family.read(tiny_config()), opts)
    assert family.option_problems(ModelOptions(execution=ModelExecution(cp=2)), family.read(tiny_config())) == [
        "Qwen2.5-VL runs without sequence or context parallelism so far"]


def test_every_tensor_of_the_checkpoint_has_one_row():
    from transformers import Qwen2_5_VLForConditionalGeneration

    family = families.vision_language_family("qwen2_5_vl")
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(tiny_config())
    stored = {name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
              for name in hf.state_dict()}
    rows = family.rows(family.read(tiny_config()))
    assert sorted(h for r in rows for h in r.hf) == sorted(stored)
    assert len({r.megatron for r in rows}) == len(rows) == 4 * 7 + 3 + 3 * 12 + 6


def test_the_tiny_model_has_windowed_and_full_blocks_and_a_window_smaller_than_its_images():
    # What makes a wrong window order or a block attending the whole image change the logits.
    assert VISION["fullatt_block_indexes"] == [1] and VISION["depth"] == 3
    assert VISION["window_size"] == 56 and TEXT["rope_parameters"]["mrope_section"] == [4, 6, 6]


def _hf_logits_with(tmp_path, sample: str, module, field: str, value):
    """transformers' logits on a sample, as they are and with `module(model).field = value`."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    hf_dir = write_tiny_model(tmp_path / "hf")
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    setattr(module(model), field, value)
    inputs = {k: v for k, v in samples()[sample].items() if k != "position_ids"}
    with torch.no_grad():
        return hf_logits(hf_dir, samples()[sample]), model(**inputs).logits


def test_swapped_mrope_sections_move_the_logits_far_beyond_the_tolerance(tmp_path):
    """What the logit test (test_qwen_vl_conversion.py) would see if our sections were [H, T, W] (Qwen2.5-VL's [24, 16, 24])."""
    right, swapped = _hf_logits_with(tmp_path, "two images", lambda m: m.model.language_model.rotary_emb,
                                     "mrope_section", [6, 4, 6])
    assert (right - swapped).abs().max() > 0.1


def test_full_attention_in_every_vision_block_moves_the_logits_far_beyond_the_tolerance(tmp_path):
    """What the logit test (test_qwen_vl_conversion.py) would see if the tower attended over whole images in every block."""
    right, full = _hf_logits_with(tmp_path, "two images", lambda m: m.model.visual, "fullatt_block_indexes", [0, 1, 2])
    assert (right - full).abs().max() > 0.1
