"""The GPU path: packed == unpacked under torch SDPA (one kernel call per layer) and Transformer
Engine (THD), TE equals SDPA, bf16 and FP8 training steps run, and packed flash attention
(varlen_attn) equals plain attention.

Every test runs on a GPU (`cuda`) and, where its code allows, on this CPU too: the model and
trainer under the GPU rehearsal (tests/train/gpu_rehearsal.py: host and device tensors kept apart
as on a GPU), the flash kernel on `meta` (shapes, call counts, placement; it has no CPU kernel).
So a key typo or a host/device mix fails in CI. Skipped with the reason where CUDA or Transformer
Engine is missing. On a GPU machine: `bash scripts/gpu_check.sh`."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_ext.model.backends import te_available
from tests.model.test_attention import _attention, _reference
from tests.model.test_backends import WORKER, _max_diff
from tests.support.helpers import child_env, run_ranks
from tests.support.tiled_data import SEQ as TILED_SEQ
from tests.support.training import metrics, trainer_args
from tests.train.test_gpu_rehearsal import REHEARSAL

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
needs_te = pytest.mark.skipif(not te_available(), reason="needs Transformer Engine with CUDA "
                              "(pip install 'megatron-ext[gpu]'); it cannot be built without CUDA")
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="needs torchao (pip install 'megatron-ext[fp8]')")
RUNS = [pytest.param("rehearsal", id="rehearsal"), pytest.param("cuda", marks=needs_cuda, id="cuda")]
WORKER_RUNS = RUNS + [pytest.param("cuda-tp2", marks=needs_two_gpus, id="cuda-tp2")]
pytestmark = pytest.mark.gpu


def _torchrun(where: str, script: str, *args, timeout: float = 400):
    """`script` on one GPU (cuda), two as TP2 (cuda-tp2), or one process on this CPU under the GPU rehearsal."""
    if where.startswith("cuda"):
        return run_ranks(2 if where == "cuda-tp2" else 1, script, *args, timeout=timeout, env=child_env(gpu=True))
    return run_ranks(1, REHEARSAL, script, *args, timeout=timeout, env=child_env(REHEARSAL_MATH_LIMIT="0"))


def _losses(tmp_path: Path, where: str, checkpoint: Path, backends: str) -> dict:
    out = tmp_path / f"{backends}.json"
    _torchrun(where, WORKER, checkpoint, out, backends)
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", WORKER_RUNS)
@pytest.mark.parametrize("backend", ["sdpa", pytest.param("te", marks=needs_te)])
def test_packed_equals_unpacked(tmp_path, megatron_clip, where, backend):
    losses = _losses(tmp_path, where, megatron_clip, f"{backend},local")
    assert losses["tp"] == (2 if where == "cuda-tp2" else 1)
    unpacked = losses[f"{backend}/unpacked"]
    assert max(len(pack) for pack in losses[f"{backend}/packs"]) >= 3
    # fp32 weights; GPU kernels (TF32 convolutions) round differently from CPU ones.
    for layout in ("packed", "aligned packed", "unpacked-rows"):
        assert _max_diff(losses[f"{backend}/{layout}"], unpacked) <= 2e-3, layout
    assert _max_diff(losses[f"{backend}/packed, samples not kept apart"], unpacked) > 1e-2
    # fp32, GQA, images: the backend's packed path against megatron's reference kernel, same layout
    # (on a GPU the sdpa row is one masked SDPA call: flash has no fp32 kernel; bf16 flash below).
    for layout in ("packed", "aligned packed"):
        assert _max_diff(losses[f"{backend}/{layout}"], losses[f"local/{layout}"]) <= 1e-4, layout


@needs_cuda
@needs_te
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_te_equals_sdpa(tmp_path, megatron_clip):
    losses = _losses(tmp_path, "cuda", megatron_clip, "sdpa,te")
    for layout in ("unpacked", "packed", "aligned packed"):
        assert _max_diff(losses[f"te/{layout}"], losses[f"sdpa/{layout}"]) <= 2e-3, layout


TRAINING_OPTIONS = [
    dict(attention_backend="sdpa"),
    # The levers not yet on by default (compiled on a GPU: model/compiled_linear.py; eager in the rehearsal).
    dict(attention_backend="sdpa", gradient_accumulation_fusion=True, fused_adam=True),
    pytest.param(dict(attention_backend="te"), marks=needs_te),
    pytest.param(dict(attention_backend="te", fp8=True), marks=needs_te),
    # FP8 without TE: torchao's float8 linears in the language model (model/float8_linears.py).
    pytest.param(dict(attention_backend="sdpa", fp8=True, fp8_backend="torchao"), marks=needs_torchao),
]
TRAINING_IDS = ["sdpa-bf16", "sdpa-bf16-wgrad-fusion-fused-adam", "te-bf16", "te-fp8", "sdpa-fp8-torchao"]


def _three_steps_ran(save: Path) -> None:
    records = metrics(save)
    assert sorted(records) == [1, 2, 3]
    assert all(r["update"] and math.isfinite(r["loss"]) and r["memory_gb"] > 0 for r in records.values())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", RUNS)
@pytest.mark.parametrize("options", TRAINING_OPTIONS, ids=TRAINING_IDS)
def test_packed_bf16_training_steps(tmp_path, megatron_clip, train_data, where, options):
    save = tmp_path / "run"
    _torchrun(where, "scripts/train/pretrain_llava.py",
              *trainer_args(megatron_clip, train_data, save, micro_batch_size=1, global_batch_size=2, train_iters=3,
                            packing_seq_length=128, dtype="bfloat16", **options))
    _three_steps_ran(save)


@needs_cuda
def test_the_weight_gradient_gemm_adds_bf16_products_into_an_fp32_buffer_in_place():
    """`compat.wgrad_accumulation` on CUDA: one baddbmm with out_dtype, fp32 accumulation into the buffer
    itself (on the CPU the rehearsal checks this call's contract and the CPU sums in fp32)."""
    from megatron_ext.compat.wgrad_accumulation import accumulate_on_cuda, kernel_problem

    assert kernel_problem() is None
    gen = torch.Generator(device="cuda").manual_seed(0)
    grad_output_t = torch.randn(384, 4096, generator=gen, device="cuda").bfloat16()
    total_input = torch.randn(4096, 256, generator=gen, device="cuda").bfloat16()
    main_grad = torch.randn(384, 256, generator=gen, device="cuda")
    exact = main_grad.double() + grad_output_t.double() @ total_input.double()
    address = main_grad.data_ptr()
    accumulate_on_cuda(main_grad, grad_output_t, total_input)
    assert main_grad.data_ptr() == address and main_grad.dtype == torch.float32
    assert (main_grad.double() - exact).abs().max().item() < 1e-3  # sums of 4096 bf16 products, in fp32


@needs_cuda
@pytest.mark.timeout(300)
def test_transformers_with_liger_kernels_trains_the_losses_it_trains_without():
    """bench/gpu_bench.py --hf's baseline with Liger-Kernel patched in (fused linear cross entropy, RMSNorm,
    SwiGLU, RoPE) computes the same model on the same packs: its Triton kernels run on a GPU only (its
    RMSNorm does not run under Triton's CPU interpreter)."""
    pytest.importorskip("liger_kernel", reason="needs liger-kernel (pip install liger-kernel)")
    from bench import gpu_bench

    plain = gpu_bench.run_hf("tiny", iters=2, warmup=0, peak_tflops=1.0, micro_batch_size=4, liger=False)
    liger = gpu_bench.run_hf("tiny", iters=2, warmup=0, peak_tflops=1.0, micro_batch_size=4, liger=True)
    assert (plain["liger"], liger["liger"]) == (False, True)
    for key in ("loss_first", "loss_last"):
        assert liger[key] == pytest.approx(plain[key], rel=1e-2), key  # bf16 autocast, kernels fused otherwise


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", RUNS)
@pytest.mark.parametrize("options", [*TRAINING_OPTIONS, dict(attention_backend="local")], ids=[*TRAINING_IDS, "local-bf16"])
def test_tiled_packed_bf16_training_steps(tmp_path, megatron_onevision, tiled_mix, where, options):
    """OneVision packed on anyres images, multi-image samples and a video: its tiles, media layout,
    newline and expanded image tokens never put a host tensor beside a device one (rehearsal), with
    every attention backend, and its bf16 / FP8 steps run on a GPU."""
    from megatron_ext.checkpoint import layout

    data, _ = tiled_mix
    save = tmp_path / "run"
    _torchrun(where, "scripts/train/pretrain_llava.py",
              *trainer_args(megatron_onevision, data, save, seq_length=TILED_SEQ, packing_seq_length=TILED_SEQ,
                            micro_batch_size=1, global_batch_size=2, train_iters=3, dtype="bfloat16", video_frames=4,
                            max_tiles_per_sequence=64, **options))
    _three_steps_ran(save)
    assert layout.find_snapshot(save).iteration == 3


def _counting(monkeypatch) -> dict:
    """Calls of each attention kernel the sdpa backend may use."""
    import torch.nn.functional as F

    from megatron_ext.model import attention

    calls = {"varlen_attn": 0, "sdpa": 0}

    def counted(name, kernel):
        @functools.wraps(kernel)  # the backend reads varlen_attn's keywords from its signature
        def call(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)

        return call

    monkeypatch.setattr(attention, "varlen_attn", counted("varlen_attn", attention._varlen_kernel()))
    monkeypatch.setattr(F, "scaled_dot_product_attention", counted("sdpa", F.scaled_dot_product_attention))
    return calls


@needs_cuda
@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_a_varlen_qwen_vl_tower_is_one_flash_call_per_layer_with_the_sdpa_towers_features(monkeypatch, name):
    """--vision-attention varlen on the GPU (tests/model/test_tower_attention.py on the CPU): bf16, the
    tower's inputs from the host as the trainer gives them."""
    from megatron_ext.model import tower_attention
    from megatron_ext.model.tower_inputs import tower_kwargs
    from tests.model.test_tower_attention import _tower
    from tests.model.test_tower_inputs import features

    tower, compute, grid, pixels = _tower(name, torch.bfloat16)
    tower, pixels = tower.cuda(), pixels.cuda()
    calls = _counting(monkeypatch)
    theirs = features(tower, pixels, grid.cuda())
    assert calls == {"varlen_attn": 0, "sdpa": calls["sdpa"]} and calls["sdpa"] > len(tower.blocks)
    calls.update(varlen_attn=0, sdpa=0)
    tower_attention.use(tower, "varlen")
    ours = features(tower, pixels, grid.cuda(), **tower_kwargs(compute, grid, lambda t: t.cuda(), flash=True))
    assert calls == {"varlen_attn": len(tower.blocks), "sdpa": 0}
    assert all((a.float() - b.float()).norm() <= 0.02 * b.float().norm() for a, b in zip(ours, theirs, strict=True))


def _packed_params(bounds: list[int], device: str):
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           cu_seqlens_q_padded=cu_seqlens, cu_seqlens_kv_padded=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("groups", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("window", [None, (3, 0)], ids=["full", "window"])
def test_packed_half_precision_attention_is_one_flash_call(monkeypatch, device, groups, window):
    """Samples of 5, 9 and 2 positions in one THD row, bf16: one varlen_attn call, no mask, equal
    to plain attention of each sample alone (fp32 math on the same bf16 inputs)."""
    calls = _counting(monkeypatch)
    options = dict(window_size=window) if window else {}
    attention = _attention("causal", heads=4, groups=groups, **options)
    bounds = [0, 5, 14, 16]
    gen = torch.Generator().manual_seed(groups)
    host = [torch.randn(16, n, 8, generator=gen).bfloat16() for n in (4, groups, groups)]
    q, k, v = (t.to(device).requires_grad_() for t in host)
    out = attention(q, k, v, None, packed_seq_params=_packed_params(bounds, device))
    out.float().square().sum().backward()
    assert calls == {"varlen_attn": 1, "sdpa": 0}
    assert out.shape == (16, 32) and out.device.type == device
    assert all(t.grad.device.type == device and t.grad.shape == t.shape for t in (q, k, v))
    if device == "meta":
        return
    sample = torch.repeat_interleave(torch.arange(3), torch.tensor(bounds).diff())
    position = torch.arange(16)
    allowed = (sample[:, None] == sample[None, :]) & (position[None, :] <= position[:, None])
    if window:
        allowed &= position[None, :] >= position[:, None] - window[0]
    ref = [t.float().requires_grad_() for t in host]
    expected = _reference(*(t.transpose(0, 1)[None] for t in ref), allowed[None, None])[0].transpose(0, 1)
    expected.square().sum().backward()
    # bf16 inputs, fp32 accumulation in both: what differs is the kernels' rounding of bf16 outputs.
    assert (out.float().cpu() - expected.reshape(16, 32)).abs().max() <= 2e-2
    for mine, theirs in zip((q, k, v), ref):
        assert (mine.grad.float().cpu() - theirs.grad).abs().max() <= 5e-2


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("window", [None, (3, 0)], ids=["full", "window"])
def test_compiled_packed_flash_attention_is_one_graph(monkeypatch, device, window):
    """--compile-layers on a GPU: the flash call compiles whole, before its kernel was ever imported (an
    H200's first compiled run broke each layer's graph at the kernel's lookup: 2.3x slower than eager)."""
    import torch._dynamo

    from megatron_ext.model import attention as backend

    torch._dynamo.reset()
    monkeypatch.setattr(backend, "varlen_attn", None)  # as in a fresh process
    options = dict(window_size=window) if window else {}
    compiled = torch.compile(_attention("causal", heads=4, groups=2, **options), fullgraph=True, backend="eager",
                             dynamic=True)
    q, k, v = (torch.randn(16, n, 8, dtype=torch.bfloat16, device=device, requires_grad=True) for n in (4, 2, 2))
    out = compiled(q, k, v, None, packed_seq_params=_packed_params([0, 5, 14, 16], device))
    out.float().sum().backward()
    assert out.shape == (16, 32) and backend.varlen_attn is not None
    assert all(t.grad.shape == t.shape for t in (q, k, v))


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=needs_cuda)])
def test_compiled_flash_attention_compiles_once_for_micro_batches_of_any_length(monkeypatch, device):
    """As `compile_layers` prepares it (the kernel probed before tracing): one graph for packs of 16 and 23
    positions; probed inside the first graph, the probe's cache would change under it and recompile."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from megatron_ext.model import attention as backend

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(backend, "varlen_attn", None)
    monkeypatch.setattr(backend, "_KEYWORDS", {})
    with monkeypatch.context() as cuda:
        cuda.setattr(torch.cuda, "is_available", lambda: True)  # where prepare_for_compile probes (meta stands in)
        backend.prepare_for_compile()
    compiled = torch.compile(_attention("causal", heads=4, groups=2), fullgraph=True, backend="eager", dynamic=True)
    for bounds in ([0, 5, 14, 16], [0, 9, 20, 23]):
        q, k, v = (torch.randn(bounds[-1], n, 8, dtype=torch.bfloat16, device=device) for n in (4, 2, 2))
        compiled(q, k, v, None, packed_seq_params=_packed_params(bounds, device))
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=needs_cuda)])
def test_a_sliding_window_row_is_one_flash_call_and_a_covering_window_plain_causal(monkeypatch, device):
    calls = _counting(monkeypatch)
    attention = _attention("causal", window_size=(3, 0))
    q, k, v = (torch.randn(8, 2, n, 8, dtype=torch.bfloat16, device=device) for n in (4, 2, 2))
    assert attention(q, k, v, None).shape == (8, 2, 32)
    assert calls == {"varlen_attn": 1, "sdpa": 0}
    wide = _attention("causal", window_size=(7, 0))
    wide(q, k, v, None)
    assert calls == {"varlen_attn": 1, "sdpa": 1}  # the window reaches every key: no band at all


def test_fp32_packed_attention_on_a_gpu_is_one_masked_sdpa_call(monkeypatch):
    """flash has no fp32 kernel: fp32 (and CPU) rows take one SDPA call with the block mask."""
    calls = _counting(monkeypatch)
    attention = _attention("causal")
    q, k, v = (torch.randn(16, n, 8, device="meta") for n in (4, 2, 2))
    assert attention(q, k, v, None, packed_seq_params=_packed_params([0, 5, 14, 16], "meta")).shape == (16, 32)
    assert calls == {"varlen_attn": 0, "sdpa": 1}
