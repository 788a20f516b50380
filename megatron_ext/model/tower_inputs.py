"""What transformers' native-resolution vision towers (Qwen2.5-VL's, Qwen3-VL's) compute from their
image grids before their first layer, computed on the host from the grids the batch already holds.

Left to themselves, the towers read their device grid back (patch positions, window order, the
attention boundaries) and, under sdpa, split q, k and v by image with `lengths.tolist()` in every
layer: each a stall of the host until the GPU has caught up. transformers (from 5.17, its `vision_utils`)
takes each value precomputed under its own keyword and pops it instead of computing it, so the family
says which of its `vision_utils` calls its tower makes (`QwenVLFamily.tower_inputs`), and here they
are placed: under sdpa the attention boundaries stay on the host, where its split reads them for free;
under a flash attention (`tower_attention.py`) they go to the device, and their longest sequence goes
beside them as a number, which the tower would otherwise read back. The rest go to the device with
the batch, without waiting.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# The tower's attention boundaries, each with the keyword its longest sequence goes under to a flash attention.
BOUNDARIES = {"cu_seqlens": "max_seqlen", "cu_window_seqlens": "max_window_seqlen"}
# The first transformers release whose Qwen-VL towers take every value the families compute
# (tests/model/test_tower_inputs.py passes on 5.17 and 5.24; 5.10's Qwen3-VL tower took other ones).
FIRST_RELEASE = (5, 17)


def takes_precomputed() -> bool:
    """Whether the installed transformers' towers take the precomputed values (from FIRST_RELEASE on)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release[:2] >= FIRST_RELEASE


def tower_kwargs(compute: Callable[[torch.Tensor], dict], grid: torch.Tensor,
                 to_device: Callable[[torch.Tensor], torch.Tensor], flash: bool) -> dict:
    """`compute(grid)`'s values for the tower's keywords; `flash`: the tower's attention takes its
    boundaries on the device (with their longest sequences), else they stay on the host."""
    values = compute(grid)
    kwargs = {name: value if name in BOUNDARIES and not flash else to_device(value) for name, value in values.items()}
    if flash:
        kwargs.update({BOUNDARIES[name]: int((values[name][1:] - values[name][:-1]).max())
                       for name in BOUNDARIES if name in values})
    return kwargs


def attends_through_flash(tower: Any) -> bool:
    """Whether `tower` attends through a flash attention (transformers' own test: "flash" in its name)."""
    return "flash" in (tower.config._attn_implementation or "")
