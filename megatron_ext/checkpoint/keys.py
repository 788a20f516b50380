"""Key geometry of megatron-core distributed (torch_dist) checkpoints.

A Megatron tensor's canonical name is its dist-checkpoint name with the global layer index
(`language_model.decoder.layers.3.mlp.linear_fc1.weight`). The checkpoint itself stacks a layer
tensor of every layer along a first axis under one key (`...decoder.layers.mlp.linear_fc1.weight`),
and the global tensor of a key is the full TP1 tensor (a gated MLP's `linear_fc1` is [gate ; up]):
TP and PP only decide which rank holds which chunk of it.
"""

from __future__ import annotations

import re

_LAYER_NORM_KEYS = [("input_layernorm.", "self_attention.linear_qkv.layer_norm_"), ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")]


def canonical_megatron_name(name: str, layer_offset: int = 0) -> str:
    """A local/TE module state_dict name -> dist-checkpoint name with the global layer index."""
    match = re.match(r"^(.*\.decoder\.layers\.)(\d+)\.(.*)$", name)
    if not match:
        return name
    prefix, index, rest = match.groups()
    for local, te in _LAYER_NORM_KEYS:
        if rest.startswith(local):
            rest = te + rest[len(local):]
    offset = layer_offset if prefix.startswith("language_model.") else 0
    return f"{prefix}{int(index) + offset}.{rest}"


_LAYERS = ".decoder.layers."


def tensor_of_chunk(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[str, tuple[slice, ...]]:
    """(canonical Megatron name, the chunk's part of that tensor) for a chunk of a checkpoint key."""
    if _LAYERS in key:
        name, offsets, sizes = key.replace(_LAYERS, f"{_LAYERS}{offsets[0]}.", 1), offsets[1:], sizes[1:]
    else:
        name = key
    return name, tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


def chunk_of_tensor(name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(checkpoint key, offsets, sizes) of a whole Megatron tensor: the inverse of tensor_of_chunk."""
    layer = re.search(r"\.decoder\.layers\.(\d+)\.", name)
    if layer is None:
        return name, (0,) * len(shape), tuple(shape)
    return name.replace(layer.group(0), _LAYERS, 1), (int(layer.group(1)),) + (0,) * len(shape), (1, *shape)


def tensors_of_key(key: str, size) -> list[tuple[str, tuple[int, ...]]]:
    """(canonical name, shape) of the whole Megatron tensors a checkpoint key of this global size
    holds: one per layer for a key stacked over layers."""
    if _LAYERS in key:
        return [(key.replace(_LAYERS, f"{_LAYERS}{i}.", 1), tuple(size[1:])) for i in range(size[0])]
    return [(key, tuple(size))]
