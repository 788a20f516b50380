"""transformers' own greedy answers, the reference the generation tests compare ours with."""

from __future__ import annotations

from pathlib import Path

import torch


class HFReference:
    """transformers' own greedy `generate` on the HF checkpoint (its config's class: a LLaVA's, or a
    native-resolution model's), fp32 on CPU. A LLaVA's prompts come from its processor; a
    native-resolution model's from the prompt encoder generation uses (`eval.checkpoints`), the
    positions left to transformers."""

    def __init__(self, hf_dir: Path):
        from megatron_ext import families, hf_loading
        from megatron_ext.eval.checkpoints import open_checkpoint
        from megatron_ext.eval.prompts import PromptEncoder
        from megatron_ext.hf.processors import load_processor
        from megatron_ext.model.arch import LlavaArch

        self.model = families.load_model(hf_dir, "--hf-dir", dtype=torch.float32).eval()
        if not isinstance(families.read_model(hf_loading.load_config(str(hf_dir), "--hf-dir")), LlavaArch):
            self.encoder = open_checkpoint(None, str(hf_dir), dtype="float32").encoder
            self.tokenizer = self.encoder.tokenizer
            return
        processor = load_processor(hf_dir, "--hf-dir")
        self.encoder = PromptEncoder(processor, processor.tokenizer.chat_template)
        self.tokenizer = processor.tokenizer

    def greedy(self, messages: list[dict], images: list, max_new_tokens: int, videos: list = ()) -> list[int]:
        """`videos`: what `self.encoder.load_video` gives of each."""
        from megatron_ext.eval.prompts import stop_token_ids

        prompt = self.encoder.encode(messages, images, videos)
        # Stopping where our generators stop: the tokenizer's end token too, not only the model config's.
        stop = stop_token_ids(self.tokenizer, self.model.generation_config)
        with torch.no_grad():
            output = self.model.generate(input_ids=prompt.input_ids, attention_mask=torch.ones_like(prompt.input_ids),
                                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop,
                                         **prompt.media)
        return output[0, prompt.length:].tolist()

    def text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True).strip()
