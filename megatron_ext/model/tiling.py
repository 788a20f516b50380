"""Where a tiled LLaVA's (LLaVA-NeXT, OneVision) image features come from, as transformers computes them.

An image is resized into the best of the model's grid resolutions and cut into tiles of the
tower's size; the tower sees a base tile (the whole image) first, then the grid's tiles row by
row. Its features are the base tile's patches, then the grid's patches as one picture, cropped
to the image's aspect ratio ("unpadded"), downsampled when larger than about `max_tiles` tiles
(OneVision's anyres_max_N), with a learned newline after every row. An image given one tile
(OneVision's images in a multi-image sample) is its patches and one newline. A video is its
frames, one tile each, pooled 2x2 (bilinear), then one newline.

The model is told what its tiles are by a media layout, one row per image or video in the order
their tokens come in the batch (`Media`), and each of their features is one image token of the
input. The counts here need no torch, so the data side can size samples with them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from megatron_ext.model.arch import TilingArch

if TYPE_CHECKING:
    import torch

IMAGE, VIDEO = 0, 1
# Transformers downsamples only grids more than 10% wider and taller than the limit.
_DOWNSAMPLE_ABOVE = 1.1


class Media(NamedTuple):
    """One row of a media layout: an image (`tiles` tower inputs, its original `height` x `width`)
    or a video (`tiles` frames; its size is not used)."""

    kind: int
    tiles: int
    height: int = 0
    width: int = 0


def layout_tensor(media: list[Media]) -> torch.Tensor:
    """The layout as the model's `media_layout` argument: int64 [len(media), 4]."""
    import torch

    return torch.tensor([tuple(m) for m in media], dtype=torch.long).reshape(-1, 4)


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """The (height, width) of `pinpoints` that keeps most of the image's pixels when it is resized
    into it (aspect kept), then wastes the fewest; the first on a tie."""
    best, best_key = None, None
    for grid_h, grid_w in pinpoints:
        scale = min(grid_w / width, grid_h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        key = (kept, kept - grid_w * grid_h)
        if best_key is None or key > best_key:
            best, best_key = (grid_h, grid_w), key
    return best


def grid_shape(height: int, width: int, tiling: TilingArch, tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles an image of this size is cut into."""
    grid_h, grid_w = best_resolution(height, width, tiling.grid_pinpoints)
    return grid_h // tile, grid_w // tile


def unpadded_box(rows: int, cols: int, height: int, width: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of the features of a `rows` x `cols` feature grid that show the
    image rather than the padding around it (the image was resized to fit, then centred)."""
    if width / height > cols / rows:
        kept = int(round(height * (cols / width), 7))
        pad = (rows - kept) // 2
        return pad, rows - pad, 0, cols
    kept = int(round(width * (rows / height), 7))
    pad = (cols - kept) // 2
    return 0, rows, pad, cols - pad


def downsampled(rows: int, cols: int, side: int, max_tiles: int | None) -> tuple[int, int]:
    """The feature grid after OneVision's anyres_max_N limit (unchanged within it)."""
    if max_tiles is None:
        return rows, cols
    ratio = math.sqrt(rows * cols / (max_tiles * side * side))
    if ratio <= _DOWNSAMPLE_ABOVE:
        return rows, cols
    return int(rows // ratio), int(cols // ratio)


def _grid_rows_cols(media: Media, tiling: TilingArch, tile: int, side: int) -> tuple[tuple[int, int, int, int], tuple[int, int]]:
    """(unpadded box, final feature grid) of an image cut into tiles."""
    rows, cols = grid_shape(media.height, media.width, tiling, tile)
    if media.tiles != rows * cols + 1:
        raise ValueError(f"an image of {media.height}x{media.width} is a base tile and {rows}x{cols} tiles, "
                         f"{rows * cols + 1} in all, but the layout gives {media.tiles}")
    box = unpadded_box(rows * side, cols * side, media.height, media.width)
    return box, downsampled(box[1] - box[0], box[3] - box[2], side, tiling.max_tiles)


def pooled_side(side: int) -> int:
    return math.ceil(side / 2)


def feature_count(media: Media, tiling: TilingArch, tile: int, side: int) -> int:
    """Image tokens (features) of one image or video; `tile`: the tower's image size, `side`: its
    patches per tile side."""
    if media.kind == VIDEO:
        return media.tiles * pooled_side(side) ** 2 + 1
    if media.tiles == 1:
        return side * side + 1
    _, (rows, cols) = _grid_rows_cols(media, tiling, tile, side)
    return side * side + rows * (cols + 1)


def assemble(tiles: torch.Tensor, layout: list[Media], tiling: TilingArch, tile: int, newline: torch.Tensor) -> torch.Tensor:
    """Every media's features [sum of feature counts, h] in layout order, from the projected
    features of all their tiles [tiles, side * side, h] (in the same order) and the newline [h]."""
    import torch

    side = math.isqrt(tiles.shape[1])
    if sum(m.tiles for m in layout) != tiles.shape[0]:
        raise ValueError(f"the media layout names {sum(m.tiles for m in layout)} tiles, the images are {tiles.shape[0]}")
    parts, start = [], 0
    for media in layout:
        own = tiles[start:start + media.tiles]
        start += media.tiles
        if media.kind == VIDEO:
            parts += [_pooled(own, side), newline[None]]
        elif media.tiles == 1:
            parts += [own[0], newline[None]]
        else:
            parts += [own[0], _grid(own[1:], media, tiling, tile, side, newline)]
    return torch.cat(parts)


def _grid(tiles: torch.Tensor, media: Media, tiling: TilingArch, tile: int, side: int, newline: torch.Tensor) -> torch.Tensor:
    import torch
    import torch.nn.functional as F

    (top, bottom, left, right), size = _grid_rows_cols(media, tiling, tile, side)
    rows, cols = grid_shape(media.height, media.width, tiling, tile)
    hidden = tiles.shape[-1]
    # [rows, cols, side, side, h] -> one picture [h, rows * side, cols * side]
    picture = tiles.reshape(rows, cols, side, side, hidden).permute(4, 0, 2, 1, 3).reshape(hidden, rows * side, cols * side)
    picture = picture[:, top:bottom, left:right]
    if size != tuple(picture.shape[1:]):
        picture = F.interpolate(picture[None], list(size), mode="bilinear")[0]
    ends = newline.to(picture.dtype)[:, None, None].expand(hidden, picture.shape[1], 1)
    return torch.cat([picture, ends], dim=-1).flatten(1).transpose(0, 1)


def _pooled(frames: torch.Tensor, side: int) -> torch.Tensor:
    import torch.nn.functional as F

    hidden = frames.shape[-1]
    grid = frames.reshape(frames.shape[0], side, side, hidden).permute(0, 3, 1, 2)
    pooled = F.interpolate(grid, [pooled_side(side)] * 2, mode="bilinear")
    return pooled.permute(0, 2, 3, 1).reshape(-1, hidden)
