"""A frozen vision tower runs once per step, over every micro batch's images together.

Without Transformer Engine the step is host-bound per micro batch (BENCHMARKS.md: on an H200 each
4096-position micro batch cost ~0.1-0.15 s more than its device work): every micro batch relaunched
the tower's layers for its ~5 images, about a third of the step's kernels for the ~1B LLaVA. A
frozen tower's output needs no gradient and does not depend on which micro batch an image is in,
so the step runs it over many micro batches' images at once and hands each micro batch its rows;
the model (`LaidOutLLaVAModel`) uses them in place of calling the tower. The output held ahead of
the micro batches that take it stays bounded (`HELD_VALUES`: a step of many tiles or frames is run
in groups of micro batches, each group when the schedule reaches it), and each forward stays under
`CHUNK_VALUES` pixel values. A tower with any trained parameter (LoRA included) keeps running per
micro batch, under autograd.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Pixel values per chunk of the tower's batched forward: 65536 patches of 14 x 14 RGB pixels, whose
# FFN activations in bf16 stay below ~0.6 GiB for every tower we build (SigLIP-so400m's: 4304 wide).
CHUNK_VALUES = (1 << 16) * 3 * 14 * 14
# Images whose tower output is computed ahead of the micro batches that take it, in pixel values:
# 2^27 is ~400 CLIP-336 images or ~300 SigLIP-384 tiles, whose outputs take ~0.5 GB in bf16 (the
# output is 1.7-5.4x the pixel values for the towers we build); the ~1B LLaVA's 64-image step fits.
HELD_VALUES = 1 << 27


def frozen_tower(llava) -> torch.nn.Module | None:
    """This rank's vision tower when it runs here and nothing in it is trained, else None."""
    tower = llava.vision_model if llava.add_encoder else None
    if tower is None or any(p.requires_grad for p in tower.parameters()):
        return None
    return tower


def tower_features(tower: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The tower's output for `images` [n, c, h, w] (on its device), in chunks, without autograd."""
    per_chunk = max(1, CHUNK_VALUES // images[0].numel())
    with torch.no_grad():
        return torch.cat([tower(chunk) for chunk in images.split(per_chunk)])


def with_tower_features(llava, inputs, micro_batches: list[dict]) -> Iterator[dict]:
    """`micro_batches` in order, each with `vision_features` (its images' tower output, on the device)
    when the tower is frozen and `inputs` asks for it; else as they are."""
    tower = frozen_tower(llava) if inputs.host_layout and inputs.vision_once_per_step else None
    if tower is None or all(batch["images"].shape[0] == 0 for batch in micro_batches):
        return iter(micro_batches)
    return _featured(tower, inputs, micro_batches)


def _featured(tower, inputs, micro_batches: list[dict]) -> Iterator[dict]:
    image_values = next(batch["images"][0].numel() for batch in micro_batches if batch["images"].shape[0])
    for group in _groups(micro_batches, max(1, HELD_VALUES // image_values)):
        counts = [batch["images"].shape[0] for batch in group]
        if sum(counts) == 0:  # the tower is never called for micro batches without images
            yield from group
            continue
        images = inputs.to_device(torch.cat([batch["images"] for batch in group]), inputs.dtype)
        features = tower_features(tower, images).split(counts)
        yield from ({**batch, "vision_features": rows} for batch, rows in zip(group, features))


def _groups(micro_batches: list[dict], images_per_group: int) -> Iterator[list[dict]]:
    """Consecutive micro batches holding at most `images_per_group` images (at least one batch each)."""
    group, images = [], 0
    for batch in micro_batches:
        n = batch["images"].shape[0]
        if group and images + n > images_per_group:
            yield group
            group, images = [], 0
        group.append(batch)
        images += n
    if group:
        yield group
