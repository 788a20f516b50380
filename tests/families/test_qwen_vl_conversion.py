"""Qwen2.5-VL and Qwen3-VL through the converters both ways at TP/PP 1 and 2, each from one launch of 4
ranks (qwen_vl_worker.py): bit-exact round trips, every first-stage rank holding the tower whole, and the
converted model's logits against transformers' on inputs built by data/native_resolution.py (the
families' tests/support modules: smart-resized images of odd sizes, videos)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass

import pytest
import torch

from tests.support.helpers import hf_tensors, run_ranks

LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]


@dataclass(frozen=True)
class Tiny:
    support: str  # the tests.support module of its tiny model and samples
    tensors: int  # in its checkpoint
    model_class: str  # transformers'
    samples: tuple[str, ...]


FAMILIES = {
    "qwen2_5_vl": Tiny("tests.support.qwen2_5_vl", 93, "Qwen2_5_VLForConditionalGeneration", ("two images", "video")),
    "qwen3_vl": Tiny("tests.support.qwen3_vl", 104, "Qwen3VLForConditionalGeneration",
                     ("two images", "video", "image and video")),
}


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory):
    """(the family's Tiny, its tests.support module, OUT, the original HF dir): OUT/megatron/LAYOUT,
    OUT/hf/LAYOUT, OUT/logits, OUT/vision.json (qwen_vl_worker.py)."""
    tiny = FAMILIES[request.param]
    support = importlib.import_module(tiny.support)
    out = tmp_path_factory.mktemp(request.param)
    hf_dir = support.write_tiny_model(out / "hf_original")
    run_ranks(4, "tests/families/qwen_vl_worker.py", out, hf_dir, tiny.support, timeout=500)
    return tiny, support, out, hf_dir


@pytest.mark.parametrize("converted", list(FAMILIES), indirect=True)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_gives_back_every_tensor_bit_for_bit(converted, layout):
    tiny, _, out, hf_dir = converted
    original, back = hf_tensors(hf_dir), hf_tensors(out / "hf" / layout)
    assert sorted(back) == sorted(original) and len(original) == tiny.tensors
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key


@pytest.mark.parametrize("converted,sample", [(name, sample) for name, tiny in FAMILIES.items()
                                              for sample in tiny.samples], indirect=["converted"])
def test_converted_model_logits_equal_transformers_within_1e_4_at_tp_and_pp_1_and_2(converted, sample):
    """Each layout's logits (and the TP2 x PP2 checkpoint's read at TP1), with the same top token everywhere."""
    _, support, out, hf_dir = converted
    reference = support.hf_logits(hf_dir, support.samples()[sample])
    assert reference.std() > 1.0  # logits that differ visibly, so the comparison can fail
    for layout in [*LAYOUTS, "tp2pp2-at-tp1pp1"]:
        ours = torch.load(out / "logits" / f"{sample}-{layout}.pt")
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max() <= 1e-4, layout
        assert torch.equal(ours.argmax(-1), reference.argmax(-1)), layout


@pytest.mark.parametrize("converted", list(FAMILIES), indirect=True)
def test_every_first_stage_rank_holds_the_vision_qkv_whole_and_averages_the_towers_grads_over_tp(converted):
    _, support, out, _ = converted
    vision = json.loads((out / "vision.json").read_text())
    whole = [True] * support.VISION["depth"]
    assert vision["qkv"] == {"tp1pp1": [whole] * 4, "tp2pp1": [whole] * 4, "tp1pp2": [whole, whole, [], []],
                             "tp2pp2": [whole, whole, [], []]}
    assert vision["averaged"] == {"tp1pp1": [True] * 4, "tp2pp1": [True] * 4, "tp1pp2": [True, True, None, None],
                                  "tp2pp2": [True, True, None, None]}


@pytest.mark.parametrize("converted", list(FAMILIES), indirect=True)
def test_exported_model_loads_in_transformers_without_missing_keys(converted):
    import transformers

    tiny, _, out, _ = converted
    _, info = getattr(transformers, tiny.model_class).from_pretrained(out / "hf" / "tp2pp2", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
