"""Generation from a native-resolution model (`model/mrope_vlm.py`: Qwen2.5-VL, Qwen3-VL) at any
TP x PP, with the positions transformers' `generate` gives.

The prompt's mRoPE positions are the task encoder's (`EncodedPrompt.position_ids`); each generated
token's continue the prompt's last position by one on all three rows (T, H, W), as transformers
extends its position ids while it generates (the prompt ends in text, whose position is the
largest, so this is also its `rope_deltas` rule: the prompt's largest position + 1 + k for the
k-th new token).

Every step is one forward pass over the prompt and the tokens so far, with no KV cache:
megatron-core's static inference context would slice mRoPE angles computed for the new token alone
as if they covered the whole sequence. The pass goes through megatron-core's pipeline schedule, so
pipeline stages exchange the whole sequence; the logits come gathered over TP, and the last
stage's choice reaches the others as `MegatronGenerator`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_ext.convert.compare import mrope_forward
from megatron_ext.eval.megatron_generator import MegatronGenerator
from megatron_ext.eval.prompts import EncodedPrompt


class MRopeGenerator(MegatronGenerator):
    """`model`: this rank's `MRopeVisionLanguageModel` (unwrapped), built with any `parallel_output`."""

    def _start(self, prompt: EncodedPrompt, budget: int) -> tuple[torch.Tensor | None, Callable]:
        dtype = self.model.config.params_dtype
        inputs = {name: value.to(self.device, dtype if value.is_floating_point() else value.dtype)
                  for name, value in prompt.media.items()}
        inputs.update(input_ids=prompt.input_ids.to(self.device), position_ids=prompt.position_ids.to(self.device))

        def after(token: int) -> torch.Tensor | None:
            ids, positions = inputs["input_ids"], inputs["position_ids"]
            inputs["input_ids"] = torch.cat([ids, torch.tensor([[token]], device=self.device)], dim=1)
            inputs["position_ids"] = torch.cat([positions, positions[..., -1:] + 1], dim=2)
            return self._logits(inputs)

        return self._logits(inputs), after

    def _logits(self, inputs: dict) -> torch.Tensor | None:
        """Next-token logits [1, vocab] (float32) on the last pipeline stage, None elsewhere."""
        logits = mrope_forward(self.model, inputs)
        return None if logits is None else logits[:, -1, : self.arch.text.vocab_size].float()
