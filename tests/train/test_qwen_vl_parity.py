"""Qwen2.5-VL and Qwen3-VL train as transformers trains them (issue 48): the parity check
(megatron_ext/verify/parity.py), fp32 on CPU, on each tiny model (tests/support/qwen2_5_vl.py,
qwen3_vl.py) at TP2, stage 2 (Qwen2.5-VL with the tower trained too), and packed; two steps of SGD
with momentum on the synthetic conversations (images of many sizes in one micro batch) and on a mix
with videos (Qwen3-VL's frame pairs each after its time as text). transformers computes its own mRoPE
positions from the tokens, grids and token types, and adds its own DeepStack features, so a defect in
ours shows: each one planted in our trainer is caught."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from megatron_ext.verify import parity
from tests.support.training import plant_in_parity_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]

# SGD: Adam moves every weight by about lr whatever its gradient, so float noise in near-zero
# gradients grows past the check's weight bound in two steps on this tiny model (our own TP1 and
# TP2 runs differ as much); SGD keeps the two sides as close as their gradients are.
OPTIONS = {"stage": 2, "lr": 1e-3, "seq_length": 256, "weight_decay": 0.1, "tp": 2, "micro_batch_size": 2,
           "global_batch_size": 4, "optimizer": "sgd", "sgd_momentum": 0.9}
# Their sitecustomize modules plant a defect in our trainer's ranks.
SHIFTED_IMAGE_POSITIONS = Path(__file__).with_name("shifted_image_positions")
LEAKY_PACKS = Path(__file__).with_name("leaky_packs")
LATE_DEEPSTACK = Path(__file__).with_name("late_deepstack")


@pytest.fixture(scope="module")
def qwen(request, tmp_path_factory):
    """(the family's name, its tiny model, the model's TP1 conversion)."""
    from megatron_ext.convert.to_megatron import convert

    family = request.param
    hf_dir = importlib.import_module(f"tests.support.{family}").write_tiny_model(tmp_path_factory.mktemp(f"{family}_hf"))
    return family, hf_dir, convert(hf_dir, tmp_path_factory.mktemp(f"{family}_megatron") / "tp1", 1, 1)


def _report(qwen, data, work_dir, **options) -> parity.Report:
    _, hf_dir, megatron_dir = qwen
    ours = parity.run_ours(hf_dir, str(data), work_dir, 2, 2, {**OPTIONS, **options}, quiet=True,
                           megatron_dir=megatron_dir)
    return parity.compare(ours, parity.run_hf(ours, progress=lambda line: None))


# name: (options over OPTIONS, the data's fixture)
RUNS = {
    # Stage 2: the decoder and the merger(s); two unpacked micro batches of two samples per step.
    "stage2": ({}, "train_data"),
    # The tower trained too: its gradients averaged over the two tensor ranks that hold it whole.
    "unfrozen-tower": ({"unfreeze_vit": True}, "train_data"),
    # Packed rows of 4 samples each (THD), positions restarting at every sample.
    "packed": ({"micro_batch_size": 1, "packing_seq_length": 256}, "train_data"),
    # tests/support/tiled_data.py's mix, packed: two-image samples, text only, and videos of 4 frames
    # (Qwen2.5-VL: 0.6 s per frame pair, which transformers' positions of a video take from the batch;
    # Qwen3-VL: each frame pair a grid of its own, after its time as text).
    "packed-videos": ({"micro_batch_size": 1, "seq_length": 2048, "packing_seq_length": 2048, "video_frames": 4},
                      "tiled_mix"),
}
# family: {run: the tensors it trains}. Each run is one family's only where the other's covers the
# same code: Qwen2.5-VL's tower trained too is stage 2 plus the tower (the replicated HF module, as
# Qwen3-VL's), Qwen3-VL's its 47 decoder tensors and the 18 of its three mergers; both families'
# packed videos runs pack images and text-only samples too.
TRAINED = {"qwen2_5_vl": {"unfrozen-tower": 93, "packed-videos": 56},
           "qwen3_vl": {"stage2": 65, "packed-videos": 65}}


# Module scope: each family's model is written and converted once (pytest scopes a partly indirect
# parametrization to the function otherwise, and would convert it again for every run).
@pytest.mark.parametrize("qwen,name", [(family, run) for family, runs in TRAINED.items() for run in runs],
                         indirect=["qwen"], scope="module")
def test_qwen_vl_at_tp2_trains_as_transformers_does(request, tmp_path, qwen, name):
    options, fixture = RUNS[name]
    data = request.getfixturevalue(fixture)
    report = _report(qwen, data[0] if fixture == "tiled_mix" else data, tmp_path, **options)
    assert report.ok, report.table()
    assert report.compared_grads == TRAINED[qwen[0]][name] and len(report.rows) == 2
    # Each decoder layer reported as one module, the mergers apart from the rest of the tower.
    assert {"visual.merger", *(f"language_model.layers.{i}" for i in range(4))} <= report.modules.keys()
    tower_diff, tower_trained = report.modules["visual"]
    unfrozen = options.get("unfreeze_vit", False)
    assert tower_trained == unfrozen and (unfrozen or tower_diff == 0.0)
    assert max(max(row.rel) for row in report.rows) <= 1e-5 and max(report.grads.values()) <= 1e-5


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
def test_catches_our_image_positions_shifted_by_one(tmp_path, qwen, train_data, monkeypatch):
    plant_in_parity_ranks(monkeypatch, SHIFTED_IMAGE_POSITIONS)
    report = _report(qwen, train_data, tmp_path)
    assert "step 1: loss differs" in " ".join(report.problems), report.table()
    assert any("first-step gradient differs" in p for p in report.problems)


@pytest.mark.parametrize("qwen", ["qwen2_5_vl"], indirect=True)
def test_catches_packed_samples_attending_to_each_other(tmp_path, qwen, train_data, monkeypatch):
    plant_in_parity_ranks(monkeypatch, LEAKY_PACKS)
    report = _report(qwen, train_data, tmp_path, **RUNS["packed"][0])
    assert "step 1: loss differs" in " ".join(report.problems), report.table()


@pytest.mark.parametrize("qwen", ["qwen3_vl"], indirect=True)
def test_catches_deepstack_features_added_one_decoder_layer_late(tmp_path, qwen, train_data, monkeypatch):
    plant_in_parity_ranks(monkeypatch, LATE_DEEPSTACK)
    report = _report(qwen, train_data, tmp_path, **RUNS["packed"][0])
    assert "step 1: loss differs" in " ".join(report.problems), report.table()
    assert any("first-step gradient differs" in p for p in report.problems)
