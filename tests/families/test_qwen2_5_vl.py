"""Qwen2.5-VL: its config read into the arch, its table, and our model's logits against
transformers' at TP/PP 1 and 2 on inputs built by data/native_resolution.py (two smart-resized
images of odd sizes, a 5-frame video). One launch of 4 ranks computes them (qwen2_5_vl_worker.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext import families
from megatron_ext.errors import UserError
from tests.support.helpers import run_ranks
from tests.support.qwen2_5_vl import TEXT, VISION, hf_logits, samples, tiny_config, write_tiny_model

LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]


def test_config_is_read_with_its_mrope_sections_and_top_level_tying():
    arch = families.vision_language_family("qwen2_5_vl").read(tiny_config())
    assert arch.text.mrope_section == (4, 6, 6)
    assert (arch.text.qkv_bias, arch.text.tie_word_embeddings, arch.text.kv_channels) == (True, False, 32)
    assert (arch.image_token_id, arch.video_token_id, arch.vision_depth) == (500, 501, 3)
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


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen2_5_vl")
    hf_dir = write_tiny_model(out / "hf")
    run_ranks(4, "tests/families/qwen2_5_vl_worker.py", out, hf_dir, timeout=240)
    return out, hf_dir


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sample", ["two images", "video"])
def test_logits_equal_transformers_within_1e_4_at_tp_and_pp_1_and_2(computed, sample):
    out, hf_dir = computed
    reference = hf_logits(hf_dir, samples()[sample])
    assert reference.std() > 1.0  # logits that differ visibly, so the comparison can fail
    for layout in LAYOUTS:
        ours = torch.load(out / "logits" / f"{sample}-{layout}.pt")
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max() <= 1e-4, layout
        assert torch.equal(ours.argmax(-1), reference.argmax(-1)), layout


def test_the_tiny_model_has_windowed_and_full_blocks_and_a_window_smaller_than_its_images():
    # What makes a wrong window order or a block attending the whole image change the logits.
    assert VISION["fullatt_block_indexes"] == [1] and VISION["depth"] == 3
    assert VISION["window_size"] == 56 and TEXT["rope_parameters"]["mrope_section"] == [4, 6, 6]
