"""Generation from a Hugging Face LLaVA checkpoint (the transformers class of its kind: LLaVA-1.5,
LLaVA-NeXT, OneVision) with transformers' own `generate` (KV cache)."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_ext.eval.generation import Generator
from megatron_ext.eval.prompts import EncodedPrompt, stop_token_ids
from megatron_ext.eval.sampling import SamplingOptions


class HFGenerator(Generator):
    def __init__(self, model, processor):
        self.model = model.eval()
        self.processor = processor
        self.context_length = model.config.text_config.max_position_embeddings
        self.stop_ids = stop_token_ids(processor.tokenizer, model.generation_config)

    @classmethod
    def load(cls, hf_dir: str | Path, processor, dtype: str, flag: str = "--hf-dir") -> "HFGenerator":

        from megatron_ext import families
        from megatron_ext.model.provider import DTYPES

        model = families.load_model(hf_dir, flag, dtype=DTYPES[dtype])
        return cls(model, processor)

    def _new_tokens(self, prompt: EncodedPrompt, options: SamplingOptions, budget: int, streamer) -> list[int]:
        if not options.greedy:
            # transformers samples from the global generator.
            torch.manual_seed(options.seed)
        extra = {name: value.to(self.model.dtype) if value.is_floating_point() else value
                 for name, value in prompt.media.items()}
        with torch.no_grad():
            output = self.model.generate(
                input_ids=prompt.input_ids,
                attention_mask=torch.ones_like(prompt.input_ids),
                max_new_tokens=budget,
                eos_token_id=self.stop_ids,
                pad_token_id=self.processor.tokenizer.pad_token_id,
                streamer=streamer,
                **options.hf_generate_kwargs(),
                **extra,
            )
        return output[0, prompt.length:].tolist()
