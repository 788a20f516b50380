"""--min-pixels / --max-pixels of a native-resolution run (Qwen2.5-VL, Qwen3-VL): the trainer's task
encoder resizes images within them exactly as transformers' processor does given the same
min_pixels / max_pixels, and bounds below one merged token, or crossed, are refused in one line."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from PIL import Image

from megatron_ext import families
from megatron_ext.config.options import TrainConfig
from megatron_ext.errors import UserError
from tests.support.qwen_vl import noise, tiny_tokenizer

# 1000x17 is raised to --min-pixels, 370x910 lowered to --max-pixels: both sizes differ from the
# family's default bounds' (which keep 1000x17 near its own area and 370x910 whole).
MIN_PIXELS, MAX_PIXELS = 40_000, 90_000
IMAGES = [Image.fromarray(noise(17, 1000, 3)), Image.fromarray(noise(910, 370, 4))]


@pytest.fixture(scope="module", params=("qwen2_5_vl", "qwen3_vl"))
def tiny(request, tmp_path_factory):
    """(the family's tests.support module, a directory with its tiny config and tokenizer)."""
    support = importlib.import_module(f"tests.support.{request.param}")
    out = tmp_path_factory.mktemp(f"{request.param}_tokenizer")
    support.tiny_config().save_pretrained(out)
    tiny_tokenizer(bos=False).save_pretrained(out)
    return support, out


def _arch(hf_dir):
    return families.read_model(json.loads((hf_dir / "config.json").read_text()))


def _training_media(hf_dir, config: TrainConfig) -> dict:
    """The images' pixel rows and grids as the trainer's task encoder makes them under `config`."""
    from megatron_ext.model.sequence_alignment import SequenceAlignment
    from megatron_ext.train.batches import task_encoder

    encoder = task_encoder(hf_dir, _arch(hf_dir), config, 2048, SequenceAlignment())
    return encoder.encode_prompt([{"role": "user", "content": "<image><image>Which is taller?"}], IMAGES, [])


def test_max_and_min_pixels_resize_training_images_as_transformers_processor_given_them(tiny):
    support, hf_dir = tiny
    ours = _training_media(hf_dir, TrainConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))
    theirs = support.tiny_processor(hf_dir).image_processor(images=IMAGES, min_pixels=MIN_PIXELS,
                                                              max_pixels=MAX_PIXELS, return_tensors="pt")
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    # The flags change both images' grids (their defaults' are others).
    default = _training_media(hf_dir, TrainConfig())["image_grid_thw"]
    assert (ours["image_grid_thw"] != default).any(dim=1).all(), (ours["image_grid_thw"], default)


@pytest.mark.parametrize("options, message", [
    ({"max_pixels": 500}, "--max-pixels 500 is below {name}'s patch x merge area {area} ({side} x {side} pixels, "
                          "one merged token); give at least {area}"),
    ({"min_pixels": 20}, "--min-pixels 20 is below {name}'s patch x merge area {area}"),
    ({"max_pixels": 0}, "--max-pixels 0 is below {name}'s patch x merge area {area}"),
    ({"min_pixels": 90_000, "max_pixels": 40_000}, "--min-pixels 90000 is above --max-pixels 40000"),
    ({"min_pixels": 2_000_000}, "--min-pixels 2000000 is above --max-pixels 1003520 (where one is not given: the "
                                "checkpoint's processor's, else {name}'s default)"),
])
def test_pixel_bounds_below_one_merged_token_or_crossed_are_refused_in_one_line(tiny, options, message):
    from megatron_ext.data.native_resolution_encoder import vision_of

    arch = _arch(tiny[1])
    side = arch.vision_config["patch_size"] * arch.vision_config["spatial_merge_size"]
    with pytest.raises(UserError) as refused:
        vision_of(arch, tiny[1], **options)
    assert message.format(name=arch.name, area=side**2, side=side) in str(refused.value)
    assert "\n" not in str(refused.value)


def _with_saved_processor(hf_dir, out, saved: dict):
    """A copy of `hf_dir` whose preprocessor_config.json is `saved` over the family's processor."""
    import shutil

    shutil.copytree(hf_dir, out)
    vision = _arch(hf_dir).vision_config
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": vision["patch_size"], "merge_size": 2,
        "temporal_patch_size": 2, **saved}))
    return out


# A published Qwen2.5-VL's file names its bounds min_pixels / max_pixels; transformers 5 saves them
# as size's shortest / longest edge; both are read.
@pytest.mark.parametrize("saved", [{"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS},
                                   {"size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}}],
                         ids=["published-keys", "size"])
def test_a_checkpoints_saved_processor_resizes_and_normalizes_as_transformers_loads_it(tiny, tmp_path, saved):
    from transformers import Qwen2VLImageProcessorPil

    support, hf_dir = tiny
    mean, std = [0.25, 0.5, 0.75], [0.2, 0.3, 0.4]
    checkpoint = _with_saved_processor(hf_dir, tmp_path / "ckpt", {**saved, "image_mean": mean, "image_std": std})
    ours = _training_media(checkpoint, TrainConfig())
    theirs = Qwen2VLImageProcessorPil.from_pretrained(checkpoint)(images=IMAGES, return_tensors="pt")
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
    assert (ours["image_grid_thw"] != _training_media(hf_dir, TrainConfig())["image_grid_thw"]).any(dim=1).all()
    # Videos take the bounds transformers' video processor takes from the same file (it has no video file).
    vision = _training_encoder_vision(checkpoint, TrainConfig())
    assert (vision.video_min_pixels, vision.video_max_pixels) == (MIN_PIXELS, MAX_PIXELS)
    # The run's flags bound over the saved processor's.
    assert _training_encoder_vision(checkpoint, TrainConfig(max_pixels=60_000)).max_pixels == 60_000


def _training_encoder_vision(hf_dir, config: TrainConfig):
    from megatron_ext.model.sequence_alignment import SequenceAlignment
    from megatron_ext.train.batches import task_encoder

    return task_encoder(hf_dir, _arch(hf_dir), config, 2048, SequenceAlignment()).vision


def test_a_saved_processor_file_that_is_not_json_is_one_line_naming_it(tiny, tmp_path):
    _, hf_dir = tiny
    checkpoint = _with_saved_processor(hf_dir, tmp_path / "ckpt", {})
    (checkpoint / "preprocessor_config.json").write_text('{"min_pixels": 40000,')
    with pytest.raises(UserError) as refused:
        _training_encoder_vision(checkpoint, TrainConfig())
    message = str(refused.value)
    assert message.startswith(f"{checkpoint / 'preprocessor_config.json'} is not valid JSON (") and "\n" not in message


def _nested_processor(hf_dir, out):
    """A copy of `hf_dir` with one processor_config.json as transformers 5 saves it: the image and the
    video processor nested in it, the family's class bounds in each."""
    import shutil

    shutil.copytree(hf_dir, out)
    vision = _arch(hf_dir).vision_config
    common = {"patch_size": vision["patch_size"], "merge_size": 2, "temporal_patch_size": 2,
              "size": {"shortest_edge": 3136, "longest_edge": 1003520}}
    (out / "processor_config.json").write_text(json.dumps({
        "image_processor": {"image_processor_type": "Qwen2VLImageProcessor", **common},
        "video_processor": {"video_processor_type": "Qwen2VLVideoProcessor", **common}}))
    return out


@pytest.mark.parametrize("saved", ["no-processor-files", "published-image-file", "nested-processor-file"])
def test_an_hf_export_of_a_bounded_run_resizes_images_and_videos_as_the_run_did(tiny, tmp_path, saved):
    """The export's processor files, as transformers and our encoder read them, hold the run's bounds."""
    import shutil

    from transformers import Qwen2VLImageProcessorPil

    from megatron_ext.data.native_resolution import save_pixel_bounds
    from megatron_ext.data.native_resolution_encoder import vision_of

    _, hf_dir = tiny
    checkpoint = {"no-processor-files": lambda out: shutil.copytree(hf_dir, out) and out,
                  "published-image-file": lambda out: _with_saved_processor(hf_dir, out, {"max_pixels": 12_845_056}),
                  "nested-processor-file": lambda out: _nested_processor(hf_dir, out)}[saved](tmp_path / "ckpt")
    trained = vision_of(_arch(hf_dir), checkpoint, MIN_PIXELS, MAX_PIXELS)
    export = shutil.copytree(checkpoint, tmp_path / "export")
    save_pixel_bounds(trained, export)
    assert vision_of(_arch(hf_dir), export) == trained
    theirs = Qwen2VLImageProcessorPil.from_pretrained(export)(images=IMAGES, return_tensors="pt")
    ours = _training_media(checkpoint, TrainConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS))
    assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
    assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
