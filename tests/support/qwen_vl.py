"""What the Qwen-VL test models share: random pixels and text, media runs of placeholder tokens,
a sample's model inputs built by `data/native_resolution.py`, and transformers' logits on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from megatron_ext.data.native_resolution import QwenVision, mrope_positions, token_types

VOCAB = 512
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END, BOS, EOS = 500, 501, 502, 503, 504, 505


def noise(height: int, width: int, seed: int, frames: int | None = None) -> np.ndarray:
    shape = (height, width, 3) if frames is None else (frames, height, width, 3)
    return np.random.RandomState(seed).randint(0, 256, shape, dtype=np.uint8)


def text(seed: int, n: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, IMAGE_TOKEN, n).tolist()


def vision_run(token: int, grid, merge_size: int = 2) -> list[int]:
    t, h, w = (int(v) for v in grid)
    return [VISION_START] + [token] * (t * h * w // merge_size ** 2) + [VISION_END]


def sample(ids: list[int], vision: QwenVision, **media) -> dict:
    """One sample's model inputs: ids [1, S], mRoPE positions [3, 1, S], token types and `media`."""
    types = token_types(ids, IMAGE_TOKEN, VIDEO_TOKEN)
    positions = mrope_positions(types, vision, media.get("image_grid_thw", ()), media.get("video_grid_thw", ()),
                                media.get("second_per_grid_ts"))
    return {"input_ids": torch.tensor([ids]), "position_ids": positions[:, None, :],
            "mm_token_type_ids": torch.from_numpy(types)[None].int(), **media}


def hf_logits(model_class, hf_dir: Path, inputs: dict) -> torch.Tensor:
    """transformers' float32 logits [1, S, vocab] of a sample (its own mRoPE positions)."""
    model = model_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**{k: v for k, v in inputs.items() if k != "position_ids"}).logits.float()


# The layouts the Qwen-VL worker (tests/families/qwen_vl_worker.py) converts to and computes at.
LAYOUTS = ["tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2"]


def assert_logits_equal(out: Path, sample_name: str, reference: torch.Tensor) -> None:
    """Each layout's logits the worker saved in `out` (and the TP2 x PP2 checkpoint's read at TP1)
    equal `reference` within 1e-4, with the same top token everywhere."""
    assert reference.std() > 1.0  # logits that differ visibly, so the comparison can fail
    for layout in [*LAYOUTS, "tp2pp2-at-tp1pp1"]:
        ours = torch.load(out / "logits" / f"{sample_name}-{layout}.pt")
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max() <= 1e-4, layout
        assert torch.equal(ours.argmax(-1), reference.argmax(-1)), layout


def assert_tower_whole_and_averaged(out: Path, depth: int) -> None:
    """Every first-stage rank held each vision block's qkv whole and marked the tower's grads for averaging."""
    vision = json.loads((out / "vision.json").read_text())
    whole = [True] * depth
    assert vision["qkv"] == {"tp1pp1": [whole] * 4, "tp2pp1": [whole] * 4, "tp1pp2": [whole, whole, [], []],
                             "tp2pp2": [whole, whole, [], []]}
    assert vision["averaged"] == {"tp1pp1": [True] * 4, "tp2pp1": [True] * 4, "tp1pp2": [True, True, None, None],
                                  "tp2pp2": [True, True, None, None]}


def assert_loads_without_missing_keys(model_class, hf_dir: Path) -> None:
    _, info = model_class.from_pretrained(hf_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


def convert_everywhere(out: Path, hf_dir: Path, support_module: str, timeout: float) -> None:
    """OUT/megatron/LAYOUT, OUT/hf/LAYOUT, OUT/logits, OUT/vision.json from one launch of 4 ranks
    (tests/families/qwen_vl_worker.py) on the tiny model `support_module` (a tests.support module) describes."""
    from tests.support.helpers import run_ranks

    run_ranks(4, "tests/families/qwen_vl_worker.py", out, hf_dir, support_module, timeout=timeout)


def assert_round_trip_exact(hf_dir: Path, back_dir: Path, tensors: int) -> None:
    """Every one of the `tensors` tensors of `hf_dir` comes back from `back_dir` with its dtype, bit for bit."""
    from tests.support.helpers import hf_tensors

    original, back = hf_tensors(hf_dir), hf_tensors(back_dir)
    assert sorted(back) == sorted(original) and len(original) == tensors
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
