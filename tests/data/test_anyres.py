"""Any-resolution tiles and feature counts equal transformers' LLaVA-NeXT and OneVision processors'."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

from megatron_ext.data.anyres import AnyresPreprocessor, FeatureLayout
from megatron_ext.model.arch import TilingArch
from megatron_ext.model.tiling import best_resolution
from tests.data.test_images import _photo
from tests.reference import hf_processors


def _next():
    """llava-v1.6's settings: CLIP-336 tiles, its five pinpoints."""
    return hf_processors.llava_next(LlavaNextImageProcessorPil(size={"shortest_edge": 336},
                                                               crop_size={"height": 336, "width": 336}))


def _onevision():
    """llava-onevision's settings: SigLIP-384/14 tiles (27 x 27 = 729 features), 36 pinpoints up to 6 x 6."""
    return hf_processors.onevision(LlavaOnevisionImageProcessorPil(), num_image_tokens=729)


def _tiny_onevision():
    """OneVision at tile 28 with 2 x 2 features a tile, pinpoints up to 6 x 6 tiles: anyres_max_9
    downsamples any grid over 10 tiles, at a fraction of the real size's cost."""
    pinpoints = [[28 * rows, 28 * columns] for rows in range(1, 7) for columns in range(1, 7)]
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": 28, "width": 28}, image_grid_pinpoints=pinpoints)
    return hf_processors.onevision(image_processor, num_image_tokens=4)


PROCESSORS = {"llava-next": _next, "onevision": _onevision, "onevision-tiny": _tiny_onevision}
# (width, height, mode): the issue's three, one smaller than a tile, a long one, modes that need conversion.
IMAGES = [(500, 300, "RGB"), (300, 700, "RGB"), (672, 672, "RGB"), (20, 15, "RGB"), (1000, 160, "RGB"),
          (90, 120, "RGBA"), (64, 48, "L")]


def _hf(processor, images: list, text: str):
    return processor(images=[images], text=[text], return_tensors="pt")


@pytest.mark.parametrize("name", PROCESSORS)
def test_tiles_and_counts_equal_the_hf_processor(name):
    processor = PROCESSORS[name]()
    preprocess = AnyresPreprocessor(processor.image_processor)
    layout = FeatureLayout.of(processor)
    assert preprocess.settings is not None, "the PIL-backend processors take the direct path"
    for seed, (width, height, mode) in enumerate(IMAGES):
        image = _photo(width, height, mode, seed)
        expected = _hf(processor, [image], "<image> What is it?")
        (tiles,) = preprocess([image])
        assert tiles.pixel_values.dtype == torch.float32
        assert torch.equal(tiles.pixel_values, expected["pixel_values"][0]), (name, width, height, mode)
        assert tiles.image_size == tuple(expected["image_sizes"][0].tolist()) == (height, width)
        assert layout.image_features(tiles.image_size) == hf_processors.count(expected["input_ids"], "<image>")


def test_the_issue_example_is_five_tiles_and_2928_positions():
    processor = _next()
    (tiles,) = AnyresPreprocessor(processor.image_processor)([_photo(672, 672)])
    assert tiles.pixel_values.shape == (5, 3, 336, 336)
    # 24 x 24 base features + a 48 x 48 grid with a newline per row.
    assert FeatureLayout.of(processor).image_features((672, 672)) == 576 + 48 * 49


def test_onevision_downsamples_large_grids():
    processor = _tiny_onevision()
    layout = FeatureLayout.of(processor)
    assert (layout.side, layout.tiling.max_tiles) == (2, 9)
    # 500 x 300 fills a 6 x 4 tile canvas: a 12 x 8 feature grid, 2.5 times anyres_max_9's 36 features.
    assert best_resolution(300, 500, layout.tiling.grid_pinpoints) == (112, 168)
    image = _photo(500, 300, seed=4)
    expected = _hf(processor, [image], "<image>")
    assert torch.equal(AnyresPreprocessor(processor.image_processor)([image])[0].pixel_values, expected["pixel_values"][0])
    # ratio sqrt(8 * 12 / 36) = 1.63 > 1.1: 8 x 12 -> 4 x 7, each row with its newline, after the base tile.
    assert layout.image_features((300, 500)) == 4 + 4 * 8 == hf_processors.count(expected["input_ids"], "<image>")


@pytest.mark.parametrize("name", PROCESSORS)
def test_images_of_a_multi_image_sample(name):
    """OneVision makes each image of a sample with several one mean-padded tile; LLaVA-NeXT tiles them all."""
    processor = PROCESSORS[name]()
    images = [_photo(500, 300, seed=5), _photo(400, 400, seed=6)]
    expected = _hf(processor, images, "<image> and <image>")
    got = AnyresPreprocessor(processor.image_processor)(images)
    layout = FeatureLayout.of(processor)
    for tiles, pixel_values in zip(got, expected["pixel_values"]):
        # HF pads every image to the most tiles in the batch; the padding tiles are not the image's.
        assert torch.equal(tiles.pixel_values, pixel_values[: len(tiles.pixel_values)])
        assert not pixel_values[len(tiles.pixel_values):].any()
    assert [len(t.pixel_values) for t in got] == ([1, 1] if name != "llava-next" else [3, 5])
    assert sum(layout.image_features(t.image_size, several=True) for t in got) == hf_processors.count(expected["input_ids"], "<image>")


@pytest.mark.parametrize("name", ["llava-next", "onevision"])
def test_counts_over_many_sizes(name):
    """Feature counts against HF's own count for sizes of every shape (no pixels computed)."""
    processor = PROCESSORS[name]()
    layout = FeatureLayout.of(processor)
    sizes = [(h, w) for h in (1, 7, 100, 299, 336, 337, 383, 500, 671, 1000, 1999, 4000)
             for w in (1, 13, 200, 336, 384, 560, 700, 1333, 3000)]
    expected = processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"]
    assert [layout.image_features(size) for size in sizes] == expected


@pytest.mark.parametrize("model", ["llava-next", "onevision"])
def test_counts_equal_the_models_packing(model):
    """The positions the HF models' pack_image_features make of the tiles' features (unpadding,
    newlines, anyres_max_9 downsampling), for a CLIP-like tower of image size 28 and patch 14."""
    from types import SimpleNamespace

    from transformers.models.llava_next.modeling_llava_next import LlavaNextModel
    from transformers.models.llava_onevision.modeling_llava_onevision import (
        LlavaOnevisionModel,
        image_size_to_num_patches,
    )

    layout = FeatureLayout.of(_tiny_onevision()) if model == "onevision" else FeatureLayout(TilingArch(((28, 56), (56, 28), (56, 56)), None, None), 28, 2)
    config = SimpleNamespace(vision_config=SimpleNamespace(image_size=28, patch_size=14),
                             image_grid_pinpoints=[list(p) for p in layout.tiling.grid_pinpoints])
    sizes = [(300, 500), (700, 300), (15, 20), (160, 1000), (28, 28), (100, 3000)]
    features = [torch.zeros(image_size_to_num_patches(size, config.image_grid_pinpoints, 28), 4, 1) for size in sizes]
    if model == "onevision":
        packed, _ = LlavaOnevisionModel.pack_image_features(SimpleNamespace(config=config), features, torch.tensor(sizes),
                                                            image_newline=torch.zeros(1))
    else:
        packed, _ = LlavaNextModel.pack_image_features(SimpleNamespace(config=config), features, torch.tensor(sizes),
                                                       "default", image_newline=torch.zeros(1))
    assert [layout.image_features(size) for size in sizes] == [len(p) for p in packed]


def _shifted(base):
    """`base` with a step of its own: no longer a processor the direct path reproduces."""
    class Shifted(base):
        def normalize(self, image, mean, std, **kwargs):
            return super().normalize(image, mean, std, **kwargs) + 1

    return Shifted


def test_other_processors_run_as_hf_does():
    image_processor = _shifted(LlavaNextImageProcessorPil)(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                           image_grid_pinpoints=[[28, 56], [56, 28], [56, 56]])
    preprocess = AnyresPreprocessor(image_processor)
    assert preprocess.settings is None
    image = _photo(50, 40)
    expected = image_processor(images=[image], return_tensors="pt")
    (tiles,) = preprocess([image])
    assert torch.equal(tiles.pixel_values, expected["pixel_values"][0]) and tiles.image_size == (40, 50)
    # Several images: each keeps its own tiles, none of the zero tiles HF pads the batch with.
    images = [_photo(50, 25, seed=1), _photo(50, 50, seed=2)]
    wide, square = preprocess(images)
    expected = image_processor(images=images, return_tensors="pt")["pixel_values"]
    assert expected.shape[1] == 5 and (len(wide.pixel_values), len(square.pixel_values)) == (3, 5)
    assert torch.equal(wide.pixel_values, expected[0, :3]) and torch.equal(square.pixel_values, expected[1])


def test_other_onevision_processors_make_one_tile_of_each_of_several_images():
    image_processor = _shifted(LlavaOnevisionImageProcessorPil)(size={"height": 28, "width": 28},
                                                                image_grid_pinpoints=[[28, 56], [56, 56]])
    images = [_photo(50, 25, seed=1), _photo(50, 50, seed=2)]
    got = AnyresPreprocessor(image_processor)(images)
    expected = image_processor(images=[images], return_tensors="pt")["pixel_values"]
    assert expected.shape[1] == 1 and [torch.equal(t.pixel_values, e) for t, e in zip(got, expected)] == [True, True]
