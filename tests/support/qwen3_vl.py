"""A tiny random Qwen3-VL and its inputs, built by `data/native_resolution.py` from images of odd
sizes and a 5-frame video (each frame pair a grid of its own, its time as text): what the Qwen3-VL
tests convert and compare."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from PIL import Image

from megatron_ext.data.native_resolution import QWEN3_VL, VideoClip, image_inputs, video_inputs
from tests.support import qwen_vl
from tests.support.qwen_vl import BOS, EOS, IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB, noise, text

# Head size 32: 16 frequency channels; interleaved sections [4, 6, 6] put T on 0, 3, ..., 15, H on
# 1, 4, ..., 13 and W on 2, 5, ..., 14, where chunked ones would give T 0-3, H 4-9, W 10-15.
TEXT = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 256, "vocab_size": VOCAB, "bos_token_id": BOS, "eos_token_id": EOS, "head_dim": 32,
        "initializer_range": 0.2, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}}
# DeepStack features from blocks 0 and 1 of three, added after decoder layers 0 and 1; an 8 x 8
# learned position grid resampled to each image's.
VISION = {"depth": 3, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128, "out_hidden_size": 128,
          "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 64, "initializer_range": 0.2}


def tiny_config(**text_changes):
    from transformers import Qwen3VLConfig

    # Copies: the config keeps (and a test may change) the dicts it is given.
    return Qwen3VLConfig(text_config={**copy.deepcopy(TEXT), **text_changes}, vision_config=copy.deepcopy(VISION),
                         image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                         vision_end_token_id=VISION_END, tie_word_embeddings=False)


def write_tiny_model(out: Path, seed: int = 0, bos: bool = True) -> Path:
    """The tiny model's config, random float32 weights (saved as transformers saves them) and a
    tiny tokenizer (the converters copy it; `bos`: as `tiny_tokenizer`'s)."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(tiny_config()).save_pretrained(out)
    qwen_vl.tiny_tokenizer(bos).save_pretrained(out)
    return out


def _video_runs(grid, seconds: list[float]) -> list[int]:
    """Each frame pair's tokens: its time as text (random tokens standing in for `<t seconds>`),
    vision start, its merged patches' video tokens, vision end."""
    _, h, w = (int(v) for v in grid)
    tokens = []
    for i, _ in enumerate(seconds):
        tokens += text(20 + i, 3) + [VISION_START] + [VIDEO_TOKEN] * (h * w // QWEN3_VL.merge_size ** 2) + [VISION_END]
    return tokens


def samples() -> dict[str, dict]:
    """{name: one sample's model inputs}: two images (37x91 and 1000x17, smart-resized) between
    text, a 5-frame video, and an image before a video (transformers merges their DeepStack
    features under one mask); each with its ids [1, S], mRoPE positions [3, 1, S] and pixels."""
    images = image_inputs([Image.fromarray(noise(37, 91, 1)), Image.fromarray(noise(1000, 17, 2))], QWEN3_VL)
    first, second = images["image_grid_thw"]
    run = lambda grid: qwen_vl.vision_run(IMAGE_TOKEN, grid)  # noqa: E731
    two_images = text(3, 5) + run(first) + text(4, 3) + run(second) + text(5, 6)
    clip = VideoClip(noise(37, 91, 7, frames=5), 10.0, (0, 1, 2, 3, 4), 5)
    video = video_inputs(clip, QWEN3_VL)
    with_video = text(6, 4) + _video_runs(video["video_grid_thw"][0], clip.frame_pair_seconds(2)) + text(8, 7)
    image = image_inputs([Image.fromarray(noise(91, 37, 9))], QWEN3_VL)
    both = text(10, 2) + run(image["image_grid_thw"][0]) + with_video
    return {"two images": qwen_vl.sample(two_images, QWEN3_VL, **images),
            "video": qwen_vl.sample(with_video, QWEN3_VL, **video),
            "image and video": qwen_vl.sample(both, QWEN3_VL, **image, **video)}


def hf_logits(hf_dir: Path, inputs: dict) -> torch.Tensor:
    from transformers import Qwen3VLForConditionalGeneration

    return qwen_vl.hf_logits(Qwen3VLForConditionalGeneration, hf_dir, inputs)


def tiny_processor(hf_dir: Path):
    """transformers' Qwen3-VL processor for the tiny model, images only (`qwen_vl.images_only_processor`),
    its image processor as Qwen3-VL's published preprocessor config sets it (patches of 16, mean and
    std 0.5), its pixel bounds the class defaults, as `QWEN3_VL`'s."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return qwen_vl.images_only_processor(Qwen3VLProcessor, image_processor, hf_dir)
