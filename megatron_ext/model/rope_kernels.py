"""RoPE over packed (THD) sequences without reading anything back to the host, where Transformer
Engine's fused RoPE is missing.

megatron-core's own THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`) splits the tokens by
`cu_seqlens.tolist()` and compares `cu_seqlens[-1]` with a length: device -> host reads for the query
and the key of every layer of every micro batch, each one a stall of the CPU until the GPU has caught
up. megatron-core calls a fused implementation instead when `apply_rope_fusion` is set, through its
module-level `fused_apply_rotary_pos_emb(_thd)`; Transformer Engine provides them, and without it
(our sdpa backend on a machine without TE, and every CPU run) these do: the position of every token
within its sequence is found on the device (`searchsorted` over `cu_seqlens`) and the frequencies
gathered for it, the same numbers megatron-core's THD path computes.
"""

from __future__ import annotations

import torch


def positions_in_sequences(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens] position of each token within its sequence (`cu_seqlens`: the sequences' starts, then
    the end), on cu_seqlens' device, with no value read back."""
    index = torch.arange(tokens, device=cu_seqlens.device)
    sequence = torch.searchsorted(cu_seqlens.to(index.dtype), index, right=True) - 1
    return index - cu_seqlens.to(index.dtype)[sequence]


class _Rotation:
    """The cos and sin of the last angles asked for: `freqs` itself, or with `cu_seqlens` each packed
    token's row of it.

    Every layer's query and key of a micro batch rotate by the same angles: megatron-core hands them
    the same `freqs` (and `cu_seqlens`) tensors, so the positions, the gather and cos/sin run once per
    micro batch instead of twice per layer (about 10 kernel launches per call: the step is host-bound
    without TE). Tensors are compared by identity and held, so a new micro batch recomputes."""

    def __init__(self):
        self.key: tuple = ()
        self.cos = self.sin = None

    def __call__(self, freqs: torch.Tensor, dtype: torch.dtype, cu_seqlens: torch.Tensor | None = None,
                 tokens: int | None = None):
        if torch.compiler.is_compiling():
            # A compiled layer fuses these into its own kernels; a cache held across calls would only make
            # it guard on (and recompile for) each micro batch's tensors.
            return _cos_sin(freqs, dtype, cu_seqlens, tokens)
        key = (freqs, cu_seqlens, dtype, tokens)
        if not (self.key and self.key[0] is freqs and self.key[1] is cu_seqlens and self.key[2:] == key[2:]):
            self.cos, self.sin = _cos_sin(freqs, dtype, cu_seqlens, tokens)
            self.key = key
        return self.cos, self.sin


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype, cu_seqlens: torch.Tensor | None, tokens: int | None):
    angles = freqs  # bshd, or THD freqs with a row per token: each token's own row
    if cu_seqlens is not None and freqs.shape[0] != tokens:
        angles = freqs[positions_in_sequences(cu_seqlens, tokens)]
    # As megatron-core's bshd path computes them (mscale 1).
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


_rotation = _Rotation()


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """megatron-core's `_apply_rotary_pos_emb_bshd` with cos and sin given."""
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    rotated, passed = t[..., :cos.shape[-1]], t[..., cos.shape[-1]:]
    return torch.cat((rotated * cos + _rotate_half(rotated, interleaved) * sin, passed), dim=-1)


def rotary_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE on [s, b, h, d] with freqs [s, 1, 1, rot_dim], as megatron-core's unfused bshd path."""
    return _rotate(t, *_rotation(freqs, t.dtype), interleaved)


def rotary_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
               cp_rank: int = 0, interleaved: bool = False) -> torch.Tensor:
    """RoPE on THD [t, h, d] whose sequences `cu_seqlens` delimits; freqs [max_s, 1, 1, rot_dim]. As
    megatron-core: freqs covering every token (as many rows as tokens) give each its position in the
    packed row, else each sequence starts at position 0. `interleaved`: megatron-core passes it from 0.19."""
    if cp_size != 1:
        raise ValueError("RoPE over THD without Transformer Engine does not split sequences over context-parallel "
                         "ranks; use --cp 1 or --attention-backend te")
    cos, sin = _rotation(freqs, t.dtype, cu_seqlens, t.shape[0])
    return _rotate(t.unsqueeze(1), cos, sin, interleaved).squeeze(1)


def install() -> None:
    """Make megatron-core's fused RoPE entry points these, where no fused implementation is installed;
    then `apply_rope_fusion` takes the host-read-free path (models built after this call)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rotary_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = rotary_thd
