"""LoRA training (--lora-rank): only the adapters (and the projector when asked) change, the base
model stays bit-identical, the loss falls, and TP2 and PP2 train exactly like one process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import run_torchrun

WORKER = str(Path(__file__).with_name("lora_worker.py"))
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_train_projector": True}
LONG_RUN = 24

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def _run(tmp_path, megatron_clip, train_data, nproc, iters, **options) -> list[dict]:
    run_torchrun(nproc, WORKER, megatron_clip, train_data, tmp_path, json.dumps({**LORA, **options}), iters, timeout=300)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, megatron_clip, train_data) -> dict:
    return _run(tmp_path_factory.mktemp("lora_tp1"), megatron_clip, train_data, 1, LONG_RUN)[0]


def _is_trained(name: str) -> bool:
    return name.endswith((".lora_a.weight", ".lora_b.weight")) or name.startswith("vision_projection.")


def test_only_adapters_and_projector_change(one_process):
    adapters = [n for n in one_process["trainable"] if ".lora_" in n]
    # 2 layers x 4 targets x (A, B)
    assert len(adapters) == 16
    assert all(_is_trained(n) for n in one_process["trainable"])
    assert any(n.startswith("vision_projection.") for n in one_process["trainable"])
    # Every trained tensor moved; every base tensor is bit-identical.
    assert one_process["changed"] == one_process["trainable"]
    assert one_process["optimized"] == one_process["trainable_numel"]


def test_loss_falls(one_process):
    losses = [s["loss"] for s in one_process["steps"]]
    # Step i sees batch i % 3: compare each batch's first and last visit.
    for batch in range(3):
        assert losses[LONG_RUN - 3 + batch] < 0.9 * losses[batch]


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}])
def test_layout_trains_like_one_process(tmp_path, megatron_clip, train_data, one_process, layout):
    ranks = _run(tmp_path, megatron_clip, train_data, 2, 3, **layout)
    for got, expected in zip(ranks[0]["steps"], one_process["steps"][:3]):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5, abs=1e-5)
    for rank in ranks:
        assert rank["trainable"] and all(_is_trained(n) for n in rank["trainable"])
        assert rank["changed"] == rank["trainable"]
    if "pp" in layout:
        # Each stage holds the adapters of its own layer; the projector lives on the first.
        assert [len([n for n in r["trainable"] if ".lora_" in n]) for r in ranks] == [8, 8]
        assert not any(re.match("vision_projection", n) for n in ranks[1]["trainable"])
