"""Activation memory of a native-resolution vision tower (Qwen2.5-VL's, Qwen3-VL's: transformers'
module, whole on every tensor rank of the first stage), measured on meta as `activation_bytes.py`
measures a LLaVA's.

A micro batch's images vary in size; two things bound them: each image, the processor's
max_pixels (--max-pixels, else the checkpoint's processor's, else the family's; the largest has
max_pixels / (patch x merge)^2 merged tokens), and all of them together, the sequence (each merged
token takes one of its positions). What the tower keeps grows
at least linearly with an image's patches (linearly under flash attention, quadratically within an
image where a kernel keeps scores), so for a given number of positions it is largest when they are
filled by the largest images: the plan counts --seq-length / the largest image's tokens of them,
rounded up (`largest_images`), each measured as one image of that size (`image_bytes`). A video's
frame pair is attended to alone, within the video processor's max pixels: the larger of the two
bounds is planned (--max-pixels caps both).

The tower runs transformers' own forward on meta. Its host-side inputs (window order, sequence
boundaries) are computed from the grid on the host, as transformers computes them; the positions
and position-grid weights it computes with are handed to it on meta. Its attention, sdpa in a run
(flash kernels on a GPU: no scores kept), is measured as flash: q, k, v and the output kept
(`_FlashKept`), plus each block's fp32 log-sum-exp when the tower trains.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from megatron_ext.memory.saved_tensors import saved_bytes

# The attention the tower is measured with: its name holds "flash", so that transformers calls it
# once per block over the whole image instead of once per window.
_MEASURED_ATTENTION = "flash_kept_inputs"


@dataclass(frozen=True)
class LargestImages:
    grid: tuple[int, int, int]  # (t, h, w) in patches
    count: int  # of them in one sequence

    @property
    def patches(self) -> int:
        t, h, w = self.grid
        return t * h * w


def largest_images(vision, seq_length: int) -> LargestImages:
    """The largest tower input the task encoder gives a model of `vision`'s input settings (a
    `data.native_resolution.QwenVision`: its checkpoint's processor's or its family's, the run's
    --max-pixels): the larger of the image and video max pixels over patch x merge, capped at the
    sequence; and how many of them fill one sequence."""
    merge = vision.merge_size
    tokens = min(max(vision.max_pixels, vision.video_max_pixels) // vision.factor**2, seq_length)
    # Any grid of this many merged tokens: under flash attention the layout does not change what is kept.
    return LargestImages(grid=(1, merge, merge * tokens), count=math.ceil(seq_length / tokens))


def image_bytes(tower, grid: tuple[int, int, int], trained: bool) -> int:
    """Bytes autograd keeps through `tower` (a meta module, frozen as in the run) for one image of
    `grid`, its features included; the merger trains with the projector."""
    import torch

    from megatron_ext.memory.activation_bytes import flash_lse

    grid_thw = torch.tensor([grid])
    config = tower.config
    row = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.empty((math.prod(grid), row), dtype=tower.dtype, device="meta")
    inputs = _meta_inputs(tower, grid_thw)
    before = config._attn_implementation
    _register_attention()
    config._attn_implementation = _MEASURED_ATTENTION
    try:
        kept = saved_bytes(lambda: tower(pixels, grid_thw=grid_thw, **dict(inputs)), tower.parameters())
    finally:
        config._attn_implementation = before
    return kept + (len(tower.blocks) * flash_lse(config.num_heads, math.prod(grid)) if trained else 0)


def _meta_inputs(tower, grid_thw) -> dict:
    """What the tower computes from the grid and then computes with (patch positions; Qwen3-VL's
    position-grid indices and weights), precomputed on the host by transformers' functions and put
    on meta beside the activations."""
    from transformers import vision_utils

    inputs = {"position_ids": vision_utils.get_vision_position_ids(grid_thw, tower.spatial_merge_size)}
    if hasattr(tower, "pos_embed"):  # a learned position grid, resampled to each image's
        inputs["interp_indices"], inputs["interp_weights"] = vision_utils.get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=tower.num_grid_per_side, mode=tower.interpolation_mode,
            align_corners=tower.interpolation_align_corners, spatial_merge_size=tower.config.spatial_merge_size)
    return {name: tensor.to("meta") for name, tensor in inputs.items()}


@functools.cache
def _register_attention() -> None:
    import torch
    from transformers import AttentionInterface

    class _FlashKept(torch.autograd.Function):
        """The attention's output, keeping for backward what a flash kernel keeps: q, k, v and the
        output (its log-sum-exp is counted apart). Meta only: it is never run backward."""

        @staticmethod
        def forward(ctx, query, key, value):
            out = torch.nn.functional.scaled_dot_product_attention(query, key, value)
            ctx.save_for_backward(query, key, value, out)
            return out.transpose(1, 2)

    def attention(module, query, key, value, attention_mask, **kwargs):
        return _FlashKept.apply(query, key, value), None

    AttentionInterface.register(_MEASURED_ATTENTION, attention)
