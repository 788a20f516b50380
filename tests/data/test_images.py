"""ImagePreprocessor gives the HF image processor's pixel_values, by its direct path where it can."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.image_processing_backends import PilBackend
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from megatron_ext.data.images import ImagePreprocessor


def _photo(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    coarse = Image.fromarray((rng.rand(6, 8, 4) * 255).astype("uint8"), "RGBA").resize((width, height), Image.BICUBIC)
    noisy = np.clip(np.asarray(coarse, dtype=np.int16) + rng.randint(-20, 20, (height, width, 4)), 0, 255)
    image = Image.fromarray(noisy.astype("uint8"), "RGBA")
    return image if mode == "RGBA" else image.convert(mode)


PROCESSORS = {
    "clip-336": lambda: CLIPImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}),
    "clip-224": lambda: CLIPImageProcessorPil(),
    "siglip-384": lambda: SiglipImageProcessorPil(size={"height": 384, "width": 384}),
    "clip-no-crop-bilinear": lambda: CLIPImageProcessorPil(do_center_crop=False, resample=Image.BILINEAR),
}
# Landscape, portrait, square, odd sizes, one smaller than the output, and modes that need conversion.
IMAGES = [(640, 480, "RGB"), (480, 640, "RGB"), (336, 336, "RGB"), (1001, 333, "RGB"), (97, 131, "RGB"),
          (300, 200, "L"), (256, 192, "RGBA"), (200, 300, "P"), (123, 77, "CMYK")]


@pytest.mark.parametrize("name", PROCESSORS)
def test_pixels_equal_the_hf_processor(name):
    processor = PROCESSORS[name]()
    preprocess = ImagePreprocessor(processor)
    assert preprocess.steps is not None, "CLIP and SigLIP processors take the direct path"
    for seed, (width, height, mode) in enumerate(IMAGES):
        image = _photo(width, height, mode, seed)
        assert preprocess.direct_path_takes(image)
        expected = processor(images=[image], return_tensors="pt")["pixel_values"]
        got = preprocess([image])
        assert got.dtype == torch.float32 and got.shape == expected.shape, (width, height, mode)
        assert torch.allclose(got, expected.float(), atol=1e-5, rtol=0), (width, height, mode)
    batch = [_photo(640, 480, seed=1), _photo(640, 480, "L", seed=2)]
    assert torch.allclose(preprocess(batch), processor(images=batch, return_tensors="pt")["pixel_values"], atol=1e-5)


def test_processors_with_other_steps_run_as_hf_does():
    class Sharpened(CLIPImageProcessorPil):
        def resize(self, image, size, resample=None, **kwargs):
            return PilBackend.resize(self, image, size, resample, **kwargs) // 2 * 2

    processor = Sharpened()
    preprocess = ImagePreprocessor(processor)
    image = _photo(320, 240)
    assert preprocess.steps is None
    assert torch.equal(preprocess([image]), processor(images=[image], return_tensors="pt")["pixel_values"])
    assert ImagePreprocessor(CLIPImageProcessorPil(size={"shortest_edge": 224, "longest_edge": 300})).steps is None


def _expand_to_square(image: Image.Image, colour: tuple) -> Image.Image:
    """LLaVA-1.5's padding, written out: the image centred on a square of `colour`."""
    side = max(image.size)
    square = Image.new("RGB", (side, side), colour)
    square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
    return square


@pytest.mark.parametrize("size", [(60, 30), (30, 61), (45, 45)])
def test_pad_is_llava_15s_rule(size):
    from megatron_ext.data.images import fit_aspect

    processor = PROCESSORS["clip-336"]()
    mean = tuple(int(x * 255) for x in processor.image_mean)
    assert mean == (122, 116, 104)
    image = _photo(*size, seed=3)
    padded = np.asarray(fit_aspect(image, processor, "pad"))
    side = max(size)
    assert padded.shape == (side, side, 3)
    top, left = (side - size[1]) // 2, (side - size[0]) // 2
    assert (padded[top:top + size[1], left:left + size[0]] == np.asarray(image)).all()
    band = np.ones((side, side), dtype=bool)
    band[top:top + size[1], left:left + size[0]] = False
    assert (padded[band] == mean).all() and band.sum() == side * side - size[0] * size[1]
    got = ImagePreprocessor(processor, "pad")([image])
    expected = processor(images=[_expand_to_square(image, mean)], return_tensors="pt")["pixel_values"]
    assert torch.allclose(got, expected, atol=1e-5, rtol=0)
    if size == (60, 30):  # the padding is the normalised mean colour: close to 0 in every channel
        assert got[0, :, :70].abs().max() < 0.02 and got[0, :, 150:180].abs().max() > 0.1


def test_resize_squashes_and_crop_cuts_the_sides():
    processor = PROCESSORS["clip-336"]()
    image = Image.new("RGB", (90, 30), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 10, 30))  # a red band at the left edge
    red = torch.tensor([1.0, -1.0, -1.0])
    squashed = ImagePreprocessor(processor, "resize")([image])
    assert torch.allclose(squashed, processor(images=[image.resize((336, 336))], return_tensors="pt")["pixel_values"],
                          atol=1e-5)
    for aspect, kept in (("resize", True), ("pad", True), ("crop", False)):
        left_column = ImagePreprocessor(processor, aspect)([image])[0, :, 168, 1]
        assert ((left_column * red).sum() > 1.0) == kept, aspect
