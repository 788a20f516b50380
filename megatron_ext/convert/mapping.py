"""The table of Hugging Face <-> Megatron tensor names of a LLaVA model, with a split rule per row.

The text model's and the vision tower's rows come from their families (`megatron_ext.families`),
the projector's are here. Names are as `model.mapping_rules` describes; `normalize_hf_name` accepts
the other HF spellings found in published checkpoints. How those names become keys and chunks of a
distributed checkpoint is `checkpoint.keys`.
"""

from __future__ import annotations

import re
from typing import Callable

from megatron_ext import families
from megatron_ext.model.arch import LlavaArch
from megatron_ext.model.mapping_rules import COLUMN, REPLICATED, ROW, Mapping, row


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
    if arch.tiling is not None:
        # Tiled models' learned newline between rows of image features (model/tiled_llava.py).
        rows.append(row("image_newline", "image_newline", REPLICATED))
    return rows


def llava_mapping(arch: LlavaArch) -> dict[str, Mapping]:
    """Every Megatron tensor of the model, by canonical name, with its HF sources and rule."""
    family = families.of(arch)
    lm_once, lm_layer = family.text.rows(arch.text)
    vit_once, vit_layer = family.vision.rows(arch.vision)
    rows = lm_once + vit_once + _projector_rows(arch)
    rows += [r.at_layer(i) for i in range(arch.text.num_layers) for r in lm_layer]
    rows += [r.at_layer(i) for i in range(arch.vision.num_layers) for r in vit_layer]
    return {r.megatron: r for r in rows}


def model_mapping(arch) -> dict[str, Mapping]:
    """`llava_mapping`, or the table of a whole vision-language model (its family's rows)."""
    if isinstance(arch, LlavaArch):
        return llava_mapping(arch)
    return {r.megatron: r for r in families.of(arch).rows(arch)}


def hf_only_names(arch, hf_names: list[str]) -> list[str]:
    """HF tensors the model never uses: a LLaVA's ViT layers after the feature layer, the tower's
    post-norm and pooling head. They travel beside the Megatron checkpoint so the way back restores
    them. A whole vision-language model uses every tensor."""
    if not isinstance(arch, LlavaArch):
        return []
    return families.of(arch).vision.unused_names(arch.vision, hf_names)


def hf_name_of(arch) -> Callable[[str], str]:
    """How the model's table spells an HF tensor found in a checkpoint or a transformers model."""
    return normalize_hf_name if isinstance(arch, LlavaArch) else families.of(arch).stored_name


# HF spellings of the same tensor: transformers 5 in-memory names and older checkpoints.
_HF_ALIASES = [
    (re.compile(r"^model\.language_model\."), "language_model.model."),
    (re.compile(r"^lm_head\."), "language_model.lm_head."),
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?"), "vision_tower."),
    (re.compile(r"^model\.multi_modal_projector\."), "multi_modal_projector."),
    (re.compile(r"^model\.image_newline$"), "image_newline"),
]


def normalize_hf_name(name: str) -> str:
    for pattern, replacement in _HF_ALIASES:
        name, n = pattern.subn(replacement, name)
        if n:
            break
    return name
