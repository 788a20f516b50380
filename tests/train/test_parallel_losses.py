"""Every parallel layout trains like one process: the same global batches give the same losses and
gradient norms (fp32, CPU) at TP2 x PP2, and at TP2 with packed samples (THD attention) of LLaVA-NeXT.
TP2 x DP2 with the distributed optimizer and packed samples trains like transformers in one process
(test_parity, to the same tolerance)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import run_ranks

WORKER = str(Path(__file__).with_name("invariance_worker.py"))

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


def _run(tmp_path, megatron_clip, train_data, nproc, options) -> dict:
    out = tmp_path / "steps.json"
    run_ranks(nproc, WORKER, megatron_clip, train_data, out, json.dumps(options), timeout=300)
    return json.loads(out.read_text())


def _steps(tmp_path, megatron_clip, train_data, nproc, options) -> list[dict]:
    return _run(tmp_path, megatron_clip, train_data, nproc, options)["steps"]


def _assert_same_steps(steps: list[dict], reference: list[dict], rel: float) -> None:
    """The reference's three steps: its tokens, and its losses and gradient norms within `rel` (also absolute)."""
    assert len(steps) == len(reference) == 3
    for got, expected in zip(steps, reference):
        assert got["tokens"] == expected["tokens"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=rel, abs=rel)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=rel, abs=rel)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, megatron_clip, train_data) -> list[dict]:
    """One process, two micro batches of two samples per step."""
    return _steps(tmp_path_factory.mktemp("tp1"), megatron_clip, train_data, 1, {"micro_batch_size": 2})


def test_tp2_x_pp2_trains_like_one_process(tmp_path, megatron_clip, train_data, reference):
    _assert_same_steps(_steps(tmp_path, megatron_clip, train_data, 4, {"tp": 2, "pp": 2}), reference, rel=1e-5)


def test_packed_anyres_samples_train_like_unpacked(tmp_path, llava_next_clip, train_data):
    """LLaVA-NeXT: the same samples (anyres images, two images, text only) packed into one-row
    micro batches at TP2 give the losses and gradient norms of unpacked two-sample micro batches."""
    from megatron_ext.convert.to_megatron import convert

    megatron_next = convert(llava_next_clip, tmp_path / "megatron", tp=1, pp=1)
    seq = {"seq_length": 384}
    (tmp_path / "unpacked").mkdir()
    (tmp_path / "packed").mkdir()
    unpacked = _steps(tmp_path / "unpacked", megatron_next, train_data, 1, {"micro_batch_size": 2, **seq})
    packed = _steps(tmp_path / "packed", megatron_next, train_data, 2,
                    {"tp": 2, "packing_seq_length": 384, "micro_batch_size": 1, **seq})
    assert any(p["micro_batches"] < u["micro_batches"] for p, u in zip(packed, unpacked))
    for got, expected in zip(packed, unpacked):
        assert got["tokens"] == expected["tokens"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-5)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("layout", [{"tp": 2, "packing_seq_length": 192}, {"tp": 2, "pp": 2}], ids=["tp2-packed", "tp2-pp2"])
def test_logits_only_where_a_loss_is_taken_train_like_logits_everywhere(tmp_path, megatron_clip, train_data, layout):
    """--logits-where-loss (the default) against megatron-core's logits at every position: the
    same losses and gradient norms (fp32)."""
    nproc = layout.get("tp", 1) * layout.get("pp", 1)
    (tmp_path / "where").mkdir()
    (tmp_path / "everywhere").mkdir()
    where = _steps(tmp_path / "where", megatron_clip, train_data, nproc, layout)
    everywhere = _steps(tmp_path / "everywhere", megatron_clip, train_data, nproc, {**layout, "logits_where_loss": False})
    assert len(where) == len(everywhere) == 3
    for got, expected in zip(where, everywhere):
        assert got["tokens"] == expected["tokens"]
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-6)


@pytest.mark.parametrize("layout", [{"micro_batch_size": 2}, {"tp": 2, "micro_batch_size": 1}], ids=["tp1", "tp2"])
def test_weight_gradients_added_within_their_gemms_train_like_one_process(tmp_path, megatron_clip, train_data,
                                                                        reference, layout):
    """--gradient-accumulation-fusion (torch's GEMM adding into the gradient buffer, as Apex's would):
    at TP1 in the reference's own layout, the reference's losses and gradient norms (fp32); at TP2 in
    micro batches of one sample, within the tolerance of every other layout."""
    nproc = layout.get("tp", 1)
    run = _run(tmp_path, megatron_clip, train_data, nproc, {**layout, "gradient_accumulation_fusion": True})
    assert run["execution"]["gradient_accumulation_fusion"] is True
    assert all(step["micro_batches"] > 1 for step in run["steps"])  # a sum over micro batches to get right
    _assert_same_steps(run["steps"], reference, rel=1e-6 if nproc == 1 else 1e-5)


@pytest.mark.parametrize("nproc,layout", [(1, {"micro_batch_size": 2}), (2, {"micro_batch_size": 1, "dist_optim": True})],
                         ids=["tp1", "dp2-dist-optim"])
def test_fused_adam_trains_like_torchs_default_adam(tmp_path, megatron_clip, train_data, reference, nproc, layout):
    """--fused-adam: at TP1 in the reference's layout its losses and gradient norms (fp32; the third
    step's loss follows two updates); on two data-parallel ranks with the distributed optimizer's
    shards, within the tolerance of every other layout."""
    steps = _steps(tmp_path, megatron_clip, train_data, nproc, {**layout, "fused_adam": True})
    _assert_same_steps(steps, reference, rel=1e-6 if nproc == 1 else 1e-5)


def test_float8_linears_train_near_the_reference(tmp_path, megatron_clip, train_data, reference):
    """--fp8 --fp8-backend torchao: the language model's linear layers in float8 GEMMs (e4m3 operands, e5m2
    gradients) follow the reference's losses and gradient norms within FP8's own tolerance (measured: 1.3%
    at most), and differ from them: the float8 GEMMs really ran."""
    pytest.importorskip("torchao", reason="needs torchao (pip install 'megatron-ext[fp8]')")
    run = _run(tmp_path, megatron_clip, train_data, 1, {"micro_batch_size": 2, "fp8": True, "fp8_backend": "torchao"})
    assert (run["execution"]["fp8"], run["execution"]["fp8_backend"]) == ("tensorwise", "torchao")
    _assert_same_steps(run["steps"], reference, rel=3e-2)
    assert run["steps"][0]["loss"] != pytest.approx(reference[0]["loss"], rel=1e-5)
