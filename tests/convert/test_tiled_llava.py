"""LLaVA-NeXT and LLaVA-OneVision: HF -> Megatron -> HF gives every tensor back bit for bit (NeXT at
TP {1,2} x PP {1,2}, OneVision at TP2 x PP2, which splits both ways), and the Megatron model's logits
match transformers' at TP2 x PP2 on two images of different aspect ratios, a text-only prompt, and for
OneVision an image whose grid is downsampled (anyres_max), two images of one tile each, and a 4-frame
video. (Loading a checkpoint at other layouts than it was converted at: test_roundtrip.)

One process launch does all the work (tiled_worker.py, exporting through export_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.helpers import hf_tensors, run_ranks

FIXTURES = {"next": "llava_next_clip", "onevision": "llava_onevision_siglip"}
LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]
# What tiled_worker.py converts: the first model at every layout, the other at TP2 x PP2.
CONVERTED = [("next", layout) for layout in LAYOUTS] + [("onevision", "tp2pp2")]
LOGIT_LAYOUT = "tp2pp2"
PROMPT = "What is in this picture?"
FRAMES = 4


def _chat(processor, parts: list[dict]) -> str:
    return processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)


def _samples(name: str, hf_dir: Path) -> dict[str, dict]:
    """HF processor batches of one sample each."""
    from megatron_ext.convert.compare import process_inputs, synthetic_image
    from megatron_ext.hf.processors import load_processor

    processor = load_processor(hf_dir, "--hf-dir")
    # 500x300 and 300x700 pictures at the tiny tower's scale (56-pixel tiles for 336).
    wide, tall = synthetic_image(0, (83, 50)), synthetic_image(1, (50, 117))
    samples = {"two_images": process_inputs(processor, [wide, tall], PROMPT),
               "text_only": processor(text=_chat(processor, [{"type": "text", "text": PROMPT}]), return_tensors="pt")}
    if name == "onevision":
        samples["downsampled"] = process_inputs(processor, [synthetic_image(2, (170, 110))], PROMPT)
        # Images of a multi-image sample are one tile each.
        two = _chat(processor, [{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPT}])
        samples["one_tile_each"] = processor(images=[[wide, tall]], text=two, return_tensors="pt")
        samples["video"] = _video(processor)
    return {name: dict(batch) for name, batch in samples.items()}


def _video(processor) -> dict:
    """A 4-frame video and a prompt about it, through the checkpoint's processor (its frames equal
    transformers' video processor's: tests/data/test_video.py)."""
    import numpy as np

    from megatron_ext.convert.compare import synthetic_image

    frames = np.stack([np.asarray(synthetic_image(10 + i, (60, 60))) for i in range(FRAMES)])
    text = _chat(processor, [{"type": "video"}, {"type": "text", "text": PROMPT}])
    return processor(videos=[frames], text=text, return_tensors="pt")


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory):
    """OUT/megatron/NAME/LAYOUT, OUT/hf/NAME/LAYOUT, OUT/inputs/NAME/SAMPLE.pt, OUT/logits/NAME/SAMPLE-LAYOUT.pt."""
    hf_dirs = {name: request.getfixturevalue(fixture) for name, fixture in FIXTURES.items()}
    out = tmp_path_factory.mktemp("tiled")
    for name, hf_dir in hf_dirs.items():
        (out / "inputs" / name).mkdir(parents=True)
        for sample, batch in _samples(name, hf_dir).items():
            torch.save(batch, out / "inputs" / name / f"{sample}.pt")
    run_ranks(4, "tests/convert/tiled_worker.py", out, *(f"{n}={p}" for n, p in hf_dirs.items()), timeout=600)
    return out, hf_dirs


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "layout"), CONVERTED)
def test_round_trip_gives_back_every_tensor_bit_for_bit(converted, name, layout):
    out, hf_dirs = converted
    original, back = hf_tensors(hf_dirs[name]), hf_tensors(out / "hf" / name / layout)
    assert "image_newline" in original
    assert sorted(back) == sorted(original)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    config, built = (json.loads((d / "config.json").read_text()) for d in (out / "hf" / name / layout, hf_dirs[name]))
    for key in ("model_type", "architectures", "image_grid_pinpoints", "vision_aspect_ratio", "image_token_index",
                "video_token_index", "vision_feature_layer", "vision_feature_select_strategy"):
        assert config.get(key) == built.get(key), key


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(FIXTURES))
def test_exported_model_and_processor_load_in_transformers_as_their_class(converted, name):
    import transformers

    from megatron_ext.families import llava_kind
    from megatron_ext.hf.processors import load_processor

    out, hf_dirs = converted
    exported = out / "hf" / name / "tp2pp2"
    model_class = getattr(transformers, llava_kind(json.loads((exported / "config.json").read_text())).model_class)
    model, info = model_class.from_pretrained(exported, output_loading_info=True)
    assert type(model).__name__ == json.loads((hf_dirs[name] / "config.json").read_text())["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ours, theirs = load_processor(exported, "--hf-dir"), load_processor(hf_dirs[name], "--hf-dir")
    assert type(ours) is type(theirs)
    assert ours.image_processor.to_dict() == theirs.image_processor.to_dict()
    assert ours.tokenizer(PROMPT)["input_ids"] == theirs.tokenizer(PROMPT)["input_ids"]
    assert ours.chat_template == theirs.chat_template
    saved = [json.loads((d / "processor_config.json").read_text()) for d in (exported, hf_dirs[name])]
    assert saved[0].get("video_processor") == saved[1].get("video_processor")
    assert ("video_processor" in saved[0]) == (name == "onevision")


def _samples_of(out: Path, name: str) -> list[str]:
    return sorted(path.stem for path in (out / "inputs" / name).glob("*.pt"))


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(FIXTURES))
def test_megatron_logits_match_transformers_at_tp2_pp2(converted, name):
    from megatron_ext.convert.compare import hf_logits, logit_stats

    out, hf_dirs = converted
    expected = {"two_images", "text_only"} | ({"downsampled", "one_tile_each", "video"} if name == "onevision" else set())
    assert set(_samples_of(out, name)) == expected
    for sample in _samples_of(out, name):
        inputs = torch.load(out / "inputs" / name / f"{sample}.pt")
        reference = hf_logits(hf_dirs[name], inputs)
        assert reference.std() > 0.1  # logits that differ visibly, so the comparison can fail
        stats = logit_stats(reference, torch.load(out / "logits" / name / f"{sample}-{LOGIT_LAYOUT}.pt"))
        assert stats.max_abs <= 1e-4, (sample, stats)
        assert stats.argmax_agree, (sample, stats)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_the_samples_hold_what_they_claim(converted):
    """Full grids of different shapes, a downsampled grid, single tiles and a video reach the model."""
    from megatron_ext.convert.compare import megatron_media
    from megatron_ext.families import read_llava
    from megatron_ext.model.tiling import IMAGE, VIDEO, downsampled, grid_shape, unpadded_box

    out, hf_dirs = converted
    arch = {name: read_llava(json.loads((hf_dirs[name] / "config.json").read_text())) for name in FIXTURES}

    def media(name, sample):
        return megatron_media(arch[name], torch.load(out / "inputs" / name / f"{sample}.pt"))[1].tolist()

    tile, side = 56, 4
    grids = [grid_shape(h, w, arch["next"].tiling, tile) for _, _, h, w in media("next", "two_images")]
    assert len(set(grids)) == 2 and all(r * c > 1 for r, c in grids)
    [(kind, tiles, h, w)] = media("onevision", "downsampled")
    rows, cols = grid_shape(h, w, arch["onevision"].tiling, tile)
    top, bottom, left, right = unpadded_box(rows * side, cols * side, h, w)
    assert (kind, tiles) == (IMAGE, rows * cols + 1)
    assert downsampled(bottom - top, right - left, side, 2) != (bottom - top, right - left)
    assert [(kind, tiles) for kind, tiles, _, _ in media("onevision", "one_tile_each")] == [(IMAGE, 1), (IMAGE, 1)]
    assert [(kind, tiles) for kind, tiles, _, _ in media("onevision", "video")] == [(VIDEO, FRAMES)]
    assert media("onevision", "text_only") == []
