"""A tiny random Qwen2.5-VL and its inputs, built by `data/native_resolution.py` from images of odd
sizes and a 5-frame video: what the Qwen2.5-VL tests convert and compare."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from megatron_ext.data.native_resolution import (
    QWEN2_5_VL,
    VideoClip,
    image_inputs,
    mrope_positions,
    token_types,
    video_inputs,
)

VOCAB = 512
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END, BOS, EOS = 500, 501, 502, 503, 504, 505
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


def write_tiny_model(out: Path, seed: int = 0) -> Path:
    """The tiny model's config, random float32 weights (saved as transformers saves them) and a
    tiny tokenizer (the converters copy it)."""
    from transformers import Qwen2_5_VLForConditionalGeneration


    torch.manual_seed(seed)
    Qwen2_5_VLForConditionalGeneration(tiny_config()).save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)
    return out


def tiny_tokenizer():
    """The demo's tiny tokenizer with Qwen2.5-VL's special tokens at the tiny model's ids (fillers
    up to IMAGE_TOKEN), ChatML's turn tokens and a pad token; no template of its own, so training
    takes the family's ChatML."""
    from megatron_ext.demo.tiny_models import train_tokenizer

    tokenizer = train_tokenizer(400)
    tokenizer.add_tokens([f"<filler{i}>" for i in range(IMAGE_TOKEN - len(tokenizer))])
    tokenizer.add_tokens(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>",
                          "<|im_end|>", "<|endoftext|>"], special_tokens=True)
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = None
    return tokenizer


def _noise(height: int, width: int, seed: int, frames: int | None = None) -> np.ndarray:
    shape = (height, width, 3) if frames is None else (frames, height, width, 3)
    return np.random.RandomState(seed).randint(0, 256, shape, dtype=np.uint8)


def _text(seed: int, n: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, IMAGE_TOKEN, n).tolist()


def _vision_run(token: int, grid) -> list[int]:
    t, h, w = (int(v) for v in grid)
    return [VISION_START] + [token] * (t * h * w // QWEN2_5_VL.merge_size ** 2) + [VISION_END]


def samples() -> dict[str, dict]:
    """{name: one sample's model inputs}: two images (37x91 and 1000x17, smart-resized) between
    text, and a 5-frame video; each with its ids [1, S], mRoPE positions [3, 1, S] and pixels."""
    images = image_inputs([Image.fromarray(_noise(37, 91, 1)), Image.fromarray(_noise(1000, 17, 2))], QWEN2_5_VL)
    first, second = images["image_grid_thw"]
    two_images = _text(3, 5) + _vision_run(IMAGE_TOKEN, first) + _text(4, 3) + _vision_run(IMAGE_TOKEN, second) + _text(5, 6)
    video = video_inputs(VideoClip(_noise(37, 91, 7, frames=5), 10.0, (0, 1, 2, 3, 4), 5), QWEN2_5_VL)
    with_video = _text(6, 4) + _vision_run(VIDEO_TOKEN, video["video_grid_thw"][0]) + _text(8, 7)
    return {"two images": _sample(two_images, **images), "video": _sample(with_video, **video)}


def _sample(ids: list[int], **media) -> dict:
    types = token_types(ids, IMAGE_TOKEN, VIDEO_TOKEN)
    positions = mrope_positions(types, QWEN2_5_VL, media.get("image_grid_thw", ()), media.get("video_grid_thw", ()),
                                media.get("second_per_grid_ts"))
    return {"input_ids": torch.tensor([ids]), "position_ids": positions[:, None, :],
            "mm_token_type_ids": torch.from_numpy(types)[None].int(), **media}


def hf_logits(hf_dir: Path, sample: dict) -> torch.Tensor:
    """transformers' float32 logits [1, S, vocab] of a sample (its own mRoPE positions)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    inputs = {k: v for k, v in sample.items() if k != "position_ids"}
    with torch.no_grad():
        return model(**inputs).logits.float()
