"""The GPU rehearsal on CPU (tests/train/gpu_rehearsal.py): real trainer iterations in which a host
tensor meeting a device tensor, or a host tensor in an NCCL collective, fails as on a GPU.

The trainer before this test existed failed it at iteration 1: its batch statistics were a host
tensor all-reduced over the data-parallel group ("No backend type associated with device type cpu",
the error NCCL gives)."""

from __future__ import annotations

import collections
import importlib.util
import json
import math

import pytest
import torch

from megatron_ext.checkpoint import layout
from tests.support.helpers import child_env, run_ranks
from tests.support.tiled_data import SEQ
from tests.support.training import metrics, trainer_args
from tests.train.gpu_rehearsal import DEVICE, HOST, DeviceLedger, DeviceMixError, mark, place

REHEARSAL = "tests/train/gpu_rehearsal.py"


def rehearse(tmp_path, script, *args, check=True, nproc=1):
    """Run SCRIPT under the rehearsal in `nproc` processes; returns the process and rank 0's report
    (attention counts, the sync ledger)."""
    report = tmp_path / "rehearsal.json"
    # Every call only the math kernel would take fails, however short (the tests' sequences are).
    proc = run_ranks(nproc, REHEARSAL, script, *args, timeout=400, check=check,
                        env=child_env(REHEARSAL_REPORT=str(report), REHEARSAL_MATH_LIMIT="0"))
    return proc, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
@pytest.mark.parametrize("options", [
    # tensor-parallel layers and their collectives, LoRA adapters made after .to(); sdpa on one packed
    # row: THD, cu_seqlens on the device
    dict(tp=2, lora_rank=4, attention_backend="sdpa", micro_batch_size=1),
    # pipeline p2p between stages; megatron's reference kernel with the packed rows' mask
    dict(pp=2, attention_backend="local", micro_batch_size=1),
    # two data-parallel ranks, the distributed optimizer's buckets; sdpa on packed rows: the mask built on the
    # device; weight gradients added into the buckets by torch's GEMM (its CUDA kernel's contract checked)
    dict(dist_optim=True, attention_backend="sdpa", micro_batch_size=2, gradient_accumulation_fusion=True),
    # OneVision at TP2 on anyres images, several images and videos: tiles, grids and newlines on the
    # device (the mix has no validation split)
    dict(tp=2, attention_backend="sdpa", micro_batch_size=1, seq_length=SEQ, packing_seq_length=SEQ, video_frames=4,
         max_tiles_per_sequence=64, eval_interval=None),
    # DPO on two data-parallel ranks: the reference copy's pass, pairs' log-probs summed on the device,
    # RPO's token count all-reduced, the val pairs' evaluation
    dict(stage="dpo", dist_optim=True, attention_backend="sdpa", micro_batch_size=1, seq_length=256,
         packing_seq_length=256, rpo_alpha=0.5),
], ids=["tp2-lora-sdpa-thd", "pp2-local", "dp2-dist-optim-sdpa-rows", "tp2-onevision-tiled-sdpa-thd",
        "dp2-dpo-rpo-sdpa-thd"])
def test_trainer_iterations_at_every_layout(request, tmp_path, train_data, options):
    """Two ranks: every collective megatron-core makes (also through its import-time aliases) checked,
    in training, evaluation and saving. One rank: the sync-ledger test below."""
    save = tmp_path / "run"
    tiled = "video_frames" in options
    checkpoint = request.getfixturevalue("megatron_onevision" if tiled else "megatron_clip")
    data = request.getfixturevalue("tiled_mix")[0] if tiled else train_data
    if options.get("stage") == "dpo":
        data = request.getfixturevalue("preference_data")
    run = {"global_batch_size": 4, "train_iters": 2, "packing_seq_length": 128, "dtype": "bfloat16",
           "eval_interval": 2, "eval_iters": 1, "save_interval": 2, **options}
    args = trainer_args(checkpoint, data, save, **run)
    _, counts = rehearse(tmp_path, "scripts/train/pretrain_llava.py", *args, nproc=2)
    records = metrics(save)
    assert sorted(records) == [1, 2]
    # The tiled mix holds over-long samples, skipped and counted (test_tiled_training).
    assert all(r["update"] and math.isfinite(r["loss"]) and r["samples"] > (0 if tiled else 2) for r in records.values())
    assert tiled or math.isfinite(metrics(save, "val")[2]["loss"])
    assert layout.find_snapshot(save).iteration == 2
    if options["attention_backend"] == "sdpa":
        # One attention kernel call per layer and micro batch, packed or not.
        assert counts["attention_layers"] > 0 and counts["attention_kernels"] == counts["attention_layers"]


# A collective given a device tensor, then the same given a host tensor: (setup, the call with `{t}` for
# its tensor, the error). megatron-core binds all_gather_into_tensor to `dist_all_gather_func` at
# import, before the rehearsal starts: that name is checked too.
COLLECTIVES = {
    "all_reduce": ("import torch.distributed as dist", "dist.all_reduce({t})",
                   "No backend type associated with device type cpu"),
    "megatron-aliased-all-gather": ("from megatron.core.tensor_parallel import mappings",
                                    "mappings.dist_all_gather_func(torch.empty(2, device=device()), {t})",
                                    "all_gather_into_tensor of host tensor"),
}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_host_tensor_in_an_nccl_collective_fails_as_on_a_gpu(tmp_path):
    """Each collective in one process (a process each costs seconds of imports): its error caught and printed."""
    lines = ["import torch", "from megatron_ext.distributed import device, init_parallel", "init_parallel()"]
    for name, (setup, call, _) in sorted(COLLECTIVES.items()):
        lines += [setup, call.format(t="torch.ones(2, device=device())"), f"print('{name}: device tensor passed')",
                  "try:", "    " + call.format(t="torch.ones(2)"), f"    print('{name}: host tensor passed')",
                  "except Exception as error:", f"    print('{name}: failed:', error)"]
    script = tmp_path / "collectives.py"
    script.write_text("\n".join(lines) + "\n")
    proc, _ = rehearse(tmp_path, str(script))
    for name, (_, _, error) in COLLECTIVES.items():
        assert f"{name}: device tensor passed" in proc.stdout
        failure = next(line for line in proc.stdout.splitlines() if line.startswith(f"{name}: failed:"))
        assert error in failure, proc.stdout


def test_the_ledger_refuses_host_and_device_tensors_in_one_op():
    host, gpu = mark(torch.ones(4), HOST), mark(torch.ones(4), DEVICE)
    with DeviceLedger():
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            host * gpu
        assert place(gpu * torch.tensor(2.0)) == DEVICE  # a 0-dim host tensor is a scalar, as on CUDA
        assert place(torch.zeros(2)) == HOST and place(torch.zeros_like(gpu)) == DEVICE
        assert gpu.device == torch.device("cuda", 0) and host.device == torch.device("cpu")
        assert place(gpu.cpu()) == HOST and place(gpu.cpu() + host) == HOST
        with pytest.raises(DeviceMixError, match="numpy"):
            gpu.numpy()
        assert place(gpu[host.long() - 1]) == DEVICE  # host indices are fine


# The device -> host reads a training step may make, by "file (function)", and how often each may
# read: each stalls the CPU until the GPU has finished the work queued so far. Any other site, more
# reads, or a count that grows with the number of layers, fails the sync-ledger test below.
ALLOWED_READS = {
    # megatron-core's per-token loss scaling: `if num_tokens > 0` after the token count's all-reduce
    # (0.19 clamps on the device instead).
    "megatron/core/distributed/finalize_model_grads.py (finalize_model_grads)": "per step",
    # The gradient norm for clipping, read once (its per-tensor local L2 norm stays on the device:
    # without_te.l2_norm_on_device).
    "megatron/core/optimizer/clip_grads.py (get_grad_norm_fp32)": "per step",
    # megatron-core 0.19: whether any rank has a separate grad-norm group, all-reduced once and cached.
    "megatron/core/optimizer/optimizer.py (has_grad_norm_group)": "once",
    # Ours: the global batch's loss (logged, non-finite check) and the step's shared statistics + stop flag.
    "megatron_ext/model/forward_step.py (reduce_sums)": "per step",
    "megatron_ext/train/trainer.py (_shared)": "per step",
}


def _read_budget(steps: int, micro_batches: int) -> dict[str, int]:
    """The most reads each allowed site may make in `steps` steps of `micro_batches` each."""
    per_run = {"per step": steps, "per micro batch": steps * micro_batches, "once": 1}
    return {site: per_run[often] for site, often in ALLOWED_READS.items()}


# megatron-core's LLaVA preprocessing read image-token positions back 6 times per micro batch in
# forward and 2-3 in backward here (21 + 2 on an H200); the host computes them now (combined_layout).
# At TP > 1 its vocabulary-parallel embedding's backward read its out-of-shard mask once per micro
# batch (autograd's IndexPutBackward0); model/vocab_embedding.py zeroes those rows without one.


def _site(entry: str) -> str:
    """The "file (function)" of a "file:line (function)" entry; autograd's nodes have no line."""
    path, colon, rest = entry.partition(":")
    return f"{path} {rest.partition(' ')[2]}" if colon else entry


def _reads_by_site(reads: dict[str, int]) -> collections.Counter:
    """The ledger's reads summed by "file (function)"."""
    by_site = collections.Counter()
    for entry, count in reads.items():
        by_site[_site(entry)] += count
    return by_site


@pytest.fixture(scope="module")
def megatron_clip_4_layers(tmp_path_factory, tiny_hf) -> str:
    """llava_clip's shape with 4 language-model layers instead of 2, as a Megatron checkpoint."""
    from megatron_ext.convert.to_megatron import convert
    from megatron_ext.demo.tiny_models import TinyTextSpec, make_text_model
    from megatron_ext.hf.build_llava import build_llava

    root = tmp_path_factory.mktemp("clip_4_layers")
    text = make_text_model(root / "text", TinyTextSpec(num_layers=4))
    hf = build_llava(root / "hf", str(text), str(tiny_hf["vision-clip"]))
    return convert(hf, root / "ckpt", tp=1, pp=1)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("levers", [dict(tp=2), dict(tp=2, gradient_accumulation_fusion=True, fused_adam=True),
                                    pytest.param(dict(tp=1, fp8=True, fp8_backend="torchao"), marks=pytest.mark.skipif(
                                        importlib.util.find_spec("torchao") is None, reason="needs torchao"))],
                         ids=["defaults", "wgrad-fusion-fused-adam", "fp8-torchao"])
def test_the_sync_ledger_allows_named_reads_and_none_per_layer(tmp_path, megatron_clip, megatron_clip_4_layers,
                                                               train_data, levers):
    """At TP2 (rank 0's ledger), so that megatron-core's tensor-parallel layers, vocab-parallel cross
    entropy and their backward run under it too; also with the opt-in levers of a plain install, and
    torchao's float8 linears (at TP1, where they run): their scales stay on the device."""
    reads = {}
    for layers, checkpoint in ((2, megatron_clip), (4, megatron_clip_4_layers)):
        # No checkpoint: saving reads every tensor back, as it must.
        args = trainer_args(checkpoint, train_data, tmp_path / f"run{layers}", global_batch_size=4, train_iters=2,
                            packing_seq_length=128, dtype="bfloat16", attention_backend="sdpa", micro_batch_size=1,
                            log_interval=2, save=False, **levers)
        _, counts = rehearse(tmp_path, "scripts/train/pretrain_llava.py", *args, nproc=levers["tp"])
        reads[layers] = counts["reads"]
    # RoPE over packed rows, attention, tiles: nothing per layer (megatron-core's unfused THD RoPE read
    # cu_seqlens back twice in every layer).
    assert reads[2] == reads[4]
    by_site = _reads_by_site(reads[2])
    budget = _read_budget(steps=2, micro_batches=4)
    assert all(by_site[site] <= budget.get(site, 0) for site in by_site), json.dumps(reads[2], indent=1)
    # Ours exactly once a step (megatron-core's releases read at different sites).
    assert all(by_site[site] == budget[site] for site in budget if site.startswith("megatron_ext/")), by_site


# Qwen-VL: transformers' tower held whole on the first stage (its gradients averaged over TP), packed
# native-resolution images as THD, mRoPE; Qwen2.5-VL's window attention, Qwen3-VL's DeepStack hooks.
QWEN_VL_LAYOUTS = {"qwen2_5_vl": dict(tp=2), "qwen3_vl": dict(pp=2)}


@pytest.fixture(scope="module", params=list(QWEN_VL_LAYOUTS))
def qwen_vl_megatron(request, tmp_path_factory):
    """(family, its tiny model converted to a Megatron checkpoint)."""
    import importlib

    from megatron_ext.convert.to_megatron import convert

    root = tmp_path_factory.mktemp(request.param)
    hf = importlib.import_module(f"tests.support.{request.param}").write_tiny_model(root / "hf")
    return request.param, convert(hf, root / "ckpt", tp=1, pp=1)


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
@pytest.mark.parametrize("vision_attention", ["sdpa", "varlen"])
def test_qwen_vl_trainer_iterations_mix_nothing_and_read_nothing_back_per_micro_batch(tmp_path, qwen_vl_megatron,
                                                                                     train_data, vision_attention):
    """Before this test, the rehearsal took CUDA's host indices into a device tensor, in the backward of
    the Qwen2.5-VL tower's window reordering, for a mix. Our reads: the media tokens' rows and the
    feature check found on the device (4 per micro batch with their backward), found on the host now
    (`mrope_inputs`). transformers' towers read their grid back (patch positions, windows, and in each
    layer the attention's split by image: 12 per micro batch for Qwen2.5-VL's 3 layers); given those
    values from the host (`tower_inputs`), they read none. With --vision-attention varlen each tower
    layer is one call of the flash kernel (the rehearsal's, which checks its contract): none either."""
    family, checkpoint = qwen_vl_megatron
    # No checkpoint: saving reads every tensor back, as it must. Our per-step reads count the steps.
    args = trainer_args(checkpoint, train_data, tmp_path / "run", global_batch_size=4, train_iters=2, seq_length=256,
                        packing_seq_length=256, dtype="bfloat16", attention_backend="sdpa", micro_batch_size=1,
                        eval_interval=2, eval_iters=1, save=False, vision_attention=vision_attention,
                        **QWEN_VL_LAYOUTS[family])
    _, counts = rehearse(tmp_path, "scripts/train/pretrain_llava.py", *args, nproc=2)
    by_site = _reads_by_site(counts["reads"])
    budget = _read_budget(steps=2, micro_batches=4)
    ours = collections.Counter({site: count for site, count in by_site.items() if site.startswith("megatron_ext/")})
    # The evaluation: its batch count agreed over data-parallel ranks, its loss.
    evaluation = {"megatron_ext/train/batches.py (_most_over_data_parallel)": 1,
                  "megatron_ext/model/forward_step.py (reduce_sums)": 1}
    per_step = {site: budget[site] for site in budget if site.startswith("megatron_ext/")}
    assert ours == collections.Counter(per_step) + collections.Counter(evaluation), by_site
    assert all(by_site[site] <= budget.get(site, 0) for site in by_site if site not in ours), by_site


def test_the_sync_ledger_records_each_kind_of_read_with_its_caller():
    gpu, host = mark(torch.arange(4.0), DEVICE), mark(torch.arange(4.0), HOST)
    with DeviceLedger() as ledger:
        gpu.sum().item()
        gpu.tolist()
        bool(gpu[0] > 1)
        int(gpu[1])
        gpu[gpu > 1]
        gpu.nonzero()
        gpu.cpu()
        host.sum().item()  # the host's own values: no read
        host[host > 1]
    assert len(ledger.reads) == 7
    assert {_site(s) for s in ledger.reads} == {"tests/train/test_gpu_rehearsal.py (test_the_sync_ledger_records_each_kind_of_read_with_its_caller)"}


def test_is_cuda_and_get_device_agree_with_device():
    gpu, host = mark(torch.ones(2), DEVICE), mark(torch.ones(2), HOST)
    with DeviceLedger():
        assert gpu.is_cuda and gpu.get_device() == 0 and gpu.device.type == "cuda"
        assert not host.is_cuda and host.get_device() == -1 and host.device.type == "cpu"


def test_a_call_only_the_math_kernel_takes_fails(monkeypatch):
    """Grouped heads with a mask (flash takes no mask, memory-efficient no GQA): the planted defect
    the sdpa backend had before it repeated K/V."""
    from tests.train.gpu_rehearsal import KernelError

    monkeypatch.setenv("REHEARSAL_MATH_LIMIT", "0")
    q, k, v = (mark(torch.randn(1, n, 16, 8, dtype=torch.bfloat16), DEVICE) for n in (4, 2, 2))
    mask = mark(torch.ones(16, 16, dtype=torch.bool).tril(), DEVICE)
    with DeviceLedger():
        F = torch.nn.functional
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # flash takes it
        F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask)
        with pytest.raises(KernelError, match="math kernel"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def test_the_rehearsed_varlen_attn_checks_its_contract_and_computes_attention():
    from tests.model.test_attention import _reference
    from tests.train.gpu_rehearsal import KernelError, rehearsed_varlen_attn

    gen = torch.Generator().manual_seed(0)
    q, k, v = (mark(torch.randn(9, n, 8, generator=gen).bfloat16(), DEVICE) for n in (4, 2, 2))
    cu = mark(torch.tensor([0, 4, 9], dtype=torch.int32), DEVICE)
    with DeviceLedger() as ledger:
        out = rehearsed_varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0), enable_gqa=True)
        with pytest.raises(KernelError, match="on the attention's device"):
            rehearsed_varlen_attn(q, k, v, mark(cu.clone(), HOST), cu, 5, 5, window_size=(-1, 0), enable_gqa=True)
        with pytest.raises(KernelError, match="Python int"):
            rehearsed_varlen_attn(q, k, v, cu, cu, cu.max(), 5, window_size=(-1, 0), enable_gqa=True)
        with pytest.raises(KernelError, match="enable_gqa"):
            rehearsed_varlen_attn(q, k, v, cu, cu, 5, 5, window_size=(-1, 0))
        with pytest.raises(KernelError, match="max_k 4 is less than the longest sequence"):
            rehearsed_varlen_attn(q, k, v, cu, cu, 5, 4, window_size=(-1, 0), enable_gqa=True)
    assert not ledger.reads
    sample = torch.tensor([0] * 4 + [1] * 5)
    allowed = (sample[:, None] == sample[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    expected = _reference(*(t.float().transpose(0, 1)[None] for t in (q, k, v)), allowed[None, None])
    assert (out.float() - expected[0].transpose(0, 1)).abs().max() < 2e-2


def test_the_rehearsed_weight_gradient_gemm_checks_its_contract_and_adds_in_fp32():
    from tests.train.gpu_rehearsal import KernelError, rehearsed_accumulate_on_cuda

    gen = torch.Generator().manual_seed(0)
    grad_output_t, total_input = torch.randn(3, 5, generator=gen).bfloat16(), torch.randn(5, 4, generator=gen).bfloat16()
    main_grad = torch.randn(3, 4, generator=gen)
    expected = main_grad + grad_output_t.double().matmul(total_input.double()).float()
    with DeviceLedger() as ledger:
        buffer = mark(main_grad.clone(), DEVICE)
        rehearsed_accumulate_on_cuda(buffer, mark(grad_output_t, DEVICE), mark(total_input, DEVICE))
        with pytest.raises(KernelError, match="one half dtype needed"):
            rehearsed_accumulate_on_cuda(buffer, mark(grad_output_t.float(), DEVICE), mark(total_input, DEVICE))
        with pytest.raises(KernelError, match="a torch.bfloat16 buffer"):
            rehearsed_accumulate_on_cuda(mark(main_grad.bfloat16(), DEVICE), mark(grad_output_t, DEVICE),
                                         mark(total_input, DEVICE))
        with pytest.raises(KernelError, match=r"\(5, 3\) @ \(5, 4\)"):
            rehearsed_accumulate_on_cuda(buffer, mark(grad_output_t.t(), DEVICE), mark(total_input, DEVICE))
        with pytest.raises(DeviceMixError):
            rehearsed_accumulate_on_cuda(buffer, mark(grad_output_t, HOST), mark(total_input, DEVICE))
    assert not ledger.reads
    assert torch.allclose(buffer, expected, rtol=1e-6, atol=1e-6)


def test_indexing_and_zero_dim_tensors_follow_cudas_rules():
    gpu, host = mark(torch.arange(4.0), DEVICE), mark(torch.arange(4.0), HOST)
    with DeviceLedger():
        assert place(gpu[mark(torch.tensor([1, 2]), HOST)]) == DEVICE  # host indices into a device tensor: fine
        with pytest.raises(DeviceMixError, match="indices should be either on cpu"):
            host[mark(torch.tensor([1, 2]), DEVICE)]
        scalar = mark(torch.tensor(2.0), HOST)
        assert place(gpu * scalar) == DEVICE  # elementwise: a 0-dim host tensor is a scalar
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            torch.index_select(gpu, 0, mark(torch.tensor(1), HOST))
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            torch.stack([gpu[0], scalar])


def test_a_parameter_keeps_the_place_of_its_data():
    """The planted defect: a LoRA adapter made on the host beside a model on the device."""
    from tests.train.gpu_rehearsal import _keep_marks_in_parameters

    new = vars(torch.nn.Parameter)["__new__"]
    try:
        _keep_marks_in_parameters()
        with DeviceLedger():
            weight = torch.nn.Parameter(mark(torch.ones(3, 2), DEVICE))
            adapter = torch.nn.Parameter(mark(torch.zeros(2, 3), HOST))
            assert place(weight) == DEVICE and place(adapter) == HOST
            with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
                weight @ adapter
    finally:
        torch.nn.Parameter.__new__ = new


def test_a_move_the_cpu_makes_by_returning_the_tensor_leaves_the_original_where_it_was():
    """A CPU "move" returns the tensor itself: the moved one is a view in its new place, and the original
    keeps its own, known or not (numpy's: before, it took the new place, so that host code holding a
    batch tensor a loader made read it "back" after the batch went to the device)."""
    import numpy as np

    unknown, device = torch.from_numpy(np.arange(4.0)), mark(torch.arange(4.0), DEVICE)
    with DeviceLedger():
        for tensor, before in ((unknown, None), (device, DEVICE)):
            moved = tensor.cpu()
            assert moved is not tensor and place(moved) == HOST and place(tensor) == before


def _restore_backward(monkeypatch):
    """What _watch_backward patches, put back after the test."""
    from megatron.core.distributed import DistributedDataParallel
    from torch.autograd.variable import Variable

    backward = torch.autograd.function.BackwardCFunction
    monkeypatch.setattr(backward, "apply", backward.apply)
    monkeypatch.setattr(DistributedDataParallel, "_make_backward_post_hook",
                        DistributedDataParallel._make_backward_post_hook)
    monkeypatch.setattr(Variable, "_execution_engine", Variable._execution_engine)


def test_backward_is_watched(monkeypatch):
    """The planted defect: a custom autograd function (as megatron-core's tensor-parallel linears,
    cross entropy and recomputation are) whose backward scales the gradient by a host tensor. Its
    forward is clean, so only a watched backward sees it."""
    from tests.train.gpu_rehearsal import _watch_backward

    _restore_backward(monkeypatch)

    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale, None

    with DeviceLedger() as ledger:
        _watch_backward(ledger)
        x = mark(torch.ones(3, requires_grad=True), DEVICE)
        Scaled.apply(x, mark(torch.full((3,), 2.0), DEVICE)).sum().backward()
        assert x.grad.tolist() == [2.0, 2.0, 2.0]
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            Scaled.apply(x, mark(torch.full((3,), 2.0), HOST)).sum().backward()


def test_autograds_own_backward_kernels_are_watched(monkeypatch):
    """The planted defects, in autograd's C++ backward functions, which no Python code runs: a
    masked_scatter, free on a GPU in the forward, whose backward reads its device mask back
    (masked_select's size), and a matrix product whose saved operand is a host tensor by the time
    backward multiplies it with the device gradient."""
    from tests.train.gpu_rehearsal import _watch_backward

    _restore_backward(monkeypatch)
    with DeviceLedger() as ledger:
        _watch_backward(ledger)
        x = mark(torch.ones(4, requires_grad=True), DEVICE)
        mask = mark(torch.tensor([True, False, True, False]), DEVICE)
        target = mark(torch.zeros(4), DEVICE)
        target.masked_scatter(mask, x * 2).sum().backward()
        assert ledger.reads == {"autograd (MaskedScatterBackward0)": 1}
        assert x.grad.tolist() == [2.0, 2.0, 0.0, 0.0] and place(x.grad) == DEVICE

        weight = mark(torch.ones(3, 3, requires_grad=True), DEVICE)
        saved = mark(torch.ones(3, 3), DEVICE)
        product = (weight @ saved).sum()
        mark(saved, HOST)
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            product.backward()


def test_host_indices_into_a_device_tensor_pass_backward_as_on_cuda(monkeypatch):
    """CUDA's index and index_put take host indices into a device tensor, so IndexBackward0 of a
    device tensor indexed by host indices (transformers' Qwen2.5-VL tower reorders its patches so)
    runs; a device tensor saved for it that turned into a host one still fails."""
    from tests.train.gpu_rehearsal import _watch_backward

    _restore_backward(monkeypatch)
    with DeviceLedger() as ledger:
        _watch_backward(ledger)
        x = mark(torch.arange(4.0, requires_grad=True), DEVICE)
        (x[mark(torch.tensor([3, 1]), HOST)] * mark(torch.tensor([1.0, 2.0]), DEVICE)).sum().backward()
        assert ledger.reads == {} and place(x.grad) == DEVICE
        assert x.grad.tolist() == [0.0, 2.0, 0.0, 1.0]
        weight = mark(torch.ones(2), DEVICE)
        product = (x[mark(torch.tensor([3, 1]), HOST)] * weight).sum()
        mark(weight, HOST)
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            product.backward()
