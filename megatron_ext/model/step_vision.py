"""A frozen vision tower runs once per step, over every micro batch's images together.

Without Transformer Engine the step is host-bound per micro batch (BENCHMARKS.md: on an H200 each
4096-position micro batch cost ~0.1-0.15 s more than its device work): every micro batch relaunched
the tower's layers for its ~5 images, about a third of the step's kernels for the ~1B LLaVA. A
frozen tower's output needs no gradient and does not depend on which micro batch an image is in,
so the step runs it over many micro batches' images at once and hands each micro batch its rows;
the model (`LaidOutLLaVAModel`) uses them in place of calling the tower. The output held ahead of
the micro batches that take it stays under `HELD_BYTES` (a step of many tiles or frames is run in
groups of micro batches, each group when the schedule reaches it), and each forward stays under
`CHUNK_VALUES` pixel values. A tower with any trained parameter (LoRA included) keeps running per
micro batch, under autograd.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Pixel values per chunk of the tower's batched forward: 65536 patches of 14 x 14 RGB pixels, whose
# FFN activations in bf16 stay below ~0.6 GiB for every tower we build (SigLIP-so400m's: 4304 wide).
CHUNK_VALUES = (1 << 16) * 3 * 14 * 14
# Tower output computed ahead of the micro batches that take it: the ~1B LLaVA's 64-image step needs
# 75 MB; a OneVision step of 256 samples x 10 SigLIP tiles would need 4.3 GB and runs in groups.
HELD_BYTES = 1 << 30


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
    first = next(batch["images"][:1] for batch in micro_batches if batch["images"].shape[0])
    per_image = _output_bytes(tower, inputs.to_device(first, inputs.dtype))
    for group in _groups(micro_batches, max(1, HELD_BYTES // per_image)):
        counts = [batch["images"].shape[0] for batch in group]
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


def _output_bytes(tower: torch.nn.Module, image: torch.Tensor) -> int:
    """Bytes of the tower's output for one image of this shape: one image run once per tower and
    image shape (a tower's output size is not in one config field across the towers we build)."""
    sizes = tower.__dict__.setdefault("_output_bytes", {})
    if image.shape not in sizes:
        with torch.no_grad():
            out = tower(image)
        sizes[image.shape] = out.numel() * out.element_size()
    return sizes[image.shape]
