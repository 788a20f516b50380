"""RoPE angles of 3-D multimodal positions with the (T, H, W) axes interleaved over the frequency
channels (Qwen3-VL): channel j follows H when j % 3 == 1 and W when j % 3 == 2, for j below three
times that axis's section, and T otherwise.

megatron-core's `MultimodalRotaryEmbedding` gives each axis one contiguous chunk of channels
(Qwen2-VL's layout; its `rotary_interleaved` flag means pairwise rotation and fails with mRoPE).
Only the angles differ: this module returns them in megatron-core's layout ([S, B, 1, head size],
the half-size angles twice), so megatron-core's own apply path rotates q and k with them.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding


def channel_axes(mrope_section, channels: int) -> torch.Tensor:
    """int64 [channels]: the position axis (0 T, 1 H, 2 W) each frequency channel follows."""
    j = torch.arange(channels)
    axes = torch.zeros(channels, dtype=torch.long)
    for axis in (1, 2):
        axes[(j % 3 == axis) & (j < 3 * mrope_section[axis])] = axis
    return axes


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """megatron-core's multimodal RoPE embedding (same constructor, same call) with interleaved axes,
    without position interpolation (the Qwen-VL models use none)."""

    def forward(self, position_ids: torch.Tensor, mrope_section, cp_group=None) -> torch.Tensor:
        """Angles [S, B, 1, head size] of positions [3, B, S], for whole (not context-parallel) sequences."""
        group = cp_group if cp_group is not None else self.cp_group
        if group is not None and group.size() > 1:
            raise ValueError("interleaved mRoPE runs without context parallelism so far")
        # fp32 products, as transformers computes them (an angle per axis, then one axis per channel)
        angles = position_ids.to(self.inv_freq.device, torch.float32)[..., None] * self.inv_freq
        axes = channel_axes(mrope_section, angles.shape[-1]).to(angles.device)
        picked = angles.gather(0, axes.expand(1, *angles.shape[1:])).squeeze(0)  # [B, S, channels]
        return torch.cat((picked, picked), dim=-1)[:, :, None, :].transpose(0, 1).contiguous()
