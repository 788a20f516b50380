"""A tiny random Qwen2.5-VL and its inputs, built by `data/native_resolution.py` from images of odd
sizes and a 5-frame video: what the Qwen2.5-VL tests convert and compare."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from PIL import Image

from megatron_ext.data.native_resolution import QWEN2_5_VL, VideoClip, image_inputs, video_inputs
from tests.support import qwen_vl
from tests.support.qwen_vl import (
    BOS,
    EOS,
    IMAGE_TOKEN,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    VOCAB,
    noise,
    text,
    vision_run,
)

# Head size 32: 16 frequency channels in sections T 4, H 6, W 6, so that swapping two shows.
TEXT = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 256, "vocab_size": VOCAB, "bos_token_id": BOS, "eos_token_id": EOS, "head_dim": 32, "initializer_range": 0.2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]}}
# Windows of 2 x 2 merged tokens (56 px) and one full-attention block among three.
VISION = {"depth": 3, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128, "out_hidden_size": 128,
          "fullatt_block_indexes": [1], "window_size": 56, "tokens_per_second": QWEN2_5_VL.tokens_per_second}


def tiny_config(**vision_changes):
    from transformers import Qwen2_5_VLConfig

    # Copies: the config keeps (and a test may change) the dicts it is given.
    return Qwen2_5_VLConfig(text_config=copy.deepcopy(TEXT), vision_config={**copy.deepcopy(VISION), **vision_changes}, image_token_id=IMAGE_TOKEN,
                            video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                            vision_end_token_id=VISION_END, bos_token_id=BOS, eos_token_id=EOS,
                            tie_word_embeddings=False)


def write_tiny_model(out: Path, seed: int = 0, bos: bool = True) -> Path:
    """The tiny model's config, random float32 weights (saved as transformers saves them) and a
    tiny tokenizer (the converters copy it; `bos`: as `tiny_tokenizer`'s)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(tiny_config()).save_pretrained(out)
    qwen_vl.tiny_tokenizer(bos).save_pretrained(out)
    return out


def samples() -> dict[str, dict]:
    """{name: one sample's model inputs}: two images (37x91 and 1000x17, smart-resized) between
    text, and a 5-frame video; each with its ids [1, S], mRoPE positions [3, 1, S] and pixels."""
    images = image_inputs([Image.fromarray(noise(37, 91, 1)), Image.fromarray(noise(1000, 17, 2))], QWEN2_5_VL)
    first, second = images["image_grid_thw"]
    two_images = text(3, 5) + vision_run(IMAGE_TOKEN, first) + text(4, 3) + vision_run(IMAGE_TOKEN, second) + text(5, 6)
    video = video_inputs(VideoClip(noise(37, 91, 7, frames=5), 10.0, (0, 1, 2, 3, 4), 5), QWEN2_5_VL)
    with_video = text(6, 4) + vision_run(VIDEO_TOKEN, video["video_grid_thw"][0]) + text(8, 7)
    return {"two images": qwen_vl.sample(two_images, QWEN2_5_VL, **images),
            "video": qwen_vl.sample(with_video, QWEN2_5_VL, **video)}


def hf_logits(hf_dir: Path, inputs: dict) -> torch.Tensor:
    from transformers import Qwen2_5_VLForConditionalGeneration

    return qwen_vl.hf_logits(Qwen2_5_VLForConditionalGeneration, hf_dir, inputs)


def tiny_processor(hf_dir: Path):
    """transformers' Qwen2.5-VL processor for the tiny model, images only, its image processor at its
    class defaults (`qwen_vl.images_only_processor`)."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return qwen_vl.images_only_processor(Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil(), hf_dir)
