"""What a model computes with: the layer implementation (Transformer Engine, or megatron-core's
local layers with torch SDPA or megatron's reference attention kernel) and the compute dtype.
Imports no torch until asked whether TE is usable (the launcher checks a command without it).

- `te`: TE layers (fused norms, FP8, THD packed attention, sequence/context parallelism); GPU only.
- `sdpa`: local layers with `attention.SDPAttention` (flash / cuDNN kernels on GPU; runs on CPU).
- `local`: local layers with megatron's `DotProductAttention` (the S x S reference kernel).
"""

from __future__ import annotations

from megatron_ext.errors import UserError

ATTENTION_BACKENDS = ("te", "sdpa", "local")
COMPUTE_DTYPES = ("float32", "bfloat16")  # what training and evaluation compute in
FP8_BACKENDS = ("te", "torchao")  # what runs --fp8: Transformer Engine's layers, or torchao's float8 linears
TORCHAO_MISSING = "--fp8-backend torchao needs torchao: pip install 'megatron-ext[fp8]'"
STORED_DTYPES = (*COMPUTE_DTYPES, "float16")  # what a checkpoint's weights may be (HF F16 ones too)
TE_MISSING = ("Transformer Engine with CUDA, which is not importable here; install the gpu extra "
              "(pip install 'megatron-ext[gpu]') or run inside the Singularity image (--sif-path)")


def te_available() -> bool:
    """Transformer Engine's PyTorch layers import (a broken install often imports its top level
    only) and a GPU is there."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    import torch

    return torch.cuda.is_available()


def compute_dtype(requested: str, on_gpu: bool) -> str:
    """"auto": bfloat16 on a GPU, float32 on a CPU (CPU kernels are fp32; bf16 there is slow or missing),
    whatever dtype a checkpoint stores."""
    if requested != "auto":
        return requested
    return "bfloat16" if on_gpu else "float32"


def resolve_backend(requested: str, te: bool) -> str:
    """"auto" means te where Transformer Engine is usable (`te`), else sdpa; te without it is refused."""
    if requested == "auto":
        return "te" if te else "sdpa"
    if requested not in ATTENTION_BACKENDS:
        raise UserError(f"--attention-backend {requested!r}: choose auto, {', '.join(ATTENTION_BACKENDS)}")
    if requested == "te" and not te:
        raise UserError(f"--attention-backend te needs {TE_MISSING}; or use --attention-backend sdpa")
    return requested
