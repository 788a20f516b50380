"""Which fused attention kernel CUDA runs for an attention call, by torch 2.13's rules, written down.

`torch.nn.functional.scaled_dot_product_attention` picks, on CUDA, the first kernel of its priority
order (cuDNN on sm90+ with a recent cuDNN, then flash, then memory-efficient) whose checks the call
passes, else the math kernel, which materialises the [batch, heads, queries, keys] scores in fp32.
A CPU build answers every `torch.backends.cuda.can_use_*` question with False, so the rules are
written here instead of asked, each with where it comes from:

- "sdp_utils.cpp": aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (`can_use_flash_attention`,
  `can_use_mem_efficient_attention`, `can_use_cudnn_attention` and their checks, named below);
- "functional.py": torch 2.13's `scaled_dot_product_attention` docstring, which says grouped-query
  attention (`enable_gqa`, fewer key/value heads) runs on the flash and math kernels only;
- "sdp_utils_cpp.h": torch 2.13's `check_batch_size_and_num_heads_dense` (in the installed headers):
  a kernel without GQA support needs as many key/value heads as query heads.

tests/gpu/test_kernel_rules.py runs each kernel alone over a grid of calls on a GPU and compares.
On an H100 (torch 2.11, cuDNN 9.19) flash and memory-efficient matched these rules exactly, and
cuDNN took what its row says, grouped heads, masks and fewer queries than keys included, where the
docstring above names flash and math only. cuDNN is not on every GPU (sm90+, a recent cuDNN, and
ranked by torch's priority order), so `PORTABLE` kernels are what our calls must reach.

Hardware is taken to be an A100/H100 (sm80/sm90), as our GPU runs are. `torch.nn.attention.varlen`'s
`varlen_attn` is flash attention only (no mask, no other kernel): `varlen_problems` states its contract.
The attention backend (`attention.py`) shapes its calls so that a fused kernel takes each, and the GPU
rehearsal checks every call against these rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

HALF = (torch.float16, torch.bfloat16)
# Above this many keys a call only the math kernel takes fails the GPU rehearsal: its scores would cost
# queries x keys x heads x 4 bytes (1 GiB per batch row at 4096 positions and 16 heads).
MATH_KERNEL_LIMIT = 512
# The kernels every sm80+ GPU has (cuDNN attention needs sm90 and a recent cuDNN to be chosen).
PORTABLE = ("flash", "efficient")


@dataclass(frozen=True)
class AttentionCall:
    """What decides the kernel of a scaled_dot_product_attention call on [b, heads, s, d] tensors."""

    dtype: torch.dtype
    head_dim: int
    query_heads: int
    kv_heads: int
    queries: int
    keys: int
    has_mask: bool
    is_causal: bool
    enable_gqa: bool

    @classmethod
    def of(cls, query: torch.Tensor, key: torch.Tensor, attn_mask=None, is_causal: bool = False,
           enable_gqa: bool = False) -> AttentionCall:
        return cls(dtype=query.dtype, head_dim=query.shape[-1], query_heads=query.shape[-3], kv_heads=key.shape[-3],
                   queries=query.shape[-2], keys=key.shape[-2], has_mask=attn_mask is not None, is_causal=is_causal,
                   enable_gqa=enable_gqa)

    @property
    def grouped(self) -> bool:
        return self.kv_heads != self.query_heads


@dataclass(frozen=True)
class Rule:
    what: str  # the condition, in words
    holds: Callable[[AttentionCall], bool]
    source: str


def _heads_fit_with_gqa(c: AttentionCall) -> bool:
    return not c.grouped or (c.enable_gqa and c.query_heads % c.kv_heads == 0)


KERNELS: dict[str, tuple[Rule, ...]] = {
    "flash": (
        Rule("no attn_mask", lambda c: not c.has_mask, "sdp_utils.cpp check_for_attn_mask"),
        Rule("float16 or bfloat16", lambda c: c.dtype in HALF, "sdp_utils.cpp check_dtypes_flash_attention"),
        Rule("head dim <= 256", lambda c: c.head_dim <= 256, "sdp_utils.cpp check_head_dim_size_flash"),
        Rule("is_causal only with as many queries as keys", lambda c: not c.is_causal or c.queries == c.keys,
             "sdp_utils.cpp check_flash_causal_non_square_seqlens"),
        Rule("as many key/value heads as query heads, or GQA with enable_gqa", _heads_fit_with_gqa,
             "sdp_utils.cpp check_batch_size_and_num_heads_dense<supports_gqa=true>"),
    ),
    "efficient": (
        Rule("float32, float16 or bfloat16", lambda c: c.dtype in (torch.float32, *HALF),
             "sdp_utils.cpp can_use_mem_efficient_attention (sm80+ dtypes)"),
        Rule("head dim a multiple of 8 (4 in float32)", lambda c: c.head_dim % (8 if c.dtype in HALF else 4) == 0,
             "sdp_utils.cpp check_head_dim_size_mem_efficient, minimum_gemm_alignment"),
        Rule("as many key/value heads as query heads", lambda c: not c.grouped,
             "functional.py (GQA: flash and math only); sdp_utils_cpp.h check_batch_size_and_num_heads_dense"),
    ),
    "cudnn": (
        Rule("float16 or bfloat16", lambda c: c.dtype in HALF, "sdp_utils.cpp check_dtypes_low_precision"),
        Rule("head dim a multiple of 8, <= 256", lambda c: c.head_dim % 8 == 0 and c.head_dim <= 256,
             "sdp_utils.cpp check_cudnn_tensor_shapes; 256 ran on an H100 (cuDNN 9.19)"),
        Rule("more than one key", lambda c: c.keys > 1, "sdp_utils.cpp check_cudnn_tensor_shapes"),
    ),
}


def fused_kernels(call: AttentionCall) -> list[str]:
    """The fused kernels that accept `call` (empty: only the math kernel does)."""
    return [name for name, rules in KERNELS.items() if all(rule.holds(call) for rule in rules)]


def why_not(call: AttentionCall) -> dict[str, list[str]]:
    """For each fused kernel, the rules `call` breaks, with their sources."""
    return {name: [f"{rule.what} ({rule.source})" for rule in rules if not rule.holds(call)]
            for name, rules in KERNELS.items()}


def varlen_problems(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, enable_gqa: bool = False,
                    window_size=(-1, -1)) -> list[str]:
    """What breaks `varlen_attn`'s contract (torch.nn.attention.varlen, flash attention over THD
    [tokens, heads, dim] tensors; its CUDA kernel checks these or computes garbage without them)."""
    problems = []
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        problems.append("q, k, v must be [tokens, heads, head dim]")
        return problems
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in HALF:
        problems.append(f"q, k, v must share float16 or bfloat16, got {query.dtype}, {key.dtype}, {value.dtype}")
    if not (query.shape[-1] == key.shape[-1] == value.shape[-1]) or query.shape[-1] > 256:
        problems.append(f"head dims must be equal and <= 256, got {query.shape[-1]}, {key.shape[-1]}, {value.shape[-1]}")
    if key.shape[1] != query.shape[1] and not (enable_gqa and query.shape[1] % key.shape[1] == 0):
        problems.append(f"{query.shape[1]} query heads on {key.shape[1]} key/value heads needs enable_gqa=True "
                        "and a whole number of query heads per group")
    for name, cu in (("cu_seq_q", cu_seq_q), ("cu_seq_k", cu_seq_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1:
            problems.append(f"{name} must be a 1-D int32 tensor")
        elif cu.device != query.device:
            problems.append(f"{name} must be on the attention's device ({query.device}), not {cu.device}")
    for name, value_ in (("max_q", max_q), ("max_k", max_k)):
        if not isinstance(value_, int) or isinstance(value_, bool):
            problems.append(f"{name} must be a Python int (a tensor would be read back to the host), "
                            f"got {type(value_).__name__}")
    if len(tuple(window_size)) != 2:
        problems.append(f"window_size must be (left, right), got {window_size}")
    return problems
