"""The table of Hugging Face <-> Megatron tensor names of a LLaVA model, with a split rule per row.

The text model's and the vision tower's rows come from their families (`megatron_ext.families`),
the projector's are here. Names are as `convert.table` describes; `canonical_megatron_name` turns
a module's state_dict name into a Megatron one, `normalize_hf_name` accepts the other HF
spellings found in published checkpoints.
"""

from __future__ import annotations

import re

from megatron_ext.convert.rules import COLUMN, REPLICATED, ROW
from megatron_ext.convert.table import Mapping, row
from megatron_ext.families import text_family, vision_family
from megatron_ext.model.arch import LlavaArch


def _projector_rows(arch: LlavaArch) -> list[Mapping]:
    rows = [
        row("vision_projection.encoder.linear_fc1.weight", "multi_modal_projector.linear_1.weight", COLUMN),
        row("vision_projection.encoder.linear_fc2.weight", "multi_modal_projector.linear_2.weight", ROW),
    ]
    if arch.projector_bias:
        rows += [
            row("vision_projection.encoder.linear_fc1.bias", "multi_modal_projector.linear_1.bias", COLUMN),
            row("vision_projection.encoder.linear_fc2.bias", "multi_modal_projector.linear_2.bias", REPLICATED),
        ]
    return rows


def llava_mapping(arch: LlavaArch) -> dict[str, Mapping]:
    """Every Megatron tensor of the model, by canonical name, with its HF sources and rule."""
    lm_once, lm_layer = text_family(arch.text.model_type).rows(arch.text)
    vit_once, vit_layer = vision_family(arch.vision.model_type).rows(arch.vision)
    rows = lm_once + vit_once + _projector_rows(arch)
    rows += [r.at_layer(i) for i in range(arch.text.num_layers) for r in lm_layer]
    rows += [r.at_layer(i) for i in range(arch.vision.num_layers) for r in vit_layer]
    return {r.megatron: r for r in rows}


def hf_only_names(arch: LlavaArch, hf_names: list[str]) -> list[str]:
    """HF tensors LLaVA never uses: ViT layers after the feature layer, the tower's post-norm and
    pooling head. They travel beside the Megatron checkpoint so the way back restores them."""
    tower = vision_family(arch.vision.model_type)
    used = arch.vision.num_layers
    layer_index = re.compile(re.escape(tower.hf_layers) + r"(\d+)\.")
    unused_modules = tuple(f"vision_tower.{module}." for module in tower.hf_unused)
    unused = []
    for name in hf_names:
        layer = layer_index.match(name)
        if (layer and int(layer.group(1)) >= used) or name.startswith(unused_modules):
            unused.append(name)
    return unused


# HF spellings of the same tensor: transformers 5 in-memory names and older checkpoints.
_HF_ALIASES = [
    (re.compile(r"^model\.language_model\."), "language_model.model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?"), "vision_tower."),
    (re.compile(r"^model\.multi_modal_projector\."), "multi_modal_projector."),
]


def normalize_hf_name(name: str) -> str:
    for pattern, replacement in _HF_ALIASES:
        name, n = pattern.subn(replacement, name)
        if n:
            break
    return name


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


# A dist-checkpoint key is a canonical Megatron name, except that megatron-core stacks a layer
# tensor of every layer along a first axis, under one key `...decoder.layers.<rest>`. The global
# tensor of a key is the full TP1 tensor (a gated MLP's `linear_fc1` is [gate ; up]): TP and PP
# only decide which rank holds which chunk of it.
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
