"""The native-resolution towers' attention (Qwen2.5-VL's, Qwen3-VL's) as one flash call per layer.

Under sdpa, transformers' towers attend image by image, and in Qwen2.5-VL's windowed layers window by
window: a layer over a few large images is hundreds of small kernels, each launched from Python. Given
an attention whose name says "flash", the same towers hand it every image's (or window's) boundaries
at once (`cu_seqlens`, `max_seqlen`), as they do flash-attn's. `VARLEN` is such an attention on torch's
own flash kernel (`attention.flash_varlen`, `varlen_attn`): no flash-attn package, no Transformer Engine.
Where that kernel cannot run (CPU, fp32) it is one SDPA call under the images' block-diagonal mask,
built on the device from the boundaries, so the tower never reads them back either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext.model.attention import flash_varlen, sample_mask, varlen_serves

# Registered with transformers under this name; "flash" in it is what makes a tower pass its boundaries.
VARLEN = "torch_flash_varlen"
CHOICES = ("sdpa", "varlen")  # --vision-attention: transformers' own sdpa, or VARLEN


def varlen_tower_attention(module, query, key, value, attention_mask, scaling: float | None = None,
                           dropout: float = 0.0, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                           max_length_k=None, is_causal: bool = False, **_):
    """transformers' attention-function interface: [1, heads, t, d] in, ([1, t, heads, d], None) out,
    the tokens delimited by `cu_seq_lens_q` (the towers pass the same boundaries for keys)."""
    if attention_mask is not None or dropout or cu_seq_lens_q is None or cu_seq_lens_k is not cu_seq_lens_q:
        raise ValueError(f"{VARLEN} serves the vision towers' self-attention over cu_seqlens (no mask, no dropout)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if varlen_serves(query):
        thd = [t[0].transpose(0, 1) for t in (query, key, value)]
        out = flash_varlen(*thd, cu_seq_lens_q, max_length_q, scale=scale, causal=is_causal)
        return out.unsqueeze(0), None
    mask = sample_mask(cu_seq_lens_q, query.shape[2], is_causal)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2), None


def use(tower: torch.nn.Module, attention: str) -> torch.nn.Module:
    """`tower` attending with `attention` (one of CHOICES); "sdpa" leaves it as transformers built it."""
    if attention == "varlen":
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN, varlen_tower_attention)
        tower.config._attn_implementation = VARLEN
    elif attention != "sdpa":
        raise ValueError(f"vision attention {attention!r} is not one of {CHOICES}")
    return tower


def compilable_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of each tower in `model` that attends through VARLEN, which torch.compile traces whole; under
    transformers' sdpa a block splits q, k and v by image at lengths it reads from the data, where
    torch.compile breaks the block's graph."""
    return [block for module in model.modules() if hasattr(module, "blocks")
            and getattr(getattr(module, "config", None), "_attn_implementation", None) == VARLEN
            for block in module.blocks]
