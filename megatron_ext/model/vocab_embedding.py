"""megatron-core's vocabulary-parallel embedding without a device -> host read in backward.

At TP > 1 megatron-core zeroes the rows of tokens outside a rank's vocabulary shard with
`output[mask, :] = 0.0`: autograd's `IndexPutBackward0` then indexes the gradient with the boolean
mask, which reads the mask back to the host (nonzero) once per micro batch, stalling the CPU until
the GPU has finished all the work queued so far. `masked_fill` computes the same values, and its
gradient is a `masked_fill` too, which reads nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class MaskedFillVocabParallelEmbedding(VocabParallelEmbedding):
    """Training at TP > 1 as megatron-core computes it, out-of-shard rows zeroed by `masked_fill`;
    everything else (TP 1, evaluation, megatron-core 0.19's remat and deterministic modes) is megatron-core's."""

    def _takes(self) -> bool:
        return (self.training and self.tp_group.size() > 1 and not self.deterministic_mode
                and getattr(self, "gtp_remat_size", 1) == 1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if not self._takes():
            return super().forward(input_)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        output = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            # [b s h] -> [s b h] as megatron-core lays it out for the sequence-parallel scatter.
            return reduce_scatter_to_sequence_parallel_region(output.transpose(0, 1).contiguous(), group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output, group=self.tp_group)


def use_masked_fill(model: torch.nn.Module) -> None:
    """Every VocabParallelEmbedding of `model` computes as `MaskedFillVocabParallelEmbedding` (same state, hooks kept)."""
    for module in model.modules():
        if type(module) is VocabParallelEmbedding:
            module.__class__ = MaskedFillVocabParallelEmbedding
