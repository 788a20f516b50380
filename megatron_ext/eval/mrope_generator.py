"""Generation from a native-resolution model (`model/mrope_vlm.py`: Qwen2.5-VL, Qwen3-VL) at any
TP x PP, with the positions transformers' `generate` gives and megatron-core's KV cache.

The prompt's mRoPE positions are the task encoder's (`EncodedPrompt.position_ids`); each generated
token's continue the prompt's last position by one on all three rows (T, H, W), as transformers
extends its position ids while it generates (the prompt ends in text, whose position is the
largest, so this is also its `rope_deltas` rule: the prompt's largest position + 1 + k for the
k-th new token).

Each answer is one prefill over the prompt (media included: the vision tower runs once) into
megatron-core's `StaticInferenceContext`, then one pass per new token over that token alone. The
context keeps keys before RoPE and rotates the queries and the whole cached key sequence at each pass
with angles it slices by position from the table the pass computes (`[offset:]` for the query,
`[:end]` for the keys): a pass's mRoPE table must cover every position so far, so each pass is
given the positions of the whole sequence, not the new token's alone. The passes go through
megatron-core's pipeline schedule, so pipeline stages exchange exactly this step's positions; the
logits come gathered over TP, and the last stage's choice reaches the others as
`MegatronGenerator`'s.
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
        from megatron.core.inference.contexts import StaticInferenceContext

        dtype = self.model.config.params_dtype
        inputs = {name: value.to(self.device, dtype if value.is_floating_point() else value.dtype)
                  for name, value in prompt.media.items()}
        positions = prompt.position_ids.to(self.device)
        inputs.update(input_ids=prompt.input_ids.to(self.device), position_ids=positions)
        context = StaticInferenceContext(max_batch_size=1, max_sequence_length=prompt.length + budget)
        logits = self._logits(inputs, context)

        def after(token: int) -> torch.Tensor | None:
            nonlocal positions
            positions = torch.cat([positions, positions[..., -1:] + 1], dim=2)
            return self._logits({"input_ids": torch.tensor([[token]], device=self.device), "position_ids": positions},
                                context)

        return logits, after

    def _logits(self, inputs: dict, context) -> torch.Tensor | None:
        """Next-token logits [1, vocab] (float32) on the last pipeline stage, None elsewhere; the
        context then holds `inputs`' positions too."""
        logits = mrope_forward(self.model, inputs, context)
        context.sequence_len_offset += inputs["input_ids"].shape[1]
        return None if logits is None else logits[:, -1, : self.arch.text.vocab_size].float()
