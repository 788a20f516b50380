"""A frozen vision tower runs once per step, over every micro batch's images together.

Without Transformer Engine the step is host-bound per micro batch (BENCHMARKS.md: on an H200 each
4096-position micro batch cost ~0.1-0.15 s more than its device work): every micro batch relaunched
the tower's layers for its ~5 images, about a third of the step's kernels for the ~1B LLaVA. A
frozen tower's output needs no gradient and does not depend on which micro batch an image is in,
so the step runs it over all the images at once (in chunks of at most `CHUNK_VALUES` pixel values,
so a large global batch of tiles or frames never spikes memory) and hands each micro
batch its rows; the model (`LaidOutLLaVAModel`) uses them in place of calling the tower. A tower
with any trained parameter (LoRA included) keeps running per micro batch, under autograd.
"""

from __future__ import annotations

import torch

# Pixel values per chunk of the tower's batched forward: 65536 patches of 14 x 14 RGB pixels, whose
# FFN activations in bf16 stay below ~0.6 GiB for every tower we build (SigLIP-so400m's: 4304 wide).
CHUNK_VALUES = (1 << 16) * 3 * 14 * 14


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


def with_tower_features(llava, inputs, micro_batches: list[dict]) -> list[dict]:
    """`micro_batches`, each with `vision_features` (its images' tower output, on the device) when the
    tower is frozen and `inputs` asks for it; else unchanged."""
    tower = frozen_tower(llava) if inputs.host_layout and inputs.vision_once_per_step else None
    counts = [batch["images"].shape[0] for batch in micro_batches]
    if tower is None or sum(counts) == 0:
        return micro_batches
    images = inputs.to_device(torch.cat([batch["images"] for batch in micro_batches]), inputs.dtype)
    features = tower_features(tower, images).split(counts)
    return [{**batch, "vision_features": rows} for batch, rows in zip(micro_batches, features)]
