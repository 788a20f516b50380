"""What the Qwen-VL test models share: random pixels and text, media runs of placeholder tokens,
a sample's model inputs built by `data/native_resolution.py`, and transformers' logits on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megatron_ext.data.native_resolution import QwenVision, mrope_positions, token_types

VOCAB = 512
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END, BOS, EOS = 500, 501, 502, 503, 504, 505


def noise(height: int, width: int, seed: int, frames: int | None = None) -> np.ndarray:
    shape = (height, width, 3) if frames is None else (frames, height, width, 3)
    return np.random.RandomState(seed).randint(0, 256, shape, dtype=np.uint8)


def text(seed: int, n: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, IMAGE_TOKEN, n).tolist()


def vision_run(token: int, grid, merge_size: int = 2) -> list[int]:
    t, h, w = (int(v) for v in grid)
    return [VISION_START] + [token] * (t * h * w // merge_size ** 2) + [VISION_END]


def tiny_tokenizer(bos: bool = True):
    """The demo's tiny tokenizer with the Qwen-VL special tokens at the tiny model's ids (fillers
    up to IMAGE_TOKEN), ChatML's turn tokens and a pad token; no template of its own, so training
    takes the family's ChatML. It adds the demo's BOS to every text (as Llama's); `bos` False: none,
    as Qwen's own tokenizer."""
    from tokenizers import processors

    from megatron_ext.demo.tiny_models import train_tokenizer

    tokenizer = train_tokenizer(400)
    if not bos:
        tokenizer._tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_tokens([f"<filler{i}>" for i in range(IMAGE_TOKEN - len(tokenizer))])
    tokenizer.add_tokens(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>",
                          "<|im_end|>", "<|endoftext|>"], special_tokens=True)
    tokenizer.pad_token = "<|endoftext|>"
    tokenizer.chat_template = None
    return tokenizer


def sample(ids: list[int], vision: QwenVision, **media) -> dict:
    """One sample's model inputs: ids [1, S], mRoPE positions [3, 1, S], token types and `media`."""
    types = token_types(ids, IMAGE_TOKEN, VIDEO_TOKEN)
    positions = mrope_positions(types, vision, media.get("image_grid_thw", ()), media.get("video_grid_thw", ()),
                                media.get("second_per_grid_ts"))
    return {"input_ids": torch.tensor([ids]), "position_ids": positions[:, None, :],
            "mm_token_type_ids": torch.from_numpy(types)[None].int(), **media}


def hf_logits(model_class, hf_dir: Path, inputs: dict) -> torch.Tensor:
    """transformers' float32 logits [1, S, vocab] of a sample (its own mRoPE positions)."""
    model = model_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(**{k: v for k, v in inputs.items() if k != "position_ids"}).logits.float()



# ChatML as the Qwen-VL processors render a message of parts: an image part is its vision run, right
# before the text that follows; what TRL's collator renders a conversational vision pair with.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}{%- else -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


def images_only_processor(processor_class, image_processor, hf_dir: Path):
    """transformers' `processor_class` (Qwen2.5-VL's or Qwen3-VL's) for the tiny model at `hf_dir`,
    images only: their video processors need torchvision, which does not import beside this CPU
    torch. Images go through `image_processor` (transformers' PIL one)."""
    from transformers import AutoTokenizer, ProcessorMixin

    class ImagesOnly(processor_class):
        @classmethod
        def get_attributes(cls):
            return [name for name in super().get_attributes() if name != "video_processor"]

        def __init__(self, image_processor, tokenizer, chat_template):
            # The token fields both processors set, without their video processor.
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id, self.video_token_id = IMAGE_TOKEN, VIDEO_TOKEN
            self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
            self.vision_start_token_id, self.vision_end_token_id = VISION_START, VISION_END
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImagesOnly(image_processor, AutoTokenizer.from_pretrained(hf_dir), CHAT_TEMPLATE)
