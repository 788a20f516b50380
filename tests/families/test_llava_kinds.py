"""families/llava.py: LLaVA-1.5, LLaVA-NeXT and OneVision configs read into LlavaArch, and what is refused."""

from __future__ import annotations

import json

import pytest

from megatron_ext.errors import UserError
from megatron_ext.families import read_llava


def _config(path, **changes):
    return {**json.loads((path / "config.json").read_text()), **changes}


def test_tiled_configs_give_their_grid_one_position_per_image_token_and_a_newline_row(llava_next_clip, llava_onevision_siglip,
                                                                                     llava_clip):
    from megatron_ext.convert.mapping import llava_mapping, normalize_hf_name

    next_arch, onevision = read_llava(_config(llava_next_clip)), read_llava(_config(llava_onevision_siglip))
    assert next_arch.tiling.grid_pinpoints == ((56, 112), (112, 56), (112, 112), (168, 56), (56, 168))
    assert (next_arch.tiling.max_tiles, next_arch.tiling.video_token_index) == (None, None)
    assert onevision.tiling.max_tiles == 2
    assert onevision.tiling.video_token_index == _config(llava_onevision_siglip)["video_token_index"]
    assert next_arch.img_seq_len == onevision.img_seq_len == 1
    assert read_llava(_config(llava_clip)).img_seq_len == 16 and read_llava(_config(llava_clip)).tiling is None
    assert llava_mapping(onevision)["image_newline"].hf == ("image_newline",)
    assert "image_newline" not in llava_mapping(read_llava(_config(llava_clip)))
    assert normalize_hf_name("model.image_newline") == "image_newline"


@pytest.mark.parametrize("changes,message", [
    ({"vision_aspect_ratio": "anyres"}, r"^vision_aspect_ratio 'anyres' is not supported \(anyres_max_N, N >= 1\)$"),
    ({"image_grid_pinpoints": [[62, 100]]},
     r"^image_grid_pinpoints \[\[62, 100\]\] are not \(height, width\) multiples of the tower's image size 62$"),
    ({"image_grid_pinpoints": None}, r"^llava_onevision config has no image_grid_pinpoints$"),
])
def test_onevision_configs_it_cannot_lay_out_are_refused(llava_onevision_siglip, changes, message):
    with pytest.raises(UserError, match=message):
        read_llava(_config(llava_onevision_siglip, **changes))


def test_a_tiled_model_keeping_a_class_token_is_refused(llava_next_clip):
    with pytest.raises(UserError, match=r"^vision_feature_select_strategy 'full' keeps clip_vision_model's class token"):
        read_llava(_config(llava_next_clip, vision_feature_select_strategy="full"))
