"""How a run executes on its devices: attention backend, sequence and context parallelism, FP8,
activation recomputation, communication overlap, and the sequence lengths these need.

`resolve_execution` fills in every "auto" and checks the combination, raising one UserError that
names the flag. `plan.make_plan` calls it, in the launcher before anything starts and in the trainer
again (where Transformer Engine is really imported), so both refuse the same things in the same
words. Imports no torch: run.py --dry-run stays fast.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import UserError
from megatron_ext.model.backends import TE_MISSING, TORCHAO_MISSING, resolve_backend
from megatron_ext.model.execution import ModelExecution
from megatron_ext.model.sequence_alignment import SequenceAlignment, round_up, sequence_alignment


@dataclass(frozen=True)
class Execution:
    model: ModelExecution  # backend, SP/CP, FP8, recomputation: handed whole to the model
    data_parallel_size: int
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    ddp_bucket_size: int | None
    alignment: SequenceAlignment

    def summary(self) -> dict:
        """One flat mapping, as checkpoints have always stored it."""
        fields = asdict(self)
        return {**fields.pop("model"), **fields}


def _needs_te(what: str, requested: str, backend: str) -> None:
    if backend == "te":
        return
    if requested != "auto":
        raise UserError(f"{what} needs Transformer Engine layers; it cannot run with --attention-backend {requested} "
                        "(use --attention-backend te or auto)")
    raise UserError(f"{what} needs {TE_MISSING}")


def _torchao_fp8_problems(config: TrainConfig, backend: str) -> None:
    """torchao's float8 linears (`model/float8_linears.py`) run inside megatron-core's local linear layers,
    where they communicate nothing, and in place of their weight-gradient GEMM."""
    if not config.fp8:
        raise UserError("--fp8-backend torchao chooses what runs --fp8: add --fp8, or drop --fp8-backend")
    if backend == "te":
        raise UserError("--fp8-backend torchao runs in megatron-core's local layers, not Transformer Engine's: use "
                        "--attention-backend sdpa (or local), or --fp8-backend te")
    if config.tp > 1:
        raise UserError(f"--fp8-backend torchao runs at --tp 1 so far (got --tp {config.tp}): megatron-core's "
                        "tensor-parallel layers communicate around their GEMMs; use --tp 1 or --fp8-backend te")
    if config.gradient_accumulation_fusion:
        raise UserError("--fp8-backend torchao computes weight gradients in float8 GEMMs of its own, which cannot add "
                        "into the fp32 buffer: drop --gradient-accumulation-fusion")
    if config.freeze_lm or config.lora_rank:
        raise UserError("--fp8 --fp8-backend torchao computes the language model's trained linear layers in float8, and "
                        "this run trains none (stage 1, --freeze-lm or --lora-rank): drop --fp8")
    if importlib.util.find_spec("torchao") is None:
        raise UserError(TORCHAO_MISSING)


def _gradient_accumulation_fusion(config: TrainConfig, backend: str, on_gpu: bool) -> bool:
    """Weight gradients accumulated straight into the fp32 gradient buffer. By default where a fused
    kernel is known to do it: TE layers themselves, megatron-core's local layers with Apex's
    fused_weight_gradient_mlp_cuda. Asked for, torch's GEMM stands in for Apex's
    (`compat.wgrad_accumulation`), on any device; compiled layers take it too (`model.compiled_linear`)."""
    if config.gradient_accumulation_fusion is None:
        if config.fp8 and config.fp8_backend == "torchao":
            return False
        return on_gpu and (backend == "te" or importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None)
    return config.gradient_accumulation_fusion


def resolve_execution(config: TrainConfig, world_size: int, te: bool, on_gpu: bool) -> Execution:
    """`config` with stage defaults resolved; `te`: Transformer Engine is usable where the trainer runs;
    `on_gpu`: its ranks compute on GPUs."""
    requested = config.attention_backend
    backend = resolve_backend(requested, te)
    if config.fp8 and config.fp8_backend == "te":
        _needs_te("--fp8", requested, backend)
    if config.fp8_backend == "torchao":
        _torchao_fp8_problems(config, backend)
    if config.sequence_parallel:
        _needs_te("--sequence-parallel", requested, backend)
    for flag, value in (("--tp", config.tp), ("--pp", config.pp), ("--cp", config.cp)):
        if value < 1:
            raise UserError(f"{flag} {value} must be >= 1")
    if config.sequence_parallel and config.tp == 1:  # megatron-core's TransformerConfig would refuse it
        raise UserError("--sequence-parallel splits activations over the --tp ranks: it needs --tp 2 or more "
                        "(got --tp 1); drop it or raise --tp")
    if config.cp > 1:
        _needs_te(f"--cp {config.cp} (context parallelism)", requested, backend)
        if config.micro_batch_size != 1:
            raise UserError(f"--cp {config.cp} splits one sequence per micro batch over the context-parallel ranks: "
                            f"use --micro-batch-size 1 (got {config.micro_batch_size})")
    model_parallel = config.tp * config.pp * config.cp
    if world_size % model_parallel:
        layout = f"--tp {config.tp} x --pp {config.pp}" + (f" x --cp {config.cp}" if config.cp > 1 else "")
        raise UserError(f"{layout} = {model_parallel} does not divide the number of processes ({world_size})")
    if backend == "te" and config.packing_seq_length and config.micro_batch_size != 1:
        raise UserError(f"--packing-seq-length with Transformer Engine attention packs one sequence per micro batch: "
                        f"use --micro-batch-size 1 (got {config.micro_batch_size}) and a longer --packing-seq-length "
                        "for more tokens per micro batch")
    if config.overlap_param_gather and not config.dist_optim:
        raise UserError("--overlap-param-gather overlaps the all-gather of --dist-optim; add --dist-optim")
    if config.recompute_num_layers < 1:
        raise UserError(f"--recompute-num-layers must be >= 1, got {config.recompute_num_layers}")
    if config.ddp_bucket_size is not None and config.ddp_bucket_size < 1:
        raise UserError(f"--ddp-bucket-size must be >= 1, got {config.ddp_bucket_size}")

    generates = config.eval_generate_samples > 0
    if generates and (config.sequence_parallel or config.cp > 1):
        raise UserError("--eval-generate-samples generates answers, which megatron-core's LLaVAModel cannot do under "
                        "sequence or context parallelism: drop it (score a checkpoint with scripts/eval/evaluate.py) "
                        "or use --no-sequence-parallel and --cp 1")
    sequence_parallel = config.sequence_parallel
    if sequence_parallel is None:
        sequence_parallel = backend == "te" and config.tp > 1 and not generates
    recompute = config.recompute_granularity
    if recompute == "auto":
        recompute = "selective" if backend == "local" else "none"
    alignment = sequence_alignment(config.tp, config.cp, sequence_parallel, config.fp8)
    if config.seq_length is not None and config.seq_length % alignment.total:
        raise UserError(f"--seq-length {config.seq_length} must be a multiple of {alignment.total} for "
                        f"{_alignment_reason(config, sequence_parallel)}; use {round_up(config.seq_length, alignment.total)}")
    model = ModelExecution(
        attention_backend=backend,
        sequence_parallel=sequence_parallel,
        cp=config.cp,
        fp8=("hybrid" if config.fp8_backend == "te" else "tensorwise") if config.fp8 else None,
        fp8_backend=config.fp8_backend,
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method=config.recompute_method,
        recompute_num_layers=config.recompute_num_layers,
        gradient_accumulation_fusion=_gradient_accumulation_fusion(config, backend, on_gpu),
        logits_where_loss=_logits_where_loss(config, sequence_parallel),
        compile_layers=_compile_layers(config, backend, on_gpu),
        vision_attention=config.vision_attention,
    )
    return Execution(
        model=model,
        data_parallel_size=world_size // model_parallel,
        overlap_grad_reduce=True if config.overlap_grad_reduce is None else config.overlap_grad_reduce,
        overlap_param_gather=config.dist_optim if config.overlap_param_gather is None else config.overlap_param_gather,
        ddp_bucket_size=config.ddp_bucket_size,
        alignment=alignment,
    )


def _compile_layers(config: TrainConfig, backend: str, on_gpu: bool) -> bool:
    if config.compile_layers is None:
        # Measured on an H200 without TE (docs/gpu.md): the eager step waits on megatron-core's Python. At
        # --tp > 1 (the all-reduce traced by `compiled_linear`) not measured yet: compiled when asked for.
        return on_gpu and backend == "sdpa" and config.tp == 1
    if config.compile_layers and backend == "te":
        # Transformer Engine's layers are fused kernels already, and torch.compile does not trace them.
        raise UserError("--compile-layers compiles torch layers: use --attention-backend sdpa, or drop it")
    if config.compile_layers and backend == "local":
        raise UserError("--compile-layers traces --attention-backend sdpa's layers whole; megatron-core's reference "
                        "attention (local) switches RNG states in every layer, where torch.compile breaks the graph: "
                        "use --attention-backend sdpa, or drop it")
    return config.compile_layers


def _logits_where_loss(config: TrainConfig, sequence_parallel: bool) -> bool:
    """On unless the hidden states are split over ranks by position (sequence or context parallelism),
    where a rank's positions are not the batch's."""
    split = sequence_parallel or config.cp > 1
    if config.logits_where_loss and split:
        raise UserError("--logits-where-loss cannot run with sequence or context parallelism (each rank holds "
                        "part of the positions); drop it or use --no-logits-where-loss")
    return not split if config.logits_where_loss is None else config.logits_where_loss


def _alignment_reason(config: TrainConfig, sequence_parallel: bool) -> str:
    reasons = [f"sequence parallelism over --tp {config.tp}"] if sequence_parallel else []
    if config.cp > 1:
        reasons.append(f"--cp {config.cp}")
    if config.fp8:
        reasons.append("--fp8")
    return " and ".join(reasons)
