"""One row of the HF <-> Megatron parameter table, and the name prefixes rows are written with.

Megatron names are the dist-checkpoint names of megatron-core (Transformer Engine style, e.g.
`linear_qkv.layer_norm_weight`), the same for local and TE layer specs. `*` stands for the global
layer index. HF names are those `transformers` writes for `LlavaForConditionalGeneration`. Each
family (`megatron_ext.families`) writes the rows of its own tensors with these.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.convert.rules import Rule

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


def row(megatron: str, hf: str | tuple[str, ...], rule: Rule, tied: bool = False) -> Mapping:
    return Mapping(megatron, (hf,) if isinstance(hf, str) else hf, rule, tied)
