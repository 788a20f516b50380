"""A frozen vision tower's output for a whole step, handed to each micro batch (`model/step_vision.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.model import step_vision


class _Tower(torch.nn.Module):
    """[n, 3, h, w] -> [n, 2, 4], one output row pair per image, counting its forwards."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 4)
        self.forwards = 0

    def forward(self, images):
        self.forwards += 1
        return self.proj(images.flatten(2).mean(-1)).unsqueeze(1).repeat(1, 2, 1)


def _inputs(**fields):
    defaults = dict(host_layout=True, vision_once_per_step=True, dtype=torch.float32,
                    to_device=lambda t, dtype=None: t.to(dtype=dtype))
    return SimpleNamespace(**{**defaults, **fields})


def _micro_batches(counts):
    gen = torch.Generator().manual_seed(0)
    return [{"images": torch.randn(n, 3, 8, 8, generator=gen), "key": i} for i, n in enumerate(counts)]


def _frozen_tower():
    tower = _Tower().requires_grad_(False)
    return tower, SimpleNamespace(add_encoder=True, vision_model=tower)


def test_each_micro_batch_gets_its_own_images_features_from_one_forward():
    tower, llava = _frozen_tower()
    batches = _micro_batches([2, 0, 3, 1])
    out = list(step_vision.with_tower_features(llava, _inputs(), batches))
    assert tower.forwards == 1
    for batch, given in zip(batches, out):
        assert given["key"] == batch["key"] and given["images"] is batch["images"]
        assert torch.equal(given["vision_features"], tower(batch["images"]))


def test_the_tower_runs_in_chunks_with_the_same_rows(monkeypatch):
    tower, llava = _frozen_tower()
    batches = _micro_batches([3, 2])
    whole = list(step_vision.with_tower_features(llava, _inputs(), batches))
    monkeypatch.setattr(step_vision, "CHUNK_VALUES", 2 * 3 * 8 * 8)  # two images per chunk
    tower.forwards = 0
    chunked = list(step_vision.with_tower_features(llava, _inputs(), batches))
    assert tower.forwards == 3
    for a, b in zip(whole, chunked):
        assert torch.equal(a["vision_features"], b["vision_features"])


@pytest.mark.parametrize("case", ["a trained tower", "asked per micro batch", "megatron-core's own layout",
                                  "no tower on this pipeline stage", "no images"])
def test_the_micro_batches_are_unchanged_when_the_tower_must_run_per_micro_batch(case):
    tower, llava = _frozen_tower()
    inputs, counts = _inputs(), [2, 1]
    if case == "a trained tower":  # LoRA on the tower trains one of its parameters
        tower.proj.bias.requires_grad_(True)
    elif case == "asked per micro batch":
        inputs = _inputs(vision_once_per_step=False)
    elif case == "megatron-core's own layout":
        inputs = _inputs(host_layout=False)
    elif case == "no tower on this pipeline stage":
        llava = SimpleNamespace(add_encoder=False, vision_model=None)
    else:
        counts = [0, 0]
    batches = _micro_batches(counts)
    assert all(a is b for a, b in zip(step_vision.with_tower_features(llava, inputs, batches), batches, strict=True))
    assert tower.forwards == 0


def test_a_step_whose_tower_output_would_exceed_the_budget_runs_in_groups_when_reached(monkeypatch):
    """Each group of micro batches holds at most HELD_VALUES pixel values of images (here 3 images')
    and is computed only when the schedule asks for its first micro batch."""
    tower, llava = _frozen_tower()
    monkeypatch.setattr(step_vision, "HELD_VALUES", 3 * 3 * 8 * 8)
    batches = _micro_batches([2, 1, 2, 0, 3, 0, 0, 1])
    given = step_vision.with_tower_features(llava, _inputs(), batches)
    forwards = []
    for batch in given:
        forwards.append(tower.forwards)
        assert torch.equal(batch["vision_features"], tower(batch["images"]))
        tower.forwards -= 1  # not counting the check's own forward
    # Groups [2, 1], [2, 0], [3, 0, 0], [1].
    assert forwards == [1, 1, 2, 2, 3, 3, 3, 4]
