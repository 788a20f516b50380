"""The GPU path on a real GPU: packed == unpacked under Transformer Engine (THD) and torch SDPA, TE
equals SDPA, bf16 and FP8 training steps run. Skipped, with the reason, where CUDA or Transformer
Engine is missing (every CPU test of the same code runs everywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ext.model.backends import te_available
from tests.helpers import child_env, run_torchrun
from tests.model.test_backends import WORKER, _max_diff
from tests.train.conftest import metrics, train, trainer_args

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_te = pytest.mark.skipif(not te_available(), reason="needs Transformer Engine (pip install 'megatron-ext[gpu]')")


def _losses(tmp_path: Path, checkpoint: Path, backends: str) -> dict:
    out = tmp_path / f"{backends}.json"
    run_torchrun(1, WORKER, checkpoint, out, backends, timeout=400, env=child_env(gpu=True))
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("te", marks=needs_te)])
def test_packed_equals_unpacked(tmp_path, megatron_clip, backend):
    losses = _losses(tmp_path, megatron_clip, backend)
    unpacked = losses[f"{backend}/unpacked"]
    assert max(losses[f"{backend}/pack sizes"]) >= 3
    # fp32 weights; GPU kernels (TF32 convolutions, flash attention) round differently from CPU ones.
    for layout in ("packed", "aligned packed", "unpacked-rows"):
        assert _max_diff(losses[f"{backend}/{layout}"], unpacked) <= 2e-3, layout
    assert _max_diff(losses[f"{backend}/packed, samples not kept apart"], unpacked) > 1e-2


@needs_te
def test_te_equals_sdpa(tmp_path, megatron_clip):
    losses = _losses(tmp_path, megatron_clip, "sdpa,te")
    for layout in ("unpacked", "packed", "aligned packed"):
        assert _max_diff(losses[f"te/{layout}"], losses[f"sdpa/{layout}"]) <= 2e-3, layout


@pytest.mark.parametrize("options", [
    dict(attention_backend="sdpa"),
    pytest.param(dict(attention_backend="te"), marks=needs_te),
    pytest.param(dict(attention_backend="te", fp8=True), marks=needs_te),
], ids=["sdpa-bf16", "te-bf16", "te-fp8"])
def test_packed_bf16_training_steps(tmp_path, megatron_clip, train_data, options):
    save = tmp_path / "run"
    train(1, *trainer_args(megatron_clip, train_data, save, micro_batch_size=1, global_batch_size=2, train_iters=3,
                           packing_seq_length=128, **options), env=child_env(gpu=True), timeout=400)
    records = metrics(save)
    assert sorted(records) == [1, 2, 3]
    assert all(r["update"] and r["loss"] == r["loss"] and r["memory_gb"] > 0 for r in records.values())
