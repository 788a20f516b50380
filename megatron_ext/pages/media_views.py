"""A sample's images and videos on the page, as the model gets them: pixel values turned back into
pixels (the processor's rescale and normalize undone), an any-resolution image's grid drawn over
its tiles (tile edges, the unpadded feature area, one newline per feature row), a video's sampled
frames as a strip with their times. Every picture is a data: URI, so the page needs no files."""

from __future__ import annotations

import base64
import html
import io

import numpy as np
import torch

from megatron_ext.data.native_resolution import IMAGE_TOKEN, VIDEO_TOKEN
from megatron_ext.model import tiling
from megatron_ext.pages.encoded_sample import IMAGE, NativeGrid, ShownMedia

ORIGINAL_SIDE = 320  # originals are shown at most this large (the tiles at their own size)
FRAME_SIDE = 112  # a video strip's frames
# A native-resolution image's longer side on the page: up to this, at most 4x its own, never below its
# own (a thin image's tokens stay visible; the page's width still fits a wide one); a video frame's at most.
NATIVE_SIDE = 480
NATIVE_FRAME_SIDE = 196


def _affine(mean, std, scale):
    """(multiplier, offset) per channel that map a normalized value back to 0..255."""
    mean = torch.zeros(3) if mean is None else torch.as_tensor(mean, dtype=torch.float64).flatten().expand(3)
    std = torch.ones(3) if std is None else torch.as_tensor(std, dtype=torch.float64).flatten().expand(3)
    return std / (scale or 1.0), mean / (scale or 1.0)


def _processor_affine(processor):
    normalize = processor.do_normalize
    return _affine(processor.image_mean if normalize else None, processor.image_std if normalize else None,
                   processor.rescale_factor if processor.do_rescale else None)


class PixelsBack:
    """pixel values [n, 3, H, W] -> uint8 pixels [n, H, W, 3] for an encoder's image and video processors."""

    def __init__(self, image_affine, video_affine=None):
        self._image, self._video = image_affine, video_affine

    @classmethod
    def of(cls, encoder) -> "PixelsBack":
        from megatron_ext.data.native_resolution_encoder import NativeResolutionTaskEncoder

        if isinstance(encoder, NativeResolutionTaskEncoder):
            # Its videos are rescaled and normalized with the images' settings (`native_resolution.video_inputs`).
            image = _processor_affine(encoder.processor)
            return cls(image, image)
        processor = encoder.images.processor if encoder.media is None else encoder.media.anyres.processor
        video = encoder.media.video if encoder.media is not None else None
        if video is None:
            return cls(_processor_affine(processor))
        fused = video.normalize  # mean and std already carry the rescale factor (FusedNormalize)
        return cls(_processor_affine(processor), _affine(fused.mean, fused.std, fused.scale if fused.mean is None else None))

    @staticmethod
    def _back(values: torch.Tensor, affine) -> np.ndarray:
        multiplier, offset = affine
        pixels = values.double() * multiplier.view(1, 3, 1, 1) + offset.view(1, 3, 1, 1)
        return pixels.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()

    def image(self, values: torch.Tensor) -> np.ndarray:
        return self._back(values, self._image)

    def video(self, values: torch.Tensor) -> np.ndarray:
        return self._back(values, self._video)


def data_uri(picture, max_side: int | None = None) -> str:
    """A PNG data: URI of a PIL image or a uint8 [H, W, 3] array, shrunk to `max_side` if larger."""
    from PIL import Image

    image = picture if isinstance(picture, Image.Image) else Image.fromarray(picture)
    if max_side and max(image.size) > max_side:
        image = image.copy()
        image.thumbnail((max_side, max_side))
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _figure(body: str, caption: str, css: str = "", attributes: str = "") -> str:
    return f'<figure class="{css}"{attributes}>{body}<figcaption>{html.escape(caption)}</figcaption></figure>'


def _img(uri: str, alt: str, css: str = "") -> str:
    return f'<img class="{css}" src="{uri}" alt="{html.escape(alt)}">'


def original_html(media: ShownMedia) -> str:
    if media.kind != IMAGE:
        frames = media.original
        return _figure("", f"video {media.number}: {len(frames)} frames sampled, {frames.shape[2]}x{frames.shape[1]}")
    width, height = media.original.size
    return _figure(_img(data_uri(media.original, ORIGINAL_SIDE), f"image {media.number}", "original"),
                   f"image {media.number}: original {width}x{height}", "original")


def model_html(media: ShownMedia, layout) -> str:
    """What the model gets; `layout`: the encoder's `anyres.FeatureLayout` (tiled models) or None."""
    tiles = media.tiles
    side = f"{tiles.shape[2]}x{tiles.shape[1]}"
    if media.grid is not None:
        return _native_pairs(media) if media.kind != IMAGE else _native_image(media)
    if media.kind != IMAGE:
        return _video_strip(media)
    if layout is None or len(tiles) == 1:
        what = "its one tile" if layout is not None else "the processed image"
        return _figure(_img(data_uri(tiles[0]), "model input", "tile"),
                       f"{what}, {side}: {media.positions:,} positions", "model")
    return (_figure(_img(data_uri(tiles[0]), "base tile", "tile"), f"base tile {side}: {layout.side ** 2:,} positions", "model")
            + _grid_figure(media, layout))


def grid_facts(row: tiling.Media, layout) -> dict:
    """The grid of an image cut into tiles, in feature rows and columns: its tiles, the unpadded box
    (top, bottom, left, right), the feature grid after downsampling and the newlines (one a row)."""
    rows, cols = tiling.grid_shape(row.height, row.width, layout.tiling, layout.tile)
    box = tiling.unpadded_box(rows * layout.side, cols * layout.side, row.height, row.width)
    final = tiling.downsampled(box[1] - box[0], box[3] - box[2], layout.side, layout.tiling.max_tiles)
    return {"rows": rows, "cols": cols, "box": box, "final": final, "newlines": final[0]}


def _grid_figure(media: ShownMedia, layout) -> str:
    facts = grid_facts(media.row, layout)
    rows, cols, tile = facts["rows"], facts["cols"], layout.tile
    grid = media.tiles[1:].reshape(rows, cols, tile, tile, 3).swapaxes(1, 2).reshape(rows * tile, cols * tile, 3)
    width, height = cols * tile, rows * tile
    scale = tile / layout.side  # pixels per feature
    top, bottom, left, right = (v * scale for v in facts["box"])
    margin = max(tile // 4, 6)
    edges = [f'<line class="tile-edge" x1="0" y1="{r * tile}" x2="{width}" y2="{r * tile}"/>' for r in range(1, rows)]
    edges += [f'<line class="tile-edge" x1="{c * tile}" y1="0" x2="{c * tile}" y2="{height}"/>' for c in range(1, cols)]
    final_rows, final_cols = facts["final"]
    step = (bottom - top) / final_rows
    newlines = [f'<circle class="newline" cx="{right + margin / 2:.1f}" cy="{top + (k + 0.5) * step:.1f}" '
                f'r="{min(step, margin) / 4:.1f}"/>' for k in range(final_rows)]
    svg = (f'<svg class="grid" viewBox="0 0 {width + margin} {height}" data-rows="{rows}" data-cols="{cols}" '
           f'data-newlines="{final_rows}">'
           f'<image href="{data_uri(grid)}" width="{width}" height="{height}"/>{"".join(edges)}'
           f'<rect class="unpadded" x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" height="{bottom - top:.1f}"/>'
           f'{"".join(newlines)}</svg>')
    box = facts["box"]
    feature_rows, feature_cols = box[1] - box[0], box[3] - box[2]
    sized = (f", downsampled to {final_rows}x{final_cols}" if (final_rows, final_cols) != (feature_rows, feature_cols) else "")
    caption = (f"grid {rows}x{cols} tiles of {tile} px; features {rows * layout.side}x{cols * layout.side}, unpadded to "
               f"{feature_rows}x{feature_cols} (green){sized}, + {final_rows} newlines (red): "
               f"{final_rows * (final_cols + 1):,} positions")
    return _figure(svg, caption, "model anyres")


def _video_strip(media: ShownMedia) -> str:
    frames = []
    for i, frame in enumerate(media.tiles):
        when = f"{media.times[i]:.2f} s" if media.times else f"frame {i + 1}"
        frames.append(_figure(_img(data_uri(frame, FRAME_SIDE), when, "frame"), when, "frame"))
    size = f"{media.tiles.shape[2]}x{media.tiles.shape[1]}"
    return (f'<div class="strip">{"".join(frames)}</div>'
            f'<p class="caption">video {media.number}: {len(media.tiles)} frames of {size}, pooled, + 1 newline: '
            f'{media.positions:,} positions</p>')


def _patch_grid(pixels: np.ndarray, grid: NativeGrid, scale: float) -> str:
    """`pixels` [H, W, 3] as an SVG `scale` times its size, with its patches' edges (thin) and its
    merged tokens (boxes) drawn."""
    height, width = pixels.shape[:2]
    p, block = grid.patch, grid.patch * grid.merge
    edges = [f'<line class="patch" x1="{x}" y1="0" x2="{x}" y2="{height}"/>' for x in range(p, width, p)]
    edges += [f'<line class="patch" x1="0" y1="{y}" x2="{width}" y2="{y}"/>' for y in range(p, height, p)]
    tokens = [f'<rect class="token" x="{c * block}" y="{r * block}" width="{block}" height="{block}"/>'
              for r in range(grid.h // grid.merge) for c in range(grid.w // grid.merge)]
    return (f'<svg class="native" viewBox="0 0 {width} {height}" width="{width * scale:.0f}" '
            f'height="{height * scale:.0f}" data-size="{width}x{height}" data-patches="{grid.h}x{grid.w}">'
            f'<image href="{data_uri(pixels)}" width="{width}" height="{height}"/>{"".join(edges)}{"".join(tokens)}</svg>')


def _grid_words(grid: NativeGrid) -> str:
    m = grid.merge
    return (f"{grid.h}x{grid.w} patches of {grid.patch} px (thin lines), merged {m}x{m} into "
            f"{grid.h // m}x{grid.w // m} tokens (boxes)")


def _native_image(media: ShownMedia) -> str:
    grid, (pixels,) = media.grid, media.tiles
    height, width = pixels.shape[:2]
    caption = (f"as the model gets it: resized to {width}x{height} (smart resize, multiples of {grid.patch * grid.merge} "
               f"px); grid_thw [{grid.t}, {grid.h}, {grid.w}]: {_grid_words(grid)}: {media.positions:,} positions, "
               f"its {media.positions:,} {IMAGE_TOKEN} in the text")
    return _figure(f'<div class="native" data-grid-thw="{grid.t},{grid.h},{grid.w}" data-tokens="{media.positions}">'
                   f"{_patch_grid(pixels, grid, min(4.0, max(1.0, NATIVE_SIDE / max(height, width))))}</div>",
                   caption, "model native")


def _native_pairs(media: ShownMedia) -> str:
    """A native-resolution video: its frame pairs (one temporal patch each), each with its time; where
    the text times each pair before a run of its own (Qwen3-VL), that text, the pair's grid and its pads."""
    grid, frames = media.grid, media.tiles
    height, width = frames.shape[1:3]
    scale = min(4.0, NATIVE_FRAME_SIDE / max(height, width))
    per_pair = len(frames) // grid.t
    pairs = []
    for k in range(grid.t):
        drawn = "".join(_patch_grid(frame, grid, scale) for frame in frames[k * per_pair:(k + 1) * per_pair])
        caption, attributes = f"pair {k + 1}: {media.times[k]:.2f} s", ""
        if media.timed_pairs:
            stamp, tokens = media.timed_pairs[k]
            caption += f"; {stamp} in the text, grid_thw [1, {grid.h}, {grid.w}]: {tokens} {VIDEO_TOKEN}"
            attributes = f' data-grid-thw="1,{grid.h},{grid.w}" data-tokens="{tokens}" data-stamp="{html.escape(stamp)}"'
        pairs.append(_figure(drawn, caption, "pair", attributes))
    runs = (f", each pair a grid [1, {grid.h}, {grid.w}] of its own after its time in the text"
            if media.timed_pairs else "")
    caption = (f"video {media.number}: {len(frames)} frames resized to {width}x{height}, {grid.t} frame pairs "
               f"(grid_thw [{grid.t}, {grid.h}, {grid.w}]{runs}) of {_grid_words(grid)} each: {media.positions:,} "
               f"positions, its {media.positions:,} {VIDEO_TOKEN} in the text")
    return (f'<div class="strip native" data-grid-thw="{grid.t},{grid.h},{grid.w}" data-tokens="{media.positions}">'
            f'{"".join(pairs)}</div><p class="caption">{html.escape(caption)}</p>')
