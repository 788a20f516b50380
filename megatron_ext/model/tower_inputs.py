"""What transformers' native-resolution vision towers (Qwen2.5-VL's, Qwen3-VL's) compute from their
image grids before their first layer, computed on the host from the grids the batch already holds.

Left to themselves, the towers read their device grid back (patch positions, window order, the
attention boundaries) and, under sdpa, split q, k and v by image with `lengths.tolist()` in every
layer: each a stall of the host until the GPU has caught up. transformers (from 5.17, its `vision_utils`)
takes each value precomputed under its own keyword and pops it instead of computing it, so the family
says which of its `vision_utils` calls its tower makes (`QwenVLFamily.tower_inputs`), and here they
are placed: the attention boundaries stay on the host, where sdpa's split reads them for free; the
rest go to the device with the batch, without waiting.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

# The tower's attention boundaries: under sdpa (and eager) its only use of them is the split on the host.
BOUNDARIES = ("cu_seqlens", "cu_window_seqlens")
# The first transformers release whose Qwen-VL towers take every value the families compute
# (tests/model/test_tower_inputs.py passes on 5.17 and 5.24; 5.10's Qwen3-VL tower took other ones).
FIRST_RELEASE = (5, 17)


def takes_precomputed(tower: Any) -> bool:
    """Whether `tower` takes the precomputed values: a transformers from FIRST_RELEASE on, and
    attention that splits by image on the host (flash attention would want the boundaries on the device)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release[:2] < FIRST_RELEASE:
        return False
    return "flash" not in (tower.config._attn_implementation or "")


def tower_kwargs(compute: Callable[[torch.Tensor], dict], grid: torch.Tensor,
                 to_device: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """`compute(grid)`'s values for the tower's keywords: the boundaries on the host, the rest on the device."""
    return {name: value if name in BOUNDARIES else to_device(value) for name, value in compute(grid).items()}
