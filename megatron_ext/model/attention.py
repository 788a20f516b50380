"""Core attention on PyTorch's own kernels, for layer specs without Transformer Engine.

megatron-core 0.16's local `DotProductAttention` materialises the S x S score matrix and runs a
softmax over it: memory and time quadratic in the sequence, no flash kernel. `SDPAttention` has
the same constructor and forward interface and computes the same function with
`torch.nn.functional.scaled_dot_product_attention`, which picks a flash / cuDNN / memory-efficient
kernel on GPU (grouped-query attention without repeating K/V) and runs everywhere, CPU included.

Three input forms, as megatron-core's attention layer hands them over:
- unpacked `[s, b, heads, dim]`, causal or bidirectional by `attn_mask_type`;
- with a dense `attention_mask` (megatron's convention: True = masked out), e.g. packed rows of a
  micro batch larger than one;
- packed THD `[t, heads, dim]` with `PackedSeqParams` (cu_seqlens on the compute device): each
  sub-sequence attends to itself only, causally.
Every form is one kernel call per layer. Packed on a GPU in half precision it is
`torch.nn.attention.varlen.varlen_attn` (flash attention over the cu_seqlens, no mask); elsewhere
(fp32, CPU, attention dropout) one SDPA call with the samples' block-diagonal mask, built on the
device from cu_seqlens. In a sliding-window layer (megatron-core's `window_size` /
`window_attn_skip_freq`) each query sees its window: flash's own window on a GPU in half precision,
else a band mask, and plain causal attention where the window covers the whole sequence.

No call is left to SDPA's math kernel, which would hold the [b, heads, S, S] scores in fp32
(`kernel_rules.py` has CUDA's rules): wherever flash cannot run (a mask: fp32 or dropout packing,
several packed rows, band masks, fewer queries than keys; fp32 itself), grouped K/V heads are
repeated, since the memory-efficient kernel takes masks and fp32 but no GQA. Masks are built once per micro batch (cached on
its `PackedSeqParams`) or once per shape (band), not in every layer. `varlen_attn` is called with
the keywords the installed torch has: before `enable_gqa`/`scale`/`window_size` existed (torch
2.11's lacks `enable_gqa`), K/V are repeated, q pre-scaled and windowed layers take the masked path.
It is imported on first use: its module imports TorchDynamo, a second of CPU at every process's
start where no call reaches it (CPU, fp32).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math

import torch
import torch.nn.functional as F

from megatron_ext.model.kernel_rules import AttentionCall, fused_kernels


def _causal(mask_type) -> bool:
    from megatron.core.transformer.enums import AttnMaskType

    return mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)


class SDPAttention(torch.nn.Module):
    """Drop-in `core_attention` for megatron-core's `SelfAttention` (same arguments as DotProductAttention)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__()
        from megatron.core.utils import divide

        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine attention (--attention-backend te)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError("softmax variants need --attention-backend local or te")
        from megatron.core.transformer.utils import is_layer_window_attention

        # (keys before, keys after) each query sees in this layer, as megatron-core's window_size.
        self.window = config.window_size if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None
        tp = pg_collection.tp.size() if pg_collection is not None else _tensor_parallel_size()
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        # apply_query_key_layer_scaling divides and re-multiplies the scores by the layer number in
        # DotProductAttention (an fp16 overflow guard); the net scale is this one.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("attention bias is not supported by the sdpa attention backend")
        causal = _causal(self.attn_mask_type if attn_mask_type is None else attn_mask_type)
        dropout = self.dropout if self.training else 0.0
        with self._dropout_rng(dropout):
            if packed_seq_params is not None:
                return self._packed(query, key, value, packed_seq_params, causal, dropout)
            # [s, b, h, d] -> [b, h, s, d] and back to [s, b, h * d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            # megatron's mask convention (True = masked out) to SDPA's (True = attend)
            allowed = None if attention_mask is None else ~attention_mask
            out = self._attend(q, k, v, allowed, causal, dropout)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    def _packed(self, query, key, value, params, causal: bool, dropout: float):
        """THD: [t, h, d] holding several sequences back to back; the boundaries the rotary
        embedding used (the padded ones when given) delimit them here too."""
        cu_seqlens = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        if dropout == 0.0 and varlen_serves(query) and _varlen_takes_window(self.window):
            return self._varlen(query, key, value, cu_seqlens, params.max_seqlen_q, causal, self.window)
        mask = _packed_mask(params, cu_seqlens, query.shape[0], causal)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        out = self._attend(q, k, v, mask, False, dropout)
        return out[0].transpose(0, 1).reshape(query.shape[0], -1)

    def _varlen(self, query, key, value, cu_seqlens, max_seqlen: int, causal: bool, window):
        return flash_varlen(query, key, value, cu_seqlens, max_seqlen, scale=self.softmax_scale, causal=causal,
                            window=window).reshape(query.shape[0], -1)

    def _attend(self, q, k, v, attention_mask, causal: bool, dropout: float):
        """[b, h, sq, d] attention; a given mask (True = attend, built here or by `_packed_mask`)
        replaces the causal rule (it already holds it)."""
        sq, sk = q.shape[-2], k.shape[-2]
        window = self._window_within(sq, sk, causal)
        if (window is not None and attention_mask is None and sq == sk and dropout == 0.0 and varlen_serves(q)
                and _varlen_takes_window(window)):
            # Rows of one length as THD sequences: flash applies the window itself.
            b, h, s, d = q.shape
            cu_seqlens = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=q.device)
            thd = [t.permute(0, 2, 1, 3).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
            out = self._varlen(*thd, cu_seqlens, s, causal, window)
            return out.reshape(b, s, h, d).permute(0, 2, 1, 3)
        mask = attention_mask
        if window is not None:
            mask, causal = _band(sq, sk, *window, q.device), False
            if attention_mask is not None:
                mask = mask & attention_mask
        elif causal and sq != sk:
            # Fewer queries than keys: they are the last positions (SDPA's own is_causal aligns top-left).
            mask, causal = _band(sq, sk, sk, 0, q.device), False
        grouped = self.heads != self.groups
        if grouped and "flash" not in fused_kernels(AttentionCall.of(q, k, mask, causal, enable_gqa=True)):
            # Only flash takes grouped heads (and no mask, nor fp32): elsewhere the memory-efficient
            # kernel takes the call once K/V are repeated, instead of the math kernel.
            k, v = (_repeat_heads(t, self.heads // self.groups, dim=-3) for t in (k, v))
            grouped = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                              scale=self.softmax_scale, enable_gqa=grouped)

    def _window_within(self, sq: int, sk: int, causal: bool):
        """This layer's window where it hides some key from some query, else None (the window
        covers the whole sequence: plain causal or bidirectional attention computes the same)."""
        if self.window is None:
            return None
        before, after = self.window
        # The last query must reach key 0; with no causal rule the first query the last key too.
        reaches_all = before >= sk - 1 and (causal or after >= sk - 1)
        return None if reaches_all else self.window

    def _dropout_rng(self, dropout: float):
        if dropout == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        from megatron.core import tensor_parallel

        # Heads differ across TP ranks, so their dropout draws from the model-parallel RNG stream.
        return tensor_parallel.get_cuda_rng_tracker().fork()


def varlen_serves(t: torch.Tensor) -> bool:
    """varlen_attn's flash kernel serves CUDA tensors in half precision (no CPU kernel, no fp32).
    `meta` stands in for CUDA in the CPU tests, which check its shapes and call counts."""
    return (t.is_cuda or t.is_meta) and t.dtype in (torch.float16, torch.bfloat16)


def flash_varlen(query, key, value, cu_seqlens, max_seqlen: int, *, scale: float, causal: bool, window=None):
    """[t, heads, d] sequences delimited by `cu_seqlens` (on the device), one flash call, with the keywords
    the installed `varlen_attn` takes: `key`/`value` may hold fewer (grouped) heads; `window`: (keys
    before, keys after) each query sees. Returns [t, heads, d]."""
    before, after = window if window is not None else (-1, -1)
    kernel, takes = _varlen_kernel(), _varlen_keywords()
    options = {}
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in takes:
            options["enable_gqa"] = True
        else:
            key, value = (_repeat_heads(t, query.shape[1] // key.shape[1], dim=1) for t in (key, value))
    if "scale" in takes:
        options["scale"] = scale
    elif (factor := scale * math.sqrt(query.shape[-1])) != 1.0:
        query = query * factor
    if "window_size" in takes:
        options["window_size"] = (before, 0 if causal else after)
    else:
        options["is_causal"] = causal
    return kernel(query, key, value, cu_seqlens.int(), cu_seqlens.int(), max_seqlen, max_seqlen, **options)


# torch's `varlen_attn`, imported on first use (the module's docstring says why), or a stand-in set here
# (the GPU rehearsal's, a test's). A plain global, so that a compiled layer reads it without a graph break.
varlen_attn = None


def _varlen_kernel():
    global varlen_attn
    if varlen_attn is None:
        from torch.nn.attention.varlen import varlen_attn
    return varlen_attn


# kernel -> the keyword arguments it takes (they grew across torch releases). A dict, not lru_cache, which
# torch.compile would warn about and trace through.
_KEYWORDS: dict = {}


def _varlen_keywords() -> frozenset[str]:
    kernel = _varlen_kernel()
    if kernel not in _KEYWORDS:
        _KEYWORDS[kernel] = frozenset(inspect.signature(kernel).parameters)
    return _KEYWORDS[kernel]


def prepare_for_compile() -> None:
    """Import and probe the flash kernel before torch.compile traces a layer: probed inside the first
    graph, the probe's cache changes under it and every layer recompiles once."""
    if torch.cuda.is_available():
        _varlen_keywords()


def _varlen_takes_window(window) -> bool:
    return window is None or "window_size" in _varlen_keywords()


def _repeat_heads(t: torch.Tensor, times: int, dim: int) -> torch.Tensor:
    """Each key/value head `times` times in a row, as grouped-query attention pairs them with queries."""
    return t.repeat_interleave(times, dim=dim)


def _packed_mask(params, cu_seqlens: torch.Tensor, tokens: int, causal: bool) -> torch.Tensor:
    """[t, t] (True = attend) of the samples that `cu_seqlens` delimits, built on the device once per
    micro batch: kept on its PackedSeqParams, which every layer of the micro batch receives."""
    masks = vars(params).setdefault("_sdpa_masks", {})
    if causal not in masks:
        masks[causal] = sample_mask(cu_seqlens, tokens, causal)
    return masks[causal]


def sample_mask(cu_seqlens: torch.Tensor, tokens: int, causal: bool) -> torch.Tensor:
    """[t, t] (True = attend): each token sees the tokens of its own sequence (`cu_seqlens` delimits them),
    built on their device without reading them back."""
    positions = torch.arange(tokens, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    sample = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    mask = sample[:, None] == sample[None, :]
    return mask.tril() if causal else mask


@functools.lru_cache(maxsize=4)
def _band(sq: int, sk: int, before: int, after: int, device) -> torch.Tensor:
    """[sq, sk] keys each query may see (True = attend): at most `before` keys back and `after` ahead,
    the queries being the last `sq` positions, as megatron-core aligns them. Built once per shape (a
    sliding window's band, the causal rule of a cache), not in every layer."""
    queries = torch.arange(sk - sq, sk, device=device)[:, None]
    keys = torch.arange(sk, device=device)[None, :]
    return (keys >= queries - before) & (keys <= queries + after)


def _tensor_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()
