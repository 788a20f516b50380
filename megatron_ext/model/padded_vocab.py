"""Logits of the padding rows megatron adds to the vocabulary, kept out of the softmax.

megatron pads the output layer to a multiple of 128 rows for tensor parallelism (`arch.
padded_vocab_size`; the converter fills the rows with zeros). Their logits (0) would otherwise take
part in the cross entropy's softmax: the loss would differ from transformers' over the real
vocabulary (by about log(padded / real) on a young model), the padding rows would train, and greedy
decoding could pick a token that does not exist. Set to the dtype's lowest value, they add
exp(-huge) = 0 to the softmax and get no gradient.
"""

from __future__ import annotations

import torch


def mask_padded_vocab(output_layer, vocab_size: int, padded_vocab_size: int) -> None:
    """A forward hook on megatron's (column-parallel) output layer: its logits, this rank's shard of
    the vocabulary or all of it when gathered, keep only the first `vocab_size` entries live."""
    if padded_vocab_size == vocab_size:
        return

    def hook(module, args, output):
        from megatron.core import parallel_state

        logits, bias = output
        width = logits.shape[-1]
        first = 0 if width == padded_vocab_size else parallel_state.get_tensor_model_parallel_rank() * width
        if first + width <= vocab_size:  # decided on the host: no padding row on this shard
            return output
        padding = torch.arange(first, first + width, device=logits.device) >= vocab_size
        return logits.masked_fill(padding, torch.finfo(logits.dtype).min), bias

    output_layer.register_forward_hook(hook)
