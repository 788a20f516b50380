"""Fixtures for the evaluation tests: images, and transformers' greedy answers to compare with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def images(tmp_path_factory) -> list[Path]:
    """Two PNG images of random noise (different sizes, so the processor resizes both)."""
    from megatron_ext.convert.compare import synthetic_image

    folder = tmp_path_factory.mktemp("eval_images")
    paths = [folder / "noise0.png", folder / "noise1.png"]
    synthetic_image(0).save(paths[0])
    synthetic_image(1, size=(90, 40)).save(paths[1])
    return paths


class HFReference:
    """transformers' own greedy `generate` on the HF checkpoint, fp32 on CPU."""

    def __init__(self, hf_dir: Path):
        from transformers import AutoProcessor, LlavaForConditionalGeneration

        from megatron_ext.eval.prompts import PromptEncoder

        self.model = LlavaForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.processor = AutoProcessor.from_pretrained(hf_dir)
        self.encoder = PromptEncoder(self.processor, self.processor.tokenizer.chat_template)

    def greedy(self, messages: list[dict], images: list, max_new_tokens: int) -> list[int]:
        prompt = self.encoder.encode(messages, images)
        extra = {} if prompt.pixel_values is None else {"pixel_values": prompt.pixel_values}
        with torch.no_grad():
            output = self.model.generate(input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                         max_new_tokens=max_new_tokens, do_sample=False, **extra)
        return output[0, prompt.length:].tolist()

    def text(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode(token_ids, skip_special_tokens=True).strip()


@pytest.fixture(scope="session")
def hf_reference(llava_clip) -> HFReference:
    return HFReference(llava_clip)
