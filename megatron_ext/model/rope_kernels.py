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


def rotary_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE on [s, b, h, d] with freqs [s, 1, 1, rot_dim], as megatron-core's unfused bshd path."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    return _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


def rotary_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1,
               cp_rank: int = 0, interleaved: bool = False) -> torch.Tensor:
    """RoPE on THD [t, h, d] whose sequences `cu_seqlens` delimits; freqs [max_s, 1, 1, rot_dim]. As
    megatron-core: freqs covering every token (as many rows as tokens) give each its position in the
    packed row, else each sequence starts at position 0. `interleaved`: megatron-core passes it from 0.19."""
    if cp_size != 1:
        raise ValueError("RoPE over THD without Transformer Engine does not split sequences over context-parallel "
                         "ranks; use --cp 1 or --attention-backend te")
    tokens = t.shape[0]
    if freqs.shape[0] == tokens:
        positions = torch.arange(tokens, device=t.device)
    else:
        positions = positions_in_sequences(cu_seqlens, tokens)
    return rotary_bshd(t.unsqueeze(1), freqs[positions], interleaved).squeeze(1)


def install() -> None:
    """Make megatron-core's fused RoPE entry points these, where no fused implementation is installed;
    then `apply_rope_fusion` takes the host-read-free path (models built after this call)."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = rotary_bshd
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = rotary_thd
