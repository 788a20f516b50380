"""One interface for answering encoded prompts, whatever the checkpoint format.

`Generator.generate(prompt, options, streamer)` returns the new tokens and their text; subclasses
(`MegatronGenerator`, `HFGenerator`) supply only `_new_tokens`. A streamer is transformers'
`TextStreamer` protocol (`put(ids)`, `end()`): it first receives the prompt, then each new token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from megatron_ext.errors import UserError
from megatron_ext.eval.prompts import EncodedPrompt
from megatron_ext.eval.sampling import SamplingOptions

STOP = "stop"  # an end-of-turn token was generated (it is the last of `token_ids`)
LENGTH = "length"  # --max-new-tokens or the end of the context was reached


def new_token_budget(prompt: EncodedPrompt, context_length: int, options: SamplingOptions) -> int:
    """New tokens that fit after `prompt`; a prompt that leaves no room is a UserError."""
    room = context_length - prompt.length
    if room < 1:
        raise UserError(
            f"the prompt is {prompt.length} tokens (images expanded) but the model's context is "
            f"{context_length} tokens; shorten the prompt or the conversation"
        )
    return min(options.max_new_tokens, room)


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str


class Generator(ABC):
    """`processor`: the checkpoint's HF processor; `context_length`: positions the model can attend
    over (prompt with image embeddings + new tokens); `stop_ids`: end-of-turn token ids."""

    processor = None
    context_length: int
    stop_ids: list[int]
    # Only one process prints and writes (rank 0 of a torchrun group).
    is_output_rank: bool = True

    def generate(self, prompt: EncodedPrompt, options: SamplingOptions, streamer=None) -> Generation:
        budget = new_token_budget(prompt, self.context_length, options)
        token_ids = self._new_tokens(prompt, options, budget, streamer)
        text = self.processor.tokenizer.decode(token_ids, skip_special_tokens=True)
        stopped = bool(token_ids) and token_ids[-1] in self.stop_ids
        return Generation(token_ids, text.strip(), STOP if stopped else LENGTH)

    @abstractmethod
    def _new_tokens(self, prompt: EncodedPrompt, options: SamplingOptions, budget: int, streamer) -> list[int]:
        """At most `budget` new token ids, ending at the first stop id."""
