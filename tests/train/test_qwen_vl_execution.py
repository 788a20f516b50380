"""Qwen2.5-VL and Qwen3-VL train (stage 2) with the execution switches LLaVAs have: --compile-layers,
pipeline parallelism (PP2, TP2 x PP2) and bfloat16 (megatron-core's Float16Module; the tower cast as
transformers casts it). The tiny models converted from transformers, on the synthetic conversations LLaVA's runs train on
(`train_data`), on CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support import qwen2_5_vl, qwen3_vl
from tests.support.helpers import hf_tensors, run_ranks
from tests.support.training import metrics, train, trainer_args

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

ITERS = 3
# SGD, as in test_qwen2_5_vl_training: Adam would grow float noise in near-zero gradients into the losses.
SGD = {"optimizer": "sgd", "sgd_momentum": 0.9, "lr": 1e-3}
# How far a bf16 run's losses may be from the float32 run's: measured at most 2.3e-3 (Qwen2.5-VL) and
# 1.2e-3 (Qwen3-VL) relative over the 3 steps.
BF16_LOSS_BOUND = 5e-3
# The same for torchao's float8 linears (e4m3 operands, e5m2 gradients): measured at most 1.9e-2 for losses and
# 8.9e-2 for gradient norms (Qwen2.5-VL's first step, its tiny layers' tensorwise scales) over the 3 steps.
FP8_LOSS_BOUND, FP8_GRAD_NORM_BOUND = 3e-2, 1.5e-1
SUPPORT = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}


@pytest.fixture(scope="module", params=sorted(SUPPORT))
def tiny(request, tmp_path_factory):
    """A family's tiny model: HF checkpoint and its TP1 conversion."""
    from megatron_ext.convert.to_megatron import convert

    root = tmp_path_factory.mktemp(request.param)
    hf = SUPPORT[request.param].write_tiny_model(root / "hf")
    return SimpleNamespace(name=request.param, support=SUPPORT[request.param].__name__, hf=hf,
                           megatron=convert(hf, root / "tp1", 1, 1))


def _train(save: Path, tiny, data: Path, nproc: int = 1, **options) -> tuple[dict, str]:
    result = train(nproc, *trainer_args(tiny.megatron, data, save, **{"train_iters": ITERS, "dtype": "float32",
                                                                         "log_interval": 1, **SGD, **options}),
                   timeout=800)
    return metrics(save), result.stdout + result.stderr


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory, tiny, train_data):
    return _train(tmp_path_factory.mktemp(f"{tiny.name}_tp1") / "run", tiny, train_data)[0]


def _assert_steps_equal(run: dict, reference: dict) -> None:
    assert run.keys() == reference.keys() == set(range(1, ITERS + 1))
    for i, expected in reference.items():
        assert run[i]["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=0), i
        assert run[i]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5, abs=0), i


# Qwen3-VL only: its decoder is Qwen2.5-VL's plus the DeepStack hooks, which run inside the compiled
# first layers (a second family's run costs 35 s and compiles the same layer code).
# Also with the decoder's linears adding their weight gradients into the fp32 buffer in a traceable
# form (model/compiled_linear.py), and at TP2, where the same module traces the input gradients' all-reduce.
# With --vision-attention varlen the tower's 3 blocks compile too (under sdpa they would break their graphs).
@pytest.mark.parametrize("tiny", ["qwen3_vl"], indirect=True)
@pytest.mark.parametrize("tp, fused, vision", [(1, False, "sdpa"), (1, True, "sdpa"), (2, False, "sdpa"),
                                               (1, False, "varlen")],
                         ids=["plain", "wgrad-fusion", "tp2", "varlen-tower"])
def test_compiled_layers_train_like_eager_ones_and_break_no_graph(tmp_path, tiny, train_data, tp1_run, tp, fused,
                                                                  vision):
    compiled, output = _train(tmp_path / "compiled", tiny, train_data, tp, tp=tp, compile_layers=True,
                              gradient_accumulation_fusion=fused, vision_attention=vision)
    assert "--compile-layers: torch.compile left" not in output, output[-3000:]
    blocks = 3 if vision == "varlen" else 0
    assert f"--compile-layers: 4 megatron-core layers and {blocks} blocks of a transformers vision tower" in output
    _assert_steps_equal(compiled, tp1_run)


# Qwen2.5-VL at TP2 x PP2 only: its first stage is Qwen3-VL's without the DeepStack features.
@pytest.mark.parametrize("tiny, tp, pp", [("qwen3_vl", 1, 2), ("qwen3_vl", 2, 2), ("qwen2_5_vl", 2, 2)],
                         ids=["qwen3_vl-pp2", "qwen3_vl-tp2-pp2", "qwen2_5_vl-tp2-pp2"], indirect=["tiny"])
def test_pipeline_parallel_runs_train_as_tp1_does(tmp_path, tiny, train_data, tp1_run, tp, pp):
    """Qwen3-VL's tower and its DeepStack features stay on the first stage (decoder layers 0 and 1)."""
    run, _ = _train(tmp_path / "run", tiny, train_data, tp * pp, tp=tp, pp=pp)
    _assert_steps_equal(run, tp1_run)


def test_a_bf16_run_trains_within_bf16_rounding_of_the_float32_run_and_saves_bf16_weights(tmp_path, tiny, train_data,
                                                                                           tp1_run):
    """megatron-core's mixed precision (Float16Module, float32 main parameters); the export holds every
    tensor in bfloat16, the frozen tower's the original ones rounded, as a bfloat16 round trip needs."""
    from megatron_ext.checkpoint import layout
    from megatron_ext.convert.to_hf import convert

    bf16, _ = _train(tmp_path / "bf16", tiny, train_data, dtype="bfloat16")
    assert bf16.keys() == tp1_run.keys()
    for i, expected in tp1_run.items():
        assert bf16[i]["loss"] == pytest.approx(expected["loss"], rel=BF16_LOSS_BOUND), i
    assert layout.find_snapshot(tmp_path / "bf16").dtype == "bfloat16"
    exported, original = hf_tensors(convert(tmp_path / "bf16", tmp_path / "hf")), hf_tensors(tiny.hf)
    assert exported.keys() == original.keys()
    assert {t.dtype for t in exported.values()} == {torch.bfloat16}
    frozen = [name for name in original if "visual." in name and "merger" not in name]
    assert frozen and all(torch.equal(exported[name], original[name].bfloat16()) for name in frozen)


def test_the_bf16_tower_gives_transformers_bf16_features_bit_for_bit(tmp_path, tiny):
    """Built as the trainer builds it (Float16Module casts the model); transformers' tower loaded with
    from_pretrained(dtype=torch.bfloat16), which keeps its RoPE inv_freq in float32."""
    run_ranks(1, "tests/train/qwen_vl_bf16_worker.py", tmp_path, tiny.hf, tiny.megatron, tiny.support, timeout=300)
    result = json.loads((tmp_path / "tower.json").read_text())
    assert set(result["buffers"].values()) == {"torch.float32"}, result["buffers"]
    assert result["samples"]
    for sample, features in result["samples"].items():
        assert all(features["equal"]) and features["dtype"] == "torch.bfloat16", (sample, features)


def test_float8_linears_train_within_fp8s_tolerance_of_the_float32_run(tmp_path, tiny, train_data, tp1_run):
    """--fp8 --fp8-backend torchao in the mRoPE decoder (Qwen3-VL's DeepStack layers included): within
    FP8's measured bounds, and not the float32 run itself."""
    pytest.importorskip("torchao", reason="needs torchao (pip install 'megatron-ext[fp8]')")
    run, _ = _train(tmp_path / "fp8", tiny, train_data, fp8=True, fp8_backend="torchao")
    assert run.keys() == tp1_run.keys()
    for i, expected in tp1_run.items():
        assert run[i]["loss"] == pytest.approx(expected["loss"], rel=FP8_LOSS_BOUND), i
        assert run[i]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=FP8_GRAD_NORM_BOUND), i
    assert run[1]["loss"] != pytest.approx(tp1_run[1]["loss"], rel=1e-5)
