"""Qwen2.5-VL and Qwen3-VL inputs (megatron_ext/data/native_resolution.py) equal transformers 5.24's:
the image processor's rows and grids, the video processors' (with torchvision, in a child), the
processors' expanded text and mm_token_type_ids, and `get_rope_index` of models built from tiny
configs, on samples made here with odd sizes."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (
    BatchFeature,
    Qwen2_5_VLConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.video_utils import VideoMetadata

from megatron_ext.data.native_resolution import (
    CLIP_MEAN,
    CLIP_STD,
    IMAGE_TOKEN,
    QWEN2_5_VL,
    QWEN3_VL,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VideoClip,
    expand_placeholders,
    image_inputs,
    mrope_positions,
    pack_positions,
    patch_rows,
    read_clip,
    resized_size,
    token_types,
    video_inputs,
)
from megatron_ext.errors import UserError
from tests.data.test_video import _write

FAMILIES = {"qwen2_5_vl": QWEN2_5_VL, "qwen3_vl": QWEN3_VL}
# What the published checkpoints' preprocessor_config.json set beside the class defaults.
PUBLISHED = {"qwen2_5_vl": {"patch_size": 14, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD)},
             "qwen3_vl": {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}}


def _noise(height: int, width: int, seed: int, frames: int | None = None) -> np.ndarray:
    shape = (height, width, 3) if frames is None else (frames, height, width, 3)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _image(height: int, width: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(_noise(height, width, seed))


def test_smart_resize_keeps_extreme_aspect_ratios_on_the_patch_grid():
    # (height, width) -> resized: scaled up to min_pixels (37x91), one patch row kept (1000x17),
    # ratio 200 still taken (5x1000), scaled down under max_pixels (3000x2000)
    assert resized_size(QWEN2_5_VL, 37, 91) == (56, 112) and resized_size(QWEN3_VL, 37, 91) == (64, 96)
    assert resized_size(QWEN2_5_VL, 1000, 17) == (1008, 28) and resized_size(QWEN3_VL, 1000, 17) == (992, 32)
    for vision in FAMILIES.values():
        for height, width in [(5, 1000), (3000, 2000), (37, 91), (1000, 17)]:
            expected = smart_resize(height, width, vision.factor, vision.min_pixels, vision.max_pixels)
            assert resized_size(vision, height, width) == expected


def test_what_smart_resize_refuses_is_one_line():
    with pytest.raises(UserError, match=r"^image 1000x4: aspect ratio 250 is above 200, which Qwen3-VL's smart "
                                        r"resize refuses; crop or pad it to at most 200:1$"):
        image_inputs([_image(4, 1000)], QWEN3_VL)
    with pytest.raises(UserError, match="^a video of 1 frame: Qwen3-VL takes videos of at least 2 frames; sample more"):
        video_inputs(VideoClip(_noise(40, 40, 0, frames=1), 10.0, (0,), 1), QWEN3_VL)
    assert video_inputs(VideoClip(_noise(40, 40, 0, frames=1), 10.0, (0,), 1), QWEN2_5_VL)["video_grid_thw"].tolist() == [[1, 24, 24]]


@pytest.mark.parametrize("family", FAMILIES)
def test_image_rows_and_grids_equal_the_transformers_processor(family):
    """Odd sizes, several in one call (a multi-image sample), the class's bounds and smaller ones."""
    images = [_image(37, 91, 1), _image(1000, 17, 2), _image(300, 200, 3)]
    for bounds in ({}, {"min_pixels": 128 * 28 * 28, "max_pixels": 28 * 28 * 64}):
        expected = Qwen2VLImageProcessorPil(**PUBLISHED[family], **bounds)(images=images, return_tensors="pt")
        got = image_inputs(images, dataclasses.replace(FAMILIES[family], **bounds))
        assert got["image_grid_thw"].tolist() == expected["image_grid_thw"].tolist()
        assert torch.equal(got["pixel_values"], expected["pixel_values"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_still_patched_as_a_video_gives_the_image_processors_rows(family):
    """patch_rows, the video layout, on one frame (padded to a pair by repeating it) equals the image
    processor's rows of the same pixels (no resize or normalization: the values pass as they are)."""
    vision = FAMILIES[family]
    pixels = _noise(2 * vision.factor, 3 * vision.factor, 4)
    expected = Qwen2VLImageProcessorPil(**PUBLISHED[family])(images=[pixels], do_resize=False, do_rescale=False,
                                                              do_normalize=False, return_tensors="pt")
    rows, grid = patch_rows(torch.from_numpy(pixels).permute(2, 0, 1)[None].float(), vision)
    assert [grid] == expected["image_grid_thw"].tolist()
    assert torch.equal(rows, expected["pixel_values"])


# (frames, height, width) and bounds: a 5-frame video scaled up to the bounds, an even one of
# another aspect ratio, one scaled down under smaller bounds
VIDEOS = [((5, 37, 91), {}), ((4, 100, 300), {}), ((5, 200, 310), {"video_max_pixels": 4 * 32 * 32 * 12})]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_video_rows_and_grids_equal_transformers_video_processors(tmp_path):
    """Against Qwen2VLVideoProcessor (Qwen2.5-VL's) and Qwen3VLVideoProcessor themselves, run with
    torchvision in a child (tests/reference/torchvision_child), frames given as sampled."""
    from tests.reference import torchvision_child

    classes = {"qwen2_5_vl": "qwen2_vl", "qwen3_vl": "qwen3_vl"}
    requests, cases = [], []
    for family, vision in FAMILIES.items():
        for i, (shape, bounds) in enumerate(VIDEOS):
            video, ours = _noise(*shape[1:], seed=i, frames=shape[0]), dataclasses.replace(vision, **bounds)
            settings = {"do_sample_frames": False, "cap_pixels_per_frame": False,
                        "size": {"shortest_edge": ours.video_min_pixels, "longest_edge": ours.video_max_pixels}}
            requests.append(("qwen_video_processor", {"family": classes[family], "settings": settings, "videos": [video]}))
            cases.append((family, ours, video))
    for (family, vision, video), result in zip(cases, torchvision_child.call_many(tmp_path, requests), strict=True):
        got = video_inputs(VideoClip(video, 10.0, tuple(range(len(video))), len(video)), vision)
        assert got["video_grid_thw"].tolist() == result["video_grid_thw"][0].tolist(), (family, video.shape)
        assert torch.equal(got["pixel_values_videos"], result["pixel_values_videos"][0]), (family, video.shape)


def test_a_decoded_clip_is_timed_as_transformers_times_it(tmp_path):
    """A 5-frame video at 10 fps, decoded with PyAV: Qwen2.5-VL's second_per_grid_ts (2 / the
    sampled rate of transformers' VideoMetadata) and Qwen3-VL's frame-pair timestamps."""
    path = _write(tmp_path / "v.mov", "png", "rgb24", frames=5)
    for frames, indices in ((5, [0, 1, 2, 3, 4]), (3, [0, 2, 4])):
        clip = read_clip(path, frames)
        assert clip.frames.shape == (frames, 24, 32, 3) and list(clip.indices) == indices and clip.fps == 10.0
        metadata = VideoMetadata(total_num_frames=5, fps=10.0, frames_indices=indices)
        spg = video_inputs(clip, QWEN2_5_VL)["second_per_grid_ts"]
        assert torch.equal(spg, torch.tensor([2 / metadata.sampled_fps]))
        assert "second_per_grid_ts" not in video_inputs(clip, QWEN3_VL)
        assert clip.frame_pair_seconds(2) == Qwen3VLProcessor._calculate_timestamps(None, indices, 10.0, 2)
    assert read_clip(path, 5).frame_pair_seconds(2) == [0.05, 0.25, 0.4]


# ---------------------------------------------------------------- text and positions

@functools.cache
def _tokenizer():
    from megatron_ext.demo.tiny_models import train_tokenizer

    tok = train_tokenizer(400)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END]},
                           replace_extra_special_tokens=False)
    return tok


class _SampledVideos:
    """A video processor giving our inputs for clips already sampled, with their VideoMetadata: the
    processors' text side runs as is (the rows are checked against transformers' above)."""

    merge_size, temporal_patch_size = 2, 2

    def __init__(self, vision, clips):
        self.vision, self.clips = vision, clips

    def __call__(self, videos, **kwargs):
        outputs = [video_inputs(clip, self.vision) for clip in self.clips]
        return BatchFeature({"pixel_values_videos": torch.cat([o["pixel_values_videos"] for o in outputs]),
                             "video_grid_thw": torch.cat([o["video_grid_thw"] for o in outputs]),
                             "video_metadata": [VideoMetadata(total_num_frames=c.total, fps=c.fps, frames_indices=list(c.indices))
                                                for c in self.clips]})


def _hf_processor(family, clips):
    base = {"qwen2_5_vl": Qwen2_5_VLProcessor, "qwen3_vl": Qwen3VLProcessor}[family]

    class Processor(base):
        def check_argument_for_proper_class(self, argument_name, argument):
            return type(argument)  # the video processor is _SampledVideos

    return Processor(image_processor=Qwen2VLImageProcessorPil(**PUBLISHED[family]), tokenizer=_tokenizer(),
                     video_processor=_SampledVideos(FAMILIES[family], clips))


@functools.cache
def _hf_model(family):
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 64, "vocab_size": 512, "head_dim": 16}
    vision = {"depth": 1, "hidden_size": 32, "out_hidden_size": 32, "num_heads": 2, "intermediate_size": 64}
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        return Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "fullatt_block_indexes": [0],
                                                                                 "tokens_per_second": QWEN2_5_VL.tokens_per_second}))
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    return Qwen3VLModel(Qwen3VLConfig(text_config=text, vision_config={**vision, "deepstack_visual_indexes": []}))


PROMPT = "look<|vision_start|>{}<|vision_end|> and then"
# name: (text, image sizes, (frames, height, width, fps, indices, total) per video); Qwen2.5-VL's
# video T advances 0.8 per frame pair in the first video (floored: 0, 0, 1) and 10.7 in the second
# (0, 10, 21: past the text after it, which starts at start + max(h, w)/2 = start + 14)
SAMPLES = {
    "two images": ("a " + PROMPT.format(IMAGE_TOKEN) + " b " + PROMPT.format(IMAGE_TOKEN) + " end",
                   [(37, 91), (1000, 17)], []),
    "a 5-frame video": (PROMPT.format(VIDEO_TOKEN) + " what happens?", [], [(5, 37, 91, 10.0, (0, 1, 2, 3, 4), 5)]),
    "image then video": (PROMPT.format(IMAGE_TOKEN) + " vs " + PROMPT.format(VIDEO_TOKEN) + "?",
                         [(91, 37)], [(5, 60, 45, 1.35, (0, 2, 4, 6, 8), 9)]),
}


def _sample(name):
    text, image_sizes, video_specs = SAMPLES[name]
    images = [_image(h, w, i) for i, (h, w) in enumerate(image_sizes)]
    clips = [VideoClip(_noise(h, w, 7, frames=n), fps, indices, total) for n, h, w, fps, indices, total in video_specs]
    return text, images, clips


def _ours(family, text, images, clips):
    """Our expanded ids, token types and positions of one sample."""
    vision, tok = FAMILIES[family], _tokenizer()
    grids = image_inputs(images, vision)["image_grid_thw"] if images else ()
    videos = [video_inputs(clip, vision) for clip in clips]
    video_grids = torch.cat([v["video_grid_thw"] for v in videos]) if videos else ()
    seconds = [clip.frame_pair_seconds(vision.temporal_patch_size) for clip in clips]
    ids = tok(expand_placeholders(text, vision, grids, video_grids, seconds))["input_ids"]
    types = token_types(ids, *tok.convert_tokens_to_ids([IMAGE_TOKEN, VIDEO_TOKEN]))
    spg = torch.cat([v["second_per_grid_ts"] for v in videos]) if videos and "second_per_grid_ts" in videos[0] else None
    return ids, types, mrope_positions(types, vision, grids, video_grids, spg)


def _transformers(family, text, images, clips):
    """transformers' ids, token types and get_rope_index positions of one sample."""
    batch = _hf_processor(family, clips)(text=[text], images=images or None, videos=[c.frames for c in clips] or None,
                                         return_tensors="pt")
    extra = {"second_per_grid_ts": batch["second_per_grid_ts"]} if "second_per_grid_ts" in batch else {}
    positions, _ = _hf_model(family).get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch.get("image_grid_thw"),
                                                    batch.get("video_grid_thw"), **extra)
    return batch["input_ids"][0].tolist(), batch["mm_token_type_ids"][0].numpy(), positions[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", SAMPLES)
def test_expanded_tokens_and_mrope_positions_equal_transformers(family, name):
    ids, types, positions = _ours(family, *_sample(name))
    hf_ids, hf_types, hf_positions = _transformers(family, *_sample(name))
    assert ids == hf_ids
    assert np.array_equal(types, hf_types)
    assert positions.dtype == torch.long and torch.equal(positions, hf_positions)


def test_qwen2_5_vl_video_time_is_scaled_and_the_text_after_restarts_at_start_plus_half_the_side():
    """The notes' probe: a 3x4x4 video at 1 s per frame pair and 4 tokens a second after 3 text tokens."""
    types = [0] * 3 + [2] * 12 + [0] * 2
    positions = mrope_positions(types, QWEN2_5_VL, video_grid_thw=[(3, 4, 4)], second_per_grid_ts=[1.0])
    assert positions[0, 3:15].unique().tolist() == [3, 7, 11]
    assert positions[:, 15].tolist() == [5, 5, 5]


def test_packed_samples_keep_their_own_positions():
    """Two samples in one THD row, the first padded by 3: each keeps transformers' positions from 0."""
    first, second = (_transformers("qwen3_vl", *_sample(name))[2] for name in ("two images", "a 5-frame video"))
    ours = [_ours("qwen3_vl", *_sample(name))[2] for name in ("two images", "a 5-frame video")]
    packed = pack_positions(ours, [first.shape[1] + 3, second.shape[1]])
    assert torch.equal(packed[:, :first.shape[1]], first)
    assert packed[:, first.shape[1]:first.shape[1] + 3].eq(0).all()
    assert torch.equal(packed[:, first.shape[1] + 3:], second)


def test_placeholders_and_grids_that_disagree_are_one_line():
    with pytest.raises(UserError, match=r"^the text has 2 <\|image_pad\|> but 1 grids were given; put one"):
        expand_placeholders(IMAGE_TOKEN * 2, QWEN2_5_VL, [(1, 4, 4)])
    with pytest.raises(UserError, match="^a run of 3 image tokens does not match its grid \\(4 merged patches\\)"):
        mrope_positions([0, 1, 1, 1, 0], QWEN2_5_VL, [(1, 4, 4)])
