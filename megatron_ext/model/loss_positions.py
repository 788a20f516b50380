"""The output layer and the cross entropy only at the positions a loss is taken at.

In a LLaVA batch most positions carry no loss: image features (71% of the ~1B benchmark's
positions) and prompts; ~17% are trained. megatron-core's GPTModel still computes logits
[positions x vocabulary] and the cross entropy's fp32 copies of them at every position, about 210 ms
of a 1.6 s step on an H200 (`bench/gpu_profile.py`, the logits+loss phase) and the largest
activation of the step. Each position's loss depends only on its own hidden state, so computing
them only where the loss mask is set, and zeros elsewhere, gives the same per-token losses and the
same gradients (the zeros are multiplied by a zero mask downstream, as megatron-core's losses at
those positions were).

The positions come from the host (`combined_layout`), in the [s, b] order of the hidden states, so
nothing is read back from the device. A `LossPositions` slot is attached once to a built
GPTModel: while the slot holds positions, the output layer sees [n, 1, h] of them and
`compute_language_model_loss` scatters the n losses back into megatron-core's [b, s] result.
"""

from __future__ import annotations

import torch


class LossPositions:
    """What the next forward's output layer takes: flat [s * b] indices (long, on the device), or None."""

    def __init__(self):
        self.positions: torch.Tensor | None = None
        self._shape: tuple[int, int] | None = None  # (s, b) of the hidden states last selected from

    def select(self, module, args, kwargs):
        """Forward pre-hook of the output layer: [s, b, h] hidden states -> [n, 1, h]."""
        if self.positions is None:
            return None
        hidden = args[0]
        self._shape = hidden.shape[:2]
        picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.positions).unsqueeze(1)
        return (picked, *args[1:]), kwargs

    def scatter(self, loss_fn):
        """`compute_language_model_loss(labels [b, s], logits)` for logits of the selected positions:
        the same [b, s] per-token losses, zero where no loss is taken."""

        def loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            if self.positions is None:
                return loss_fn(labels, logits)
            seq, batch = self._shape
            picked = labels.transpose(0, 1).reshape(-1).index_select(0, self.positions)[None]
            losses = loss_fn(picked, logits)  # [1, n]
            full = losses.new_zeros(seq * batch).index_copy(0, self.positions, losses.reshape(-1))
            return full.view(seq, batch).transpose(0, 1).contiguous()

        return loss


def attach(language_model) -> LossPositions:
    """A slot on this GPTModel (its last pipeline stage) through which a forward can ask for the
    output layer and loss at some positions only."""
    slot = LossPositions()
    language_model.output_layer.register_forward_pre_hook(slot.select, with_kwargs=True)
    language_model.compute_language_model_loss = slot.scatter(language_model.compute_language_model_loss)
    return slot
