"""transformers' LLaVA-NeXT and OneVision processors built from PIL-backend image processors and the
tiny test tokenizer: what the anyres and video tests compare with."""

from __future__ import annotations

import functools

from transformers import BatchFeature, LlavaNextProcessor, LlavaOnevisionProcessor
from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

from megatron_ext.data.video import VideoPreprocessor


@functools.cache
def tokenizer():
    from megatron_ext.demo.tiny_models import train_tokenizer

    tok = train_tokenizer(1000)
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]}, replace_extra_special_tokens=False)
    return tok


def count(input_ids, token: str) -> int:
    return int((input_ids == tokenizer().convert_tokens_to_ids(token)).sum())


def llava_next(image_processor) -> LlavaNextProcessor:
    """As llava-hf/llava-v1.6 checkpoints configure it: CLIP patch 14, its class token dropped."""
    return LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer(), patch_size=14,
                              vision_feature_select_strategy="default", num_additional_image_tokens=1)


class FrameVideoProcessor(LlavaOnevisionVideoProcessor):
    """OneVision's video processor with its torchvision steps replaced by VideoPreprocessor's (the
    same values: tests/data/test_video.py), which run without torchvision."""

    def preprocess(self, videos, **kwargs):
        import torch

        return BatchFeature({"pixel_values_videos": torch.stack([VideoPreprocessor(self)(v) for v in videos])})


class _OnevisionProcessor(LlavaOnevisionProcessor):
    def check_argument_for_proper_class(self, argument_name, argument):
        # transformers looks the video processor's base class up among torchvision-backed classes,
        # absent without torchvision; the image processor and tokenizer are still checked.
        if argument_name != "video_processor":
            return super().check_argument_for_proper_class(argument_name, argument)
        return type(argument)


def onevision(image_processor, num_image_tokens: int) -> LlavaOnevisionProcessor:
    """As llava-hf/llava-onevision checkpoints configure it: every SigLIP feature kept, anyres_max_9."""
    side = image_processor.size.height
    return _OnevisionProcessor(image_processor=image_processor, tokenizer=tokenizer(),
                               video_processor=FrameVideoProcessor(size={"height": side, "width": side}),
                               num_image_tokens=num_image_tokens, vision_feature_select_strategy="full",
                               vision_aspect_ratio="anyres_max_9")


def with_video(processor, hf_dir) -> LlavaOnevisionProcessor:
    """A loaded OneVision processor with the video processor `hf_dir` saves (found and built by
    transformers, its torchvision steps VideoPreprocessor's)."""
    return _OnevisionProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                               video_processor=FrameVideoProcessor.from_pretrained(hf_dir),
                               num_image_tokens=processor.num_image_tokens,
                               vision_feature_select_strategy=processor.vision_feature_select_strategy,
                               vision_aspect_ratio=processor.vision_aspect_ratio)
