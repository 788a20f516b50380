"""model/tiling.py lays out tiled images and videos exactly as transformers' LLaVA-NeXT and OneVision do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_ext.model.arch import TilingArch
from megatron_ext.model.tiling import IMAGE, VIDEO, Media, assemble, feature_count, grid_shape

TILE, PATCH, SIDE, HIDDEN = 56, 14, 4, 8
NEXT_GRIDS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
ONEVISION_GRIDS = [[56 * r, 56 * c] for r in range(1, 7) for c in range(1, 7)]
# (height, width): wide, tall, square, small, large, thin.
SIZES = [(50, 83), (117, 50), (300, 300), (20, 30), (110, 170), (37, 200), (200, 37), (333, 100)]


def _hf_self(grids):
    vision = SimpleNamespace(image_size=TILE, patch_size=PATCH)
    return SimpleNamespace(config=SimpleNamespace(vision_config=vision, image_grid_pinpoints=grids))


def _tiles(height, width, grids):
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    torch.manual_seed(height * 1000 + width)
    return torch.randn(image_size_to_num_patches((height, width), grids, TILE), SIDE * SIDE, HIDDEN)


@pytest.mark.parametrize("height,width", SIZES)
def test_llava_next_images_are_laid_out_as_transformers_does(height, width):
    from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

    tiling = TilingArch(grid_pinpoints=tuple(map(tuple, NEXT_GRIDS)), max_tiles=None, video_token_index=None)
    tiles, newline = _tiles(height, width, NEXT_GRIDS), torch.randn(HIDDEN)
    [expected], _ = LlavaNextModel.pack_image_features(_hf_self(NEXT_GRIDS), [tiles], torch.tensor([[height, width]]),
                                                       "full", image_newline=newline)
    media = Media(IMAGE, len(tiles), height, width)
    assert torch.equal(assemble(tiles, [media], tiling, TILE, newline), expected)
    assert feature_count(media, tiling, TILE, SIDE) == len(expected)


@pytest.mark.parametrize("max_tiles", [1, 2, 9])
@pytest.mark.parametrize("height,width", SIZES)
def test_onevision_images_are_laid_out_and_downsampled_as_transformers_does(height, width, max_tiles):
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    tiling = TilingArch(grid_pinpoints=tuple(map(tuple, ONEVISION_GRIDS)), max_tiles=max_tiles, video_token_index=7)
    tiles, newline = _tiles(height, width, ONEVISION_GRIDS), torch.randn(HIDDEN)
    [expected], _ = LlavaOnevisionModel.pack_image_features(
        _hf_self(ONEVISION_GRIDS), [tiles], torch.tensor([[height, width]]), image_newline=newline,
        vision_aspect_ratio=f"anyres_max_{max_tiles}")
    media = Media(IMAGE, len(tiles), height, width)
    assert torch.equal(assemble(tiles, [media], tiling, TILE, newline), expected)
    assert feature_count(media, tiling, TILE, SIDE) == len(expected)


def test_onevision_videos_and_single_tiles_are_laid_out_as_transformers_does():
    """A video (pooled frames, one newline), an image of one tile, a tiled image: in layout order."""
    from transformers.models.llava_onevision.modeling_llava_onevision import LlavaOnevisionModel

    tiling = TilingArch(grid_pinpoints=tuple(map(tuple, ONEVISION_GRIDS)), max_tiles=2, video_token_index=7)
    newline = torch.randn(HIDDEN)
    frames, single, tiled = torch.randn(4, SIDE * SIDE, HIDDEN), torch.randn(1, SIDE * SIDE, HIDDEN), _tiles(110, 170, ONEVISION_GRIDS)
    hf = _hf_self(ONEVISION_GRIDS)
    video = torch.cat([LlavaOnevisionModel.apply_pooling(hf, frames).reshape(-1, HIDDEN), newline[None]])
    images, _ = LlavaOnevisionModel.pack_image_features(hf, [single, tiled], torch.tensor([[30, 20], [110, 170]]),
                                                        image_newline=newline, vision_aspect_ratio="anyres_max_2")
    layout = [Media(VIDEO, 4), Media(IMAGE, 1, 30, 20), Media(IMAGE, len(tiled), 110, 170)]
    got = assemble(torch.cat([frames, single, tiled]), layout, tiling, TILE, newline)
    assert torch.equal(got, torch.cat([video, *images]))
    assert [feature_count(m, tiling, TILE, SIDE) for m in layout] == [len(video), *map(len, images)]


def test_a_layout_that_does_not_match_the_tiles_is_refused():
    tiling = TilingArch(grid_pinpoints=tuple(map(tuple, NEXT_GRIDS)), max_tiles=None, video_token_index=None)
    rows, cols = grid_shape(50, 83, tiling, TILE)
    tiles = torch.zeros(rows * cols + 1, SIDE * SIDE, HIDDEN)
    with pytest.raises(ValueError, match="the layout gives 2"):
        assemble(tiles[:2], [Media(IMAGE, 2, 50, 83)], tiling, TILE, torch.zeros(HIDDEN))
    with pytest.raises(ValueError, match="names 1 tiles, the images are"):
        assemble(tiles, [Media(IMAGE, 1, 50, 83)], tiling, TILE, torch.zeros(HIDDEN))
