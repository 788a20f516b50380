"""transformers' own greedy answers, the reference the generation tests compare ours with."""

from __future__ import annotations

from pathlib import Path

import torch


class HFReference:
    """transformers' own greedy `generate` on the HF checkpoint (its config's LLaVA class), fp32 on CPU."""

    def __init__(self, hf_dir: Path):
        import json

        import transformers

        from megatron_ext.eval.prompts import PromptEncoder
        from megatron_ext.families import llava_kind
        from megatron_ext.hf.processors import load_processor

        model_class = getattr(transformers, llava_kind(json.loads((Path(hf_dir) / "config.json").read_text())).model_class)
        self.model = model_class.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.processor = load_processor(hf_dir, "--hf-dir")
        self.encoder = PromptEncoder(self.processor, self.processor.tokenizer.chat_template)

    def greedy(self, messages: list[dict], images: list, max_new_tokens: int, videos: list = ()) -> list[int]:
        """`videos`: uint8 frames [n, H, W, 3] each."""
        prompt = self.encoder.encode(messages, images, videos)
        with torch.no_grad():
            output = self.model.generate(input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                         max_new_tokens=max_new_tokens, do_sample=False, **prompt.media)
        return output[0, prompt.length:].tolist()

    def text(self, token_ids: list[int]) -> str:
        return self.processor.tokenizer.decode(token_ids, skip_special_tokens=True).strip()
