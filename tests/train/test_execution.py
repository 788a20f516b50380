"""How a run executes: backends, sequence/context parallelism, FP8, recomputation and overlap,
resolved and refused in one line before anything starts (no torch needed)."""

from __future__ import annotations

import importlib.util

import click
import pytest
from click.testing import CliRunner

from megatron_ext.config.execution_choices import resolve_execution
from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import UserError


def _resolve(world: int = 1, te: bool = False, on_gpu: bool = False, **options):
    return resolve_execution(TrainConfig(stage=2, **options).resolved(), world, te, on_gpu)


def test_auto_picks_te_where_it_is_usable_else_sdpa():
    assert _resolve(te=True).model.attention_backend == "te"
    assert _resolve(te=False).model.attention_backend == "sdpa"
    assert _resolve(te=True, attention_backend="local").model.attention_backend == "local"


def test_defaults_follow_the_backend_and_layout():
    te_tp2 = _resolve(world=4, te=True, tp=2, dist_optim=True)
    assert te_tp2.model.sequence_parallel and te_tp2.alignment.total == 2 and te_tp2.data_parallel_size == 2
    assert te_tp2.model.recompute_granularity is None
    assert te_tp2.overlap_grad_reduce and te_tp2.overlap_param_gather
    assert not _resolve(world=2, te=True, tp=2, sequence_parallel=False).model.sequence_parallel
    # Generation during training runs without sequence parallelism.
    assert not _resolve(world=2, te=True, tp=2, eval_interval=5, eval_generate_samples=2).model.sequence_parallel
    local = _resolve(attention_backend="local")
    assert local.model.recompute_granularity == "selective" and not local.overlap_param_gather
    full = _resolve(recompute_granularity="full", recompute_method="block", recompute_num_layers=2).model
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == ("full", "block", 2)
    cp = _resolve(world=8, te=True, tp=2, cp=2)
    assert (cp.alignment.total, cp.alignment.per_sample, cp.data_parallel_size, cp.model.cp) == (8, 4, 2, 2)
    fp8 = _resolve(te=True, fp8=True)
    assert (fp8.alignment.total, fp8.model.fp8) == (16, "hybrid")
    assert _resolve(te=True).model.fp8 is None
    torchao = _resolve(fp8=True, fp8_backend="torchao").model
    assert (torchao.fp8, torchao.fp8_backend, torchao.gradient_accumulation_fusion) == ("tensorwise", "torchao", False)
    assert _resolve(fp8=True, fp8_backend="torchao").alignment.total == 16  # float8 GEMMs take multiples of 16 rows


def test_layers_compile_by_default_on_a_gpu_where_torch_compile_can_take_them():
    """Measured on an H200 without TE: 1.6x the eager step (BENCHMARKS.md)."""
    assert _resolve(on_gpu=True).model.compile_layers
    # megatron-core's reference attention breaks a compiled layer's graph (its RNG fork, its recomputation).
    assert not _resolve(on_gpu=True, attention_backend="local").model.compile_layers
    assert not _resolve(on_gpu=False).model.compile_layers  # the CPU: compiling costs more than it saves
    assert not _resolve(on_gpu=True, te=True).model.compile_layers  # TE's layers are fused already
    assert not _resolve(world=2, on_gpu=True, tp=2).model.compile_layers  # not measured on several GPUs yet
    assert _resolve(world=2, on_gpu=True, tp=2, compile_layers=True).model.compile_layers
    assert not _resolve(on_gpu=True, compile_layers=False).model.compile_layers
    assert _resolve(on_gpu=False, compile_layers=True).model.compile_layers


@pytest.mark.parametrize("apex", [False, True])
def test_gradient_accumulation_fusion_on_gpu_where_a_kernel_exists(monkeypatch, apex):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if apex and name == "fused_weight_gradient_mlp_cuda" else None)
    assert _resolve(te=True, on_gpu=True).model.gradient_accumulation_fusion
    assert not _resolve(te=True, on_gpu=False).model.gradient_accumulation_fusion
    # Local layers (sdpa, local) fuse only with Apex's kernel, compiled or not.
    assert _resolve(on_gpu=True).model.gradient_accumulation_fusion == apex
    assert _resolve(on_gpu=True, compile_layers=False).model.gradient_accumulation_fusion == apex
    assert not _resolve(on_gpu=False).model.gradient_accumulation_fusion
    # Asked for, torch's GEMM stands in for Apex's, on any device; refused, never on.
    assert _resolve(on_gpu=False, gradient_accumulation_fusion=True).model.gradient_accumulation_fusion
    assert not _resolve(te=True, on_gpu=True, gradient_accumulation_fusion=False).model.gradient_accumulation_fusion


def test_summary_is_flat_as_checkpoints_store_it():
    summary = _resolve(world=2, attention_backend="local", dist_optim=True).summary()
    assert summary == {"attention_backend": "local", "sequence_parallel": False, "cp": 1, "fp8": None, "fp8_backend": "te",
                       "recompute_granularity": "selective", "recompute_method": "uniform", "recompute_num_layers": 1,
                       "gradient_accumulation_fusion": False, "logits_where_loss": True, "compile_layers": False,
                       "vision_attention": "sdpa",
                       "data_parallel_size": 2,
                       "overlap_grad_reduce": True,
                       "overlap_param_gather": True, "ddp_bucket_size": None,
                       "alignment": {"total": 1, "per_sample": 1}}


def test_logits_where_loss_is_on_unless_a_rank_holds_part_of_the_positions():
    assert _resolve().model.logits_where_loss
    assert not _resolve(logits_where_loss=False).model.logits_where_loss
    assert not _resolve(world=2, tp=2, sequence_parallel=True, attention_backend="te", te=True).model.logits_where_loss


REFUSED = {
    "logits where loss with sp": (dict(world=2, tp=2, sequence_parallel=True, attention_backend="te", te=True,
                                       logits_where_loss=True),
                                  "--logits-where-loss cannot run with sequence or context parallelism"),
    "te without TE": (dict(attention_backend="te"), "--attention-backend te needs Transformer Engine with CUDA"),
    "compiled te layers": (dict(attention_backend="te", te=True, compile_layers=True),
                           "--compile-layers compiles torch layers: use --attention-backend sdpa, or drop it"),
    "compiled local layers": (dict(attention_backend="local", compile_layers=True),
                              "--compile-layers traces --attention-backend sdpa's layers whole; megatron-core's "
                              "reference attention (local) switches RNG states in every layer"),
    "fp8 without TE": (dict(fp8=True), "--fp8 needs Transformer Engine with CUDA, which is not importable here"),
    "fp8 with sdpa": (dict(fp8=True, attention_backend="sdpa", te=True),
                      "--fp8 needs Transformer Engine layers; it cannot run with --attention-backend sdpa"),
    "sp with local": (dict(world=2, tp=2, sequence_parallel=True, attention_backend="local", te=True),
                      "--sequence-parallel needs Transformer Engine layers; it cannot run with --attention-backend local"),
    "sp without TE": (dict(world=2, tp=2, sequence_parallel=True), "--sequence-parallel needs Transformer Engine"),
    "cp without TE": (dict(world=2, cp=2), "--cp 2 (context parallelism) needs Transformer Engine"),
    "cp micro batch": (dict(world=2, cp=2, te=True, micro_batch_size=2),
                       "--cp 2 splits one sequence per micro batch over the context-parallel ranks: use --micro-batch-size 1"),
    "layout": (dict(world=4, tp=2, cp=3, te=True), "--tp 2 x --pp 1 x --cp 3 = 6 does not divide the number of processes (4)"),
    "packed rows under TE": (dict(te=True, packing_seq_length=4096, micro_batch_size=2),
                             "--packing-seq-length with Transformer Engine attention packs one sequence per micro batch"),
    "param gather": (dict(overlap_param_gather=True), "--overlap-param-gather overlaps the all-gather of --dist-optim"),
    "seq length": (dict(world=4, tp=4, te=True, seq_length=2050),
                   "--seq-length 2050 must be a multiple of 4 for sequence parallelism over --tp 4; use 2052"),
    "generation under sp": (dict(world=2, tp=2, te=True, sequence_parallel=True, eval_interval=5, eval_generate_samples=2),
                            "--eval-generate-samples generates answers"),
    "recompute layers": (dict(recompute_num_layers=0), "--recompute-num-layers must be >= 1"),
    "torchao's fp8 without torchao": (dict(fp8=True, fp8_backend="torchao", without="torchao"),
                                      "--fp8-backend torchao needs torchao: pip install 'megatron-ext[fp8]'"),
    "torchao's fp8 in TE's layers": (dict(fp8=True, fp8_backend="torchao", te=True),
                                     "--fp8-backend torchao runs in megatron-core's local layers"),
    "torchao's fp8 with a LoRA": (dict(fp8=True, fp8_backend="torchao", lora_rank=8),
                                  "this run trains none (stage 1, --freeze-lm or --lora-rank): drop --fp8"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_in_one_line_naming_the_flag(monkeypatch, name):
    options, message = REFUSED[name]
    options = dict(options)
    if missing := options.pop("without", None):
        find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda module: None if module == missing else find_spec(module))
    with pytest.raises(UserError) as info:
        _resolve(**options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_switches_round_trip_through_the_command_line():
    from megatron_ext.config.options import to_argv
    from megatron_ext.train.cli import trainer_options

    seen = {}

    @click.command()
    @trainer_options
    def command(config):
        seen["config"] = config

    argv = to_argv({"sequence_parallel": False, "overlap_grad_reduce": True, "cp": 2})
    assert argv == ["--no-sequence-parallel", "--overlap-grad-reduce", "--cp", "2"]
    assert CliRunner().invoke(command, argv).exit_code == 0
    config = seen["config"]
    assert (config.sequence_parallel, config.overlap_grad_reduce, config.overlap_param_gather, config.cp) == (False, True, None, 2)
