"""Image preprocessing for the task encoder: the checkpoint's HF image processor, at half the cost.

transformers' PIL-backend processors for CLIP and SigLIP resize, center-crop, rescale and
normalize. Per image they also convert PIL -> numpy -> PIL -> numpy around the resize and
normalize in float64, which costs as much as the resize itself (measured in bench/data_bench.py).
`ImagePreprocessor` reads the processor's own settings and does the same steps once: the same PIL
resize call on the same pixels (so the same bytes), a crop, and rescale + normalize in float32
torch (pixel_values within 1e-6 of HF's; tests hold it to 1e-5 against CLIP and SigLIP).

Any processor it does not reproduce step for step (torchvision backend, padding, tiling, other
size rules, overridden steps) is called as HF's own, so the result is always HF's.

Before either path, `fit_aspect` applies the image aspect mode (`--image-aspect`):
- crop: nothing (the processor's resize + center crop: the sides of a wide image are cut off);
- pad: LLaVA-1.5's rule: pad to a square with the processor's mean colour, the image centred,
  so nothing is cut off (LLaVA-1.5's checkpoints were trained so; fine-tuning them needs it);
- resize: squash to the processor's output size, ignoring the aspect ratio.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

log = logging.getLogger(__name__)

# PilBackend methods whose behaviour the direct path reproduces; a processor class that overrides
# any of them does something else and runs as HF's own.
_REPRODUCED_METHODS = ("preprocess", "_preprocess", "process_image", "convert_to_rgb", "resize", "center_crop",
                       "rescale", "normalize")


@dataclass(frozen=True)
class _Steps:
    """The processor's resolved settings, in the order PilBackend applies them."""

    convert_rgb: bool
    shortest_edge: int | None  # resize so the short side has this length ...
    resize_to: tuple[int, int] | None  # ... or to this (height, width); both None: no resize
    resample: int
    crop: tuple[int, int] | None  # center crop (height, width)
    scale: float | None
    mean: torch.Tensor | None  # [3] float32
    std: torch.Tensor | None


def _direct_steps(processor) -> _Steps | None:
    """The processor's steps if the direct path reproduces them exactly, else None."""
    try:
        from transformers.image_processing_backends import PilBackend
        from transformers.image_utils import PILImageResampling
    except ImportError:
        return None
    cls = type(processor)
    if not isinstance(processor, PilBackend) or any(getattr(cls, m) is not getattr(PilBackend, m) for m in _REPRODUCED_METHODS):
        return None
    if getattr(processor, "do_pad", None):
        return None
    shortest_edge = resize_to = crop = None
    if processor.do_resize:
        size = processor.size
        if size.shortest_edge and not size.longest_edge:
            shortest_edge = int(size.shortest_edge)
        elif size.height and size.width and not size.shortest_edge:
            resize_to = (int(size.height), int(size.width))
        else:
            return None
    resample = _resample(processor)
    if not isinstance(resample, (int, PILImageResampling)):
        return None
    if processor.do_center_crop:
        crop = (int(processor.crop_size.height), int(processor.crop_size.width))
    mean = std = None
    if processor.do_normalize:
        mean, std = (torch.tensor(np.broadcast_to(np.asarray(v, dtype=np.float32), 3).copy())
                     for v in (processor.image_mean, processor.image_std))
    return _Steps(convert_rgb=bool(processor.do_convert_rgb), shortest_edge=shortest_edge, resize_to=resize_to,
                  resample=int(resample), crop=crop, scale=processor.rescale_factor if processor.do_rescale else None,
                  mean=mean, std=std)


def _resample(processor):
    """The processor's PIL resampling filter (HF's default: bilinear)."""
    return processor.resample if processor.resample is not None else Image.Resampling.BILINEAR


def _shortest_edge_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) with the short side at `shortest_edge`; HF truncates the long side to int."""
    if width <= height:
        return int(shortest_edge * height / width), shortest_edge
    return shortest_edge, int(shortest_edge * width / height)


def rgb(image: Image.Image) -> Image.Image:
    """RGB as the processors make it (transparent pixels over white)."""
    from transformers.image_transforms import convert_to_rgb

    if image.mode == "RGB" and image.info.get("transparency") is None:
        return image
    return Image.fromarray(convert_to_rgb(image, return_numpy=True))


def _output_size(processor) -> tuple[int, int]:
    """(height, width) of the processor's pixel_values."""
    if getattr(processor, "do_center_crop", False):
        return int(processor.crop_size.height), int(processor.crop_size.width)
    size = processor.size
    if size.height and size.width:
        return int(size.height), int(size.width)
    return int(size.shortest_edge), int(size.shortest_edge)


def fit_aspect(image: Image.Image, processor, aspect: str) -> Image.Image:
    """`image` made ready for `processor` under the aspect mode `aspect` (see the module docstring)."""
    if aspect == "crop":
        return image
    image = rgb(image)
    if aspect == "resize":
        height, width = _output_size(processor)
        return image.resize((width, height), resample=int(_resample(processor)), reducing_gap=None)
    side = max(image.size)
    if image.width == image.height:
        return image
    mean = tuple(int(x * 255) for x in np.broadcast_to(np.asarray(processor.image_mean, dtype=np.float64), 3))
    square = Image.new("RGB", (side, side), mean)
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return square


class ImagePreprocessor:
    """Callable: a list of PIL images -> float32 pixel_values [n, 3, H, W], as `processor` computes them
    for the images made ready by `fit_aspect`."""

    def __init__(self, processor, aspect: str = "crop"):
        self.processor = processor
        self.aspect = aspect
        self.steps = _direct_steps(processor)
        log.info("image preprocessing: %s %s, aspect %s", type(processor).__name__,
                 "settings applied directly (PIL resize, torch normalize)" if self.steps else "called as is", aspect)

    def __call__(self, images: list) -> torch.Tensor:
        images = [fit_aspect(image, self.processor, self.aspect) for image in images]
        if self.steps is None or not all(self.direct_path_takes(image) for image in images):
            return self.processor(images=images, return_tensors="pt")["pixel_values"].float()
        return torch.stack([self._direct(image) for image in images])

    def direct_path_takes(self, image) -> bool:
        if not isinstance(image, Image.Image):
            return False
        if not self.steps.convert_rgb and image.mode != "RGB":
            return False
        crop = self.steps.crop
        # HF pads an image smaller than the crop; that rare case runs as HF's own.
        return crop is None or all(c <= s for c, s in zip(crop, self._resized_hw(image)))

    def _resized_hw(self, image: Image.Image) -> tuple[int, int]:
        if self.steps.shortest_edge:
            return _shortest_edge_size(image.height, image.width, self.steps.shortest_edge)
        return self.steps.resize_to or (image.height, image.width)

    def _direct(self, image: Image.Image) -> torch.Tensor:
        steps = self.steps
        if steps.convert_rgb:
            image = rgb(image)
        height, width = self._resized_hw(image)
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=steps.resample, reducing_gap=None)
        if steps.crop:
            top, left = (height - steps.crop[0]) // 2, (width - steps.crop[1]) // 2
            image = image.crop((left, top, left + steps.crop[1], top + steps.crop[0]))
        pixels = torch.from_numpy(np.array(image)).float()  # [H, W, 3]
        if steps.scale is not None:
            pixels.mul_(steps.scale)
        if steps.mean is not None:
            pixels.sub_(steps.mean).div_(steps.std)
        return pixels.permute(2, 0, 1)
