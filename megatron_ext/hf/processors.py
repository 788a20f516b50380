"""The HF processor of a LLaVA architecture (`families.llava_kinds()`), built, saved and loaded
where transformers cannot build all of it.

transformers builds video processors only with torchvision; without it a OneVision processor is
made (and loaded) without one, under its own class name, so that it takes images and text, and its
video processor's settings are written beside it as the full class writes them: a machine with
torchvision loads the saved directory as the full class. A loaded processor preprocesses as
training does, with or without torchvision: images with transformers' PIL backend, videos with
`FrameProcessor` (the saved video processor's settings, `data.video.VideoPreprocessor`).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from megatron_ext import hf_loading
from megatron_ext.fsutil import atomic_write_text

# A video processor's settings taken from the image processor: OneVision's published checkpoints
# resize, rescale and normalize frames as their image processors do the base tile.
_VIDEO_FIELDS = ("size", "do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize",
                 "image_mean", "image_std")


def _torchvision_available() -> bool:
    from importlib.util import find_spec

    return find_spec("torchvision") is not None


@cache
def processor_class(kind):
    """The transformers processor class of `kind` (a `families.llava.LlavaKind`), without its video
    processor where torchvision is missing."""
    import transformers

    full = getattr(transformers, kind.processor_class)
    if not kind.video or _torchvision_available():
        return full

    class ImagesOnly(full):
        @classmethod
        def get_attributes(cls):
            # The parts transformers builds, saves and loads.
            return [name for name in super().get_attributes() if name != "video_processor"]

    # Saved under the name a machine with torchvision loads.
    ImagesOnly.__name__ = ImagesOnly.__qualname__ = full.__name__
    return ImagesOnly


def video_processor(kind, image_processor):
    """`kind`'s video processor with `image_processor`'s frame settings."""
    settings = image_processor.to_dict()
    return kind.video_processor_type()(**{key: settings[key] for key in _VIDEO_FIELDS if settings.get(key) is not None})


def build_processor(kind, image_processor, tokenizer, **fields):
    """`kind`'s processor of these parts, with its video processor where torchvision is installed."""
    if kind.video and _torchvision_available():
        fields["video_processor"] = video_processor(kind, image_processor)
    return processor_class(kind)(image_processor=image_processor, tokenizer=tokenizer, **fields)


def save_processor(processor, kind, directory: str | Path) -> None:
    """`processor.save_pretrained(directory)`; without torchvision, with the video processor
    written as the full class writes it."""
    processor.save_pretrained(directory)
    if kind.video and not hasattr(processor, "video_processor"):
        path = Path(directory) / "processor_config.json"
        config = json.loads(path.read_text())
        config["video_processor"] = json.loads(video_processor(kind, processor.image_processor).to_json_string())
        atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_processor(hf_dir: str | Path, flag: str, kind=None):
    """The processor in `hf_dir`, as `processor_class` builds it for `kind` (default: the kind of
    the HF LLaVA there; a Megatron checkpoint's tokenizer/ directory has no config to say it)."""
    # data.video imports torch, which the convert commands must start without (tests/convert/test_cli.py).
    from megatron_ext.data.video import load_frame_settings
    from megatron_ext.families import llava_kind

    kind = kind or llava_kind(hf_loading.load_config(str(hf_dir), flag))
    processor = hf_loading.load_with(processor_class(kind).from_pretrained, "processor", str(hf_dir), flag)
    if _torchvision_available():  # images as training preprocesses them (`hf_loading.load_image_processor`)
        processor.image_processor = hf_loading.load_image_processor(str(hf_dir), flag)
    if kind.video:
        processor.video_processor = FrameProcessor(load_frame_settings(hf_dir, flag, processor.image_processor))
    return processor


class FrameProcessor:
    """A processor's video processor that preprocesses frames as training does (bit for bit what
    transformers' gives, without torchvision): uint8 frames [n, H, W, 3] per video."""

    def __init__(self, settings):
        from megatron_ext.data.video import VideoPreprocessor

        self.preprocess = VideoPreprocessor(settings)

    def __call__(self, videos, **unused) -> dict:
        return {"pixel_values_videos": [self.preprocess(frames) for frames in videos]}
