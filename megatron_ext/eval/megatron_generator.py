"""Generation from megatron-core's LLaVAModel at any TP x PP, with megatron-core's KV cache.

Each answer is one prefill over the whole prompt (image embeddings included) and then one forward
pass per new token over that token alone. The keys and values of earlier positions live in
megatron-core's `StaticInferenceContext` (batch 1: megatron-core 0.16's LLaVAModel supports only
one sequence per KV-cached pass). Both passes go through megatron-core's pipeline schedule, so
pipeline stages exchange exactly the positions of this step; after the prefill every rank records
the image embeddings in the context, as megatron-core's VLM inference wrapper does, so later passes
skip the vision tower on every stage. The prompt's media reach the model as compare's
`megatron_media` gives them (a tiled model's tiles with their media layout).

Collective: every rank of the model-parallel group calls `generate` with the same prompt. Full
vocabulary logits (padded rows dropped) exist on the last pipeline stage, which picks the token and
broadcasts it to the other stages; TP peers hold identical logits and an identically seeded
sampler, so they agree without communicating.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_ext.convert.compare import megatron_media, model_input_ids
from megatron_ext.eval.generation import Generator
from megatron_ext.eval.prompts import EncodedPrompt
from megatron_ext.eval.sampling import SamplingOptions, TokenChooser

# LLaVAModel's KV-cache flag: once present in the context, forward passes skip the vision tower.
_IMAGE_TOKENS_KEY = "image_tokens_count"


class MegatronGenerator(Generator):
    """`model`: this rank's LLaVAModel (unwrapped; fp32 or bf16), built with any `parallel_output`."""

    def __init__(self, model, arch, processor, stop_ids: list[int]):
        import torch.distributed as dist

        from megatron_ext.distributed import device

        self.model = model
        self.arch = arch
        self.processor = processor
        self.stop_ids = stop_ids
        self.context_length = model.language_model.max_sequence_length
        self.device = device()
        self.is_output_rank = not dist.is_initialized() or dist.get_rank() == 0

    def _new_tokens(self, prompt: EncodedPrompt, options: SamplingOptions, budget: int, streamer) -> list[int]:
        chooser = TokenChooser(options)
        seen = prompt.input_ids
        if streamer is not None and self.is_output_rank:
            streamer.put(seen)
        new = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logits, after = self._start(prompt, budget)
                while True:
                    token = self._choose(chooser, seen, logits)
                    new.append(token)
                    seen = torch.cat([seen, torch.tensor([[token]])], dim=1)
                    if streamer is not None and self.is_output_rank:
                        streamer.put(torch.tensor([token]))
                    if token in self.stop_ids or len(new) == budget:
                        break
                    logits = after(token)
        finally:
            self.model.train(was_training)
            if streamer is not None and self.is_output_rank:
                streamer.end()
        return new

    def _start(self, prompt: EncodedPrompt, budget: int) -> tuple[torch.Tensor | None, Callable]:
        """The prompt's next-token logits (`_forward`'s) and a function of each chosen token giving the
        logits after it: one prefill into the KV cache, then one pass per token."""
        from megatron.core.inference.contexts import StaticInferenceContext

        ids = model_input_ids(prompt.input_ids, self.arch.image_token_index, self.arch.img_seq_len).to(self.device)
        images, layout = megatron_media(self.arch, {"input_ids": prompt.input_ids, **prompt.media})
        images = images.to(self.device, self.model.config.params_dtype)
        # The layout is read on the host (tiling.Media rows): it stays there.
        media = {} if layout is None else {"media_layout": layout}
        context = StaticInferenceContext(max_batch_size=1, max_sequence_length=prompt.length + budget)
        logits = self._forward(images, ids, context, prompt.length, media)
        if images.shape[0]:
            context.key_value_memory_dict[_IMAGE_TOKENS_KEY] = self._embedding_positions(prompt)
        context.sequence_len_offset += prompt.length

        def after(token: int) -> torch.Tensor | None:
            next_logits = self._forward(images[:0], torch.tensor([[token]], device=self.device), context, 1, {})
            context.sequence_len_offset += 1
            return next_logits

        return logits, after

    def _embedding_positions(self, prompt: EncodedPrompt) -> int:
        """Positions of the prompt that image and video embeddings take (one per token, HF layout)."""
        tiling = self.arch.tiling
        tokens = [self.arch.image_token_index] + ([tiling.video_token_index] if tiling and tiling.video_token_index is not None else [])
        return int(torch.isin(prompt.input_ids, torch.tensor(tokens)).sum())

    def _forward(self, images: torch.Tensor, ids: torch.Tensor, context, length: int, media: dict) -> torch.Tensor | None:
        """Next-token logits [1, vocab] (float32) on the last pipeline stage, None elsewhere."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, module):
            output, _ = module(images=images, input_ids=next(data_iterator), position_ids=None, attention_mask=None,
                               inference_context=context, runtime_gather_output=True, **media)
            return output, None

        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([ids]), model=[self.model], num_microbatches=1,
            seq_length=length, micro_batch_size=1, forward_only=True)
        if not parallel_state.is_pipeline_last_stage():
            return None
        return outputs[0][:, -1, : self.arch.text.vocab_size].float()

    def _choose(self, chooser: TokenChooser, seen: torch.Tensor, logits: torch.Tensor | None) -> int:
        import torch.distributed as dist
        from megatron.core import parallel_state

        token = torch.zeros(1, dtype=torch.long, device=self.device)
        if logits is not None:
            token[0] = chooser(seen, logits)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(token, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return int(token.item())
