"""The one table of Hugging Face <-> Megatron tensor names, with a split rule per row.

Megatron names are the dist-checkpoint names of megatron-core (Transformer Engine style, e.g.
`linear_qkv.layer_norm_weight`), the same for local and TE layer specs; `canonical_megatron_name`
turns a module's state_dict name into one. `*` stands for the global layer index. HF names are
those `transformers` writes for `LlavaForConditionalGeneration`; `normalize_hf_name` accepts the
other spellings found in published checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from megatron_ext.convert.rules import COLUMN, GATED_MLP, QKV, REPLICATED, ROW, Reshaped, Rule, VocabParallel
from megatron_ext.model.arch import LlavaArch

LM = "language_model.decoder.layers.*."
HF_LM = "language_model.model.layers.*."
VIT = "vision_model.decoder.layers.*."
HF_VIT = "vision_tower.encoder.layers.*."


@dataclass(frozen=True)
class Mapping:
    megatron: str
    hf: tuple[str, ...]
    rule: Rule
    # A second Megatron copy of an HF tensor another row already maps (the output layer of a model
    # with tied embeddings, which exists only on the last pipeline stage): filled on the way in,
    # never written back, and not counted when checking that each HF tensor is used once.
    tied: bool = False

    def at_layer(self, index: int) -> "Mapping":
        put = lambda name: name.replace("*", str(index))  # noqa: E731
        return Mapping(put(self.megatron), tuple(put(h) for h in self.hf), self.rule, self.tied)


def _m(megatron: str, hf: str | tuple[str, ...], rule: Rule, tied: bool = False) -> Mapping:
    return Mapping(megatron, (hf,) if isinstance(hf, str) else hf, rule, tied)


def _language_rows(arch: LlavaArch) -> tuple[list[Mapping], list[Mapping]]:
    t = arch.text
    vocab = VocabParallel(t.vocab_size, t.padded_vocab_size)
    qkv = QKV(t.num_attention_heads, t.num_query_groups, t.kv_channels)
    attn = HF_LM + "self_attn."
    layer = [
        _m(LM + "self_attention.linear_qkv.layer_norm_weight", HF_LM + "input_layernorm.weight", REPLICATED),
        _m(LM + "self_attention.linear_qkv.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), qkv),
        _m(LM + "self_attention.linear_proj.weight", attn + "o_proj.weight", ROW),
        _m(LM + "mlp.linear_fc1.layer_norm_weight", HF_LM + "post_attention_layernorm.weight", REPLICATED),
        _m(LM + "mlp.linear_fc1.weight", (HF_LM + "mlp.gate_proj.weight", HF_LM + "mlp.up_proj.weight"), GATED_MLP),
        _m(LM + "mlp.linear_fc2.weight", HF_LM + "mlp.down_proj.weight", ROW),
    ]
    if t.qkv_bias:
        layer.append(_m(LM + "self_attention.linear_qkv.bias", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), qkv))
    embed = "language_model.model.embed_tokens.weight"
    once = [
        _m("language_model.embedding.word_embeddings.weight", embed, vocab),
        _m("language_model.decoder.final_layernorm.weight", "language_model.model.norm.weight", REPLICATED),
        # With tied embeddings only the last pipeline stage has its own copy of this tensor.
        _m("language_model.output_layer.weight", embed if t.tie_word_embeddings else "language_model.lm_head.weight", vocab,
           tied=t.tie_word_embeddings),
    ]
    return once, layer


def _vision_rows(arch: LlavaArch) -> tuple[list[Mapping], list[Mapping]]:
    v = arch.vision
    qkv = QKV(v.num_attention_heads, v.num_attention_heads, v.hidden_size // v.num_attention_heads)
    attn = HF_VIT + "self_attn."
    layer = [
        _m(VIT + "self_attention.linear_qkv.layer_norm_weight", HF_VIT + "layer_norm1.weight", REPLICATED),
        _m(VIT + "self_attention.linear_qkv.layer_norm_bias", HF_VIT + "layer_norm1.bias", REPLICATED),
        _m(VIT + "self_attention.linear_qkv.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), qkv),
        _m(VIT + "self_attention.linear_qkv.bias", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), qkv),
        _m(VIT + "self_attention.linear_proj.weight", attn + "out_proj.weight", ROW),
        _m(VIT + "self_attention.linear_proj.bias", attn + "out_proj.bias", REPLICATED),
        _m(VIT + "mlp.linear_fc1.layer_norm_weight", HF_VIT + "layer_norm2.weight", REPLICATED),
        _m(VIT + "mlp.linear_fc1.layer_norm_bias", HF_VIT + "layer_norm2.bias", REPLICATED),
        _m(VIT + "mlp.linear_fc1.weight", HF_VIT + "mlp.fc1.weight", COLUMN),
        _m(VIT + "mlp.linear_fc1.bias", HF_VIT + "mlp.fc1.bias", COLUMN),
        _m(VIT + "mlp.linear_fc2.weight", HF_VIT + "mlp.fc2.weight", ROW),
        _m(VIT + "mlp.linear_fc2.bias", HF_VIT + "mlp.fc2.bias", REPLICATED),
    ]
    once = [
        _m("vision_model.conv1.weight", "vision_tower.embeddings.patch_embedding.weight", REPLICATED),
        _m("vision_model.position_embeddings.weight", "vision_tower.embeddings.position_embedding.weight", REPLICATED),
        _m("vision_projection.encoder.linear_fc1.weight", "multi_modal_projector.linear_1.weight", COLUMN),
        _m("vision_projection.encoder.linear_fc2.weight", "multi_modal_projector.linear_2.weight", ROW),
    ]
    if arch.projector_bias:
        once += [
            _m("vision_projection.encoder.linear_fc1.bias", "multi_modal_projector.linear_1.bias", COLUMN),
            _m("vision_projection.encoder.linear_fc2.bias", "multi_modal_projector.linear_2.bias", REPLICATED),
        ]
    if v.subtype == "clip":
        once += [
            _m("vision_model.class_token", "vision_tower.embeddings.class_embedding", Reshaped((1, 1, v.hidden_size))),
            _m("vision_model.ln_pre.weight", "vision_tower.pre_layrnorm.weight", REPLICATED),
            _m("vision_model.ln_pre.bias", "vision_tower.pre_layrnorm.bias", REPLICATED),
        ]
    else:
        once.append(_m("vision_model.conv1.bias", "vision_tower.embeddings.patch_embedding.bias", REPLICATED))
    return once, layer


def llava_mapping(arch: LlavaArch) -> dict[str, Mapping]:
    """Every Megatron tensor of the model, by canonical name, with its HF sources and rule."""
    lm_once, lm_layer = _language_rows(arch)
    vit_once, vit_layer = _vision_rows(arch)
    rows = lm_once + vit_once
    rows += [row.at_layer(i) for i in range(arch.text.num_layers) for row in lm_layer]
    rows += [row.at_layer(i) for i in range(arch.vision.num_layers) for row in vit_layer]
    return {row.megatron: row for row in rows}


def hf_only_names(arch: LlavaArch, hf_names: list[str]) -> list[str]:
    """HF tensors LLaVA never uses: ViT layers after the feature layer, the tower's post-norm and
    SigLIP's pooling head. They travel beside the Megatron checkpoint so the way back restores them."""
    used = arch.vision.num_layers
    unused = []
    for name in hf_names:
        layer = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
        if (layer and int(layer.group(1)) >= used) or re.match(r"vision_tower\.(post_layernorm|head)\.", name):
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
