"""The HF processor of a LLaVA architecture (`families.llava_kinds()`), built and loaded where
transformers cannot build all of it.

transformers builds video processors only with torchvision; without it a OneVision processor is
made (and loaded) without one, under its own class name, so that it takes images and text, and a
machine with torchvision loads the saved directory as the full class.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from megatron_ext import hf_loading


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


def load_processor(hf_dir: str | Path, flag: str, kind=None):
    """The processor in `hf_dir`, as `processor_class` builds it for `kind` (default: the kind of
    the HF LLaVA there; a Megatron checkpoint's tokenizer/ directory has no config to say it)."""
    from megatron_ext.families import llava_kind

    kind = kind or llava_kind(hf_loading.load_config(str(hf_dir), flag))
    return hf_loading.load_with(processor_class(kind).from_pretrained, "processor", str(hf_dir), flag)
