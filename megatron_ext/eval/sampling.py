"""How the next token is chosen: greedy, or sampling with a temperature and nucleus (top-p) filter.

The filters are transformers' own logits warpers, so Megatron and HF generation apply the same
rules in the same order (temperature, then top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_ext.errors import UserError


@dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check(self) -> "SamplingOptions":
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise UserError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        return self

    def hf_generate_kwargs(self) -> dict:
        """Keyword arguments for transformers' `generate` (max_new_tokens is set by the caller)."""
        if self.greedy:
            return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": None}


class TokenChooser:
    """Picks each next token from full-vocabulary logits; seeded, so every rank that calls it with
    the same logits picks the same token."""

    def __init__(self, options: SamplingOptions):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        self.options = options
        self.warpers = LogitsProcessorList()
        if not options.greedy:
            self.warpers.append(TemperatureLogitsWarper(options.temperature))
            if options.top_p < 1:
                self.warpers.append(TopPLogitsWarper(options.top_p))
        self.generator = torch.Generator().manual_seed(options.seed)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> int:
        """`input_ids` [1, S] so far, `logits` [1, V] for the next position."""
        logits = logits.float().cpu()
        if self.options.greedy:
            return int(logits.argmax(dim=-1))
        scores = self.warpers(input_ids.cpu(), logits)
        return int(torch.multinomial(scores.softmax(dim=-1), 1, generator=self.generator))
