"""model/tower_inputs.py: each Qwen-VL family computes on the host what transformers' tower computes
from its grid, by the keywords the tower takes. Given them, the tower's features are the same to the
bit, and each one is used (changed, it changes the features), so the tower computes none of them
itself: on a GPU, nothing read back from its grid. The trainer under the GPU rehearsal shows that
(tests/train/test_gpu_rehearsal.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from megatron_ext.model.tower_inputs import BOUNDARIES, attends_through_flash, takes_precomputed, tower_kwargs

FAMILIES = ["qwen2_5_vl", "qwen3_vl"]
# (T, H, W) in patches: two images of odd shapes (several windows across one) and a 2-frame video.
GRIDS = [[1, 6, 10], [1, 4, 2], [2, 8, 6]]


def tower_and_inputs(name: str, dtype=torch.float32):
    """(a tiny tower of family `name`, its `tower_inputs`, GRIDS, pixels for them) in `dtype`."""
    family = importlib.import_module(f"megatron_ext.families.{name}").FAMILY
    config = importlib.import_module(f"tests.support.{name}").tiny_config()
    torch.manual_seed(0)
    tower = family.tower(family.read(config), dtype)
    vision = tower.config
    grid = torch.tensor(GRIDS)
    pixels = torch.randn(int(grid.prod(-1).sum()), vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
    return tower, family.tower_inputs, grid, pixels.to(dtype)


def features(tower, pixels, grid, **given) -> list[torch.Tensor]:
    with torch.no_grad():
        out = tower(pixels, grid_thw=grid, **given)
    return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]


def _changed(name: str, value: torch.Tensor) -> torch.Tensor:
    """`value` altered as a defect would: one attention boundary dropped (two images attend to each
    other), anything else shifted by one row."""
    return torch.cat([value[:1], value[2:]]) if name in BOUNDARIES else value.roll(1, 0)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_tower_given_its_grid_values_from_the_host_gives_the_same_features_to_the_bit(name):
    tower, compute, grid, pixels = tower_and_inputs(name)
    own = features(tower, pixels, grid)
    given = features(tower, pixels, grid, **tower_kwargs(lambda g: compute(tower, g), grid, lambda t: t, flash=False))
    assert len(given) == len(own) and all(torch.equal(a, b) for a, b in zip(given, own))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_tower_uses_every_value_it_is_given(name):
    tower, compute, grid, pixels = tower_and_inputs(name)
    values = compute(tower, grid)
    own = features(tower, pixels, grid)
    for key, value in values.items():
        altered = features(tower, pixels, grid, **{**values, key: _changed(key, value)})
        assert not torch.equal(altered[0], own[0]), key


def test_under_sdpa_the_boundaries_stay_on_the_host_and_the_rest_go_to_the_device():
    moved = []
    tower, compute, grid, _ = tower_and_inputs("qwen2_5_vl")
    assert not attends_through_flash(tower)
    given = tower_kwargs(lambda g: compute(tower, g), grid, lambda t: moved.append(t) or t, flash=False)
    assert sorted(given) == ["cu_seqlens", "cu_window_seqlens", "position_ids", "window_index"]
    assert {id(t) for t in moved} == {id(given["position_ids"]), id(given["window_index"])}


def test_under_flash_attention_the_boundaries_go_to_the_device_with_their_longest_sequences():
    """GRIDS' sequences: the images' 60 and 8 patches, the video's 48 per frame (a frame attends to
    itself); the tiny Qwen2.5-VL's windows (56 pixels: 2 x 2 merged patches) hold at most 16."""
    moved = []
    tower, compute, grid, _ = tower_and_inputs("qwen2_5_vl")
    tower.config._attn_implementation = "flash_attention_2"
    assert attends_through_flash(tower)
    given = tower_kwargs(lambda g: compute(tower, g), grid, lambda t: moved.append(t) or t, flash=True)
    assert {id(t) for t in moved} == {id(t) for t in given.values() if isinstance(t, torch.Tensor)}
    assert (given["max_seqlen"], given["max_window_seqlen"]) == (60, 16)


def test_a_transformers_before_5_17_computes_its_own(monkeypatch):
    """5.10 has `vision_utils` but not the function Qwen3-VL's values come from (its tower took others)."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.16.2")
    assert not takes_precomputed()
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    assert takes_precomputed()
