"""Any-resolution tiles (LLaVA-NeXT, LLaVA-OneVision): an image -> its tiles' pixel_values and size,
and the number of feature positions its `<image>` expands to.

What transformers' PIL-backend `LlavaNextImageProcessorPil` / `LlavaOnevisionImageProcessorPil`
compute for an image of (height, width):
1. the canvas: among the grid pinpoints, the (height, width) that keeps most of the image's pixels
   once the image is scaled to fit in it, and among equals wastes the fewest (`model.tiling.best_resolution`);
2. the image resized (PIL, the processor's filter) to fit the canvas with its aspect ratio kept
   (`fitted_size`), centred on a black canvas, which is cut into tiles of the vision size, row by
   row;
3. the base tile: the whole image squashed to the vision size; it comes first;
4. every tile rescaled and normalized (`pixels.PixelTable`).
OneVision makes one tile of an image that comes with others in its sample: the image padded to a
square with the processor's mean colour, then squashed to the vision size.

`AnyresPreprocessor` does these steps itself for those two classes when each tile is already at
the vision size after step 2 (true of every released LLaVA-NeXT / OneVision config): the same PIL
resize calls on the same pixels and the same float rounding, so pixel_values are torch.equal to
HF's, at less than half the cost (bench/data_bench.py). Any other processor is called as is.

An image smaller than a tile is upsampled as HF does: every pinpoint keeps all its pixels, so the
canvas is the smallest pinpoint (the first listed among equals); the image is enlarged to fit it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from megatron_ext.data.images import rgb
from megatron_ext.data.pixels import PixelTable
from megatron_ext.model import tiling
from megatron_ext.model.arch import TilingArch

log = logging.getLogger(__name__)


def fitted_size(image_size: tuple[int, int], canvas: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of the image scaled to fit `canvas` with its aspect ratio kept: the side that
    binds takes the canvas's length, the other is rounded up (never past the canvas)."""
    height, width = image_size
    canvas_height, canvas_width = canvas
    # The scale is rounded before the product, as HF computes it: ceil sees that rounding (an exact
    # 560 can come out as 560.0000000000001 and round up to 561).
    scale_width, scale_height = canvas_width / width, canvas_height / height
    if scale_width < scale_height:
        return min(math.ceil(height * scale_width), canvas_height), canvas_width
    return canvas_height, min(math.ceil(width * scale_height), canvas_width)


@dataclass(frozen=True)
class Tiles:
    pixel_values: torch.Tensor  # float32 [tiles, 3, tile, tile]: the base tile, then the grid row by row
    image_size: tuple[int, int]  # (height, width) of the image, as HF's image_sizes


@dataclass(frozen=True)
class _Settings:
    pinpoints: tuple[tuple[int, int], ...]
    tile: int
    resample: int
    one_tile_when_several: bool  # OneVision: an image among several is one padded square
    mean_colour: tuple[int, ...]


def _tile_size(processor) -> int:
    """The tile side HF's _preprocess cuts with."""
    crop, size = processor.crop_size, processor.size
    if crop and crop.height:
        return int(crop.height)
    return int(size.height or size.shortest_edge)


def _direct_settings(processor) -> _Settings | None:
    """The processor's settings if the direct path gives its exact pixels, else None."""
    try:
        from transformers.image_utils import PILImageResampling
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
        from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
            LlavaOnevisionImageProcessorPil,
        )
    except ImportError:
        return None
    if type(processor) not in (LlavaNextImageProcessorPil, LlavaOnevisionImageProcessorPil):
        return None
    tile, size = _tile_size(processor), processor.size
    # Each tile and the base tile must come out of steps 2-3 at the size the per-tile resize and
    # crop leave unchanged; then those are copies, as PIL's resize to the same size is.
    square = (size.shortest_edge == tile and not size.longest_edge) or (size.height == size.width == tile)
    crop_ok = not processor.do_center_crop or (processor.crop_size.height == processor.crop_size.width == tile)
    pinpoints = tuple((int(h), int(w)) for h, w in processor.image_grid_pinpoints)
    resample = processor.resample if processor.resample is not None else Image.Resampling.BILINEAR
    if not (processor.do_resize and processor.do_convert_rgb and square and crop_ok
            and all(h % tile == 0 and w % tile == 0 for h, w in pinpoints)
            and isinstance(resample, (int, PILImageResampling))):
        return None
    mean = np.broadcast_to(np.asarray(processor.image_mean, dtype=np.float64), 3)
    return _Settings(pinpoints=pinpoints, tile=tile, resample=int(resample),
                     one_tile_when_several=isinstance(processor, LlavaOnevisionImageProcessorPil),
                     mean_colour=tuple(int(x * 255) for x in mean))


class AnyresPreprocessor:
    """Callable: the images of one sample (PIL) -> a `Tiles` per image, as `processor` computes them."""

    def __init__(self, processor):
        self.processor = processor
        self.settings = _direct_settings(processor)
        self.pixels = PixelTable.of(processor) if self.settings else None
        log.info("anyres preprocessing: %s %s", type(processor).__name__,
                 "settings applied directly (PIL resize, table normalize)" if self.settings else "called as is")

    @property
    def one_tile_when_several(self) -> bool:
        """Whether an image among several of a sample is one tile (OneVision: its processor tells
        multi-image samples by batch_num_images)."""
        if self.settings is not None:
            return self.settings.one_tile_when_several
        return "batch_num_images" in self.processor.model_input_names

    def __call__(self, images: list) -> list[Tiles]:
        several = len(images) > 1
        if self.settings is None or not all(isinstance(image, Image.Image) for image in images):
            return self._hf(images)
        return [self._tiles(rgb(image), several) for image in images]

    def _tiles(self, image: Image.Image, several: bool) -> Tiles:
        s = self.settings
        size = (image.height, image.width)
        if several and s.one_tile_when_several:
            tiles = [self._squashed(self._square(image))]
        else:
            tiles = [self._squashed(image), *self._grid(image)]
        return Tiles(self.pixels(np.stack(tiles)), size)

    def _squashed(self, image: Image.Image) -> np.ndarray:
        tile = self.settings.tile
        return np.asarray(image.resize((tile, tile), resample=self.settings.resample, reducing_gap=None))

    def _square(self, image: Image.Image) -> Image.Image:
        side = max(image.size)
        square = Image.new("RGB", (side, side), self.settings.mean_colour)
        square.paste(image, ((side - image.width) // 2, (side - image.height) // 2))
        return square

    def _grid(self, image: Image.Image) -> np.ndarray:
        """The canvas cut into tiles, row by row: [rows * columns, tile, tile, 3] uint8."""
        tile = self.settings.tile
        canvas_height, canvas_width = tiling.best_resolution(image.height, image.width, self.settings.pinpoints)
        height, width = fitted_size((image.height, image.width), (canvas_height, canvas_width))
        if (height, width) != (image.height, image.width):
            image = image.resize((width, height), resample=self.settings.resample, reducing_gap=None)
        canvas = np.zeros((canvas_height, canvas_width, 3), dtype=np.uint8)
        top, left = (canvas_height - height) // 2, (canvas_width - width) // 2
        canvas[top:top + height, left:left + width] = np.asarray(image)
        rows, columns = canvas_height // tile, canvas_width // tile
        return canvas.reshape(rows, tile, columns, tile, 3).swapaxes(1, 2).reshape(-1, tile, tile, 3)

    def _hf(self, images: list) -> list[Tiles]:
        # OneVision tells a multi-image sample by a nested list (and returns batch_num_images);
        # LLaVA-NeXT takes that too.
        out = self.processor(images=[images], return_tensors="pt")
        one_tile = len(images) > 1 and self.one_tile_when_several
        pinpoints, tile = self.processor.image_grid_pinpoints, _tile_size(self.processor)
        tiles = []
        for pixel_values, size in zip(out["pixel_values"], out["image_sizes"]):
            size = tuple(int(x) for x in size)
            canvas_height, canvas_width = tiling.best_resolution(*size, pinpoints)
            count = 1 if one_tile else math.ceil(canvas_height / tile) * math.ceil(canvas_width / tile) + 1
            # HF pads every image to the most tiles in the batch with zero tiles: not the image's.
            tiles.append(Tiles(pixel_values[:count].float(), size))
        return tiles


@dataclass(frozen=True)
class FeatureLayout:
    """How many positions an HF LLaVA-NeXT / OneVision processor expands `<image>` and `<video>` to:
    the model's own feature layout (`model.tiling`), with the tile size (`tile`) and features per
    tile side (`side`: vision image size // patch size) of its processor. OneVision makes each image
    of a sample with several one tile (`one_tile_when_several`)."""

    tiling: TilingArch
    tile: int
    side: int
    one_tile_when_several: bool = False

    @classmethod
    def of(cls, processor) -> FeatureLayout:
        """The layout an HF `LlavaNextProcessor` or `LlavaOnevisionProcessor` expands `<image>` (and
        `<video>`: its token is the processor's) with."""
        image_processor = processor.image_processor
        pinpoints = tuple((int(h), int(w)) for h, w in image_processor.image_grid_pinpoints)
        tile = _tile_size(image_processor)
        aspect = getattr(processor, "vision_aspect_ratio", None)
        if aspect is None:
            return cls(TilingArch(pinpoints, max_tiles=None, video_token_index=None), tile, tile // processor.patch_size)
        return cls(TilingArch(pinpoints, max_tiles=int(aspect.removeprefix("anyres_max_")),
                              video_token_index=processor.video_token_id),
                   tile, math.isqrt(processor.num_image_tokens), one_tile_when_several=True)

    def image_features(self, image_size: tuple[int, int], several: bool = False) -> int:
        """Feature positions of an image of `image_size` (height, width)."""
        height, width = image_size
        if several and self.one_tile_when_several:
            tiles = 1
        else:
            rows, cols = tiling.grid_shape(height, width, self.tiling, self.tile)
            tiles = rows * cols + 1
        return tiling.feature_count(tiling.Media(tiling.IMAGE, tiles, height, width), self.tiling, self.tile, self.side)

    def video_features(self, frames: int) -> int:
        """Feature positions of a video of `frames` frames."""
        return tiling.feature_count(tiling.Media(tiling.VIDEO, frames), self.tiling, self.tile, self.side)
