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
pipeline stages exchange the whole sequence; the model is built with gathered logits
(`parallel_output=False`), and the last stage's choice reaches the others as `MegatronGenerator`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_ext.eval.megatron_generator import MegatronGenerator
from megatron_ext.eval.prompts import EncodedPrompt

# The prompt's media as `MRopeVisionLanguageModel.forward` takes them (the token types are transformers' only).
_MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


class MRopeGenerator(MegatronGenerator):
    """`model`: this rank's `MRopeVisionLanguageModel`, built with `parallel_output=False`."""

    def _start(self, prompt: EncodedPrompt, budget: int) -> tuple[torch.Tensor | None, Callable]:
        dtype = self.model.config.params_dtype
        media = {name: value.to(self.device, dtype if value.is_floating_point() else value.dtype)
                 for name, value in prompt.media.items() if name in _MEDIA}
        sequence = {"ids": prompt.input_ids.to(self.device), "positions": prompt.position_ids.to(self.device)}

        def after(token: int) -> torch.Tensor | None:
            ids, positions = sequence["ids"], sequence["positions"]
            sequence["ids"] = torch.cat([ids, torch.tensor([[token]], device=self.device)], dim=1)
            sequence["positions"] = torch.cat([positions, positions[..., -1:] + 1], dim=2)
            return self._logits(sequence["ids"], sequence["positions"], media)

        return self._logits(sequence["ids"], sequence["positions"], media), after

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, media: dict) -> torch.Tensor | None:
        """Next-token logits [1, vocab] (float32) on the last pipeline stage, None elsewhere."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, module):
            return module(next(data_iterator), positions, **media), None

        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[self.model], num_microbatches=1,
            seq_length=ids.shape[1], micro_batch_size=1, forward_only=True)
        if not parallel_state.is_pipeline_last_stage():
            return None
        return outputs[0][:, -1, : self.arch.text.vocab_size].float()
