"""The vocabulary of the HF <-> Megatron parameter table: a row (`Mapping`) names a Megatron tensor,
its Hugging Face tensor(s) and the split rule that relates them.

Megatron names are megatron-core's dist-checkpoint names (Transformer Engine style, e.g.
`linear_qkv.layer_norm_weight`), the same for local and TE layer specs; `*` stands for the global
layer index. HF names are those `transformers` writes for the LLaVA classes. Each family
(`megatron_ext.families`) writes the rows of its own tensors with these; the converters are loops
over the rows.

Every split rule has three symmetric pieces:
  hf_to_megatron(hf tensors) -> the full Megatron tensor (the layout a TP=1 model holds)
  megatron_to_hf(full)       -> the HF tensors, exactly as they were
  shard(full, rank, size)    -> what tensor-parallel rank `rank` of `size` holds

torch is imported where a rule computes: the launcher reads the families' tables without importing
torch (its --dry-run stays light).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def concat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat(parts, dim), computed by copying the parts into one new tensor. The converters
    check shapes by running the rules on meta tensors, where torch.cat is a Python kernel whose
    first call imports TorchDynamo: 0.8 s in each converter worker."""
    rest = {part.shape[:dim] + part.shape[dim + 1:] for part in parts}
    if len(rest) != 1:  # copy_ would broadcast where torch.cat refuses
        raise ValueError(f"cannot concatenate {[list(part.shape) for part in parts]} along dimension {dim}")
    shape = list(parts[0].shape)
    shape[dim] = sum(part.shape[dim] for part in parts)
    out, offset = parts[0].new_empty(shape), 0
    for part in parts:
        out.narrow(dim, offset, part.shape[dim]).copy_(part)
        offset += part.shape[dim]
    return out


class Rule:
    def hf_to_megatron(self, hf: list[torch.Tensor]) -> torch.Tensor:
        return hf[0]

    def megatron_to_hf(self, full: torch.Tensor) -> list[torch.Tensor]:
        return [full]

    def shard(self, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
        raise NotImplementedError


class Replicated(Rule):
    """Every rank holds the whole tensor (norms, biases after a row-parallel matmul, embeddings of the ViT)."""

    def shard(self, full, rank, size):
        return full


@dataclass(frozen=True)
class Reshaped(Replicated):
    """Replicated, stored with another shape in Megatron (CLIP's class token: (h,) vs (1, 1, h);
    InternViT's position embeddings: (1, n, h) vs (n, h)). `hf_shape` None: one dimension."""

    megatron_shape: tuple[int, ...]
    hf_shape: tuple[int, ...] | None = None

    def hf_to_megatron(self, hf):
        return hf[0].reshape(self.megatron_shape)

    def megatron_to_hf(self, full):
        return [full.reshape(self.hf_shape or (-1,))]


class Column(Rule):
    """Output features split across ranks (ColumnParallelLinear weight and bias).

        full [out, in]  ->  rank r: rows [r*out/size, (r+1)*out/size)
    """

    def shard(self, full, rank, size):
        return full.chunk(size, dim=0)[rank]


class Row(Rule):
    """Input features split across ranks (RowParallelLinear weight).

        full [out, in]  ->  rank r: columns [r*in/size, (r+1)*in/size)
    """

    def shard(self, full, rank, size):
        return full.chunk(size, dim=1)[rank]


@dataclass(frozen=True)
class VocabParallel(Column):
    """Embedding / output rows: padded with zero rows to Megatron's vocab, then split by rows."""

    vocab_size: int
    padded_vocab_size: int

    def hf_to_megatron(self, hf):
        (table,) = hf
        if table.shape[0] != self.vocab_size:
            raise ValueError(f"expected {self.vocab_size} vocabulary rows, found {table.shape[0]}")
        pad = table.new_zeros((self.padded_vocab_size - self.vocab_size, *table.shape[1:]))
        return concat([table, pad])

    def megatron_to_hf(self, full):
        return [full[: self.vocab_size]]


@dataclass(frozen=True)
class QKV(Rule):
    """q, k, v projections fused the way megatron-core's linear_qkv holds them.

    Megatron groups the heads by key/value group; each group stores its query heads, then its
    key head, then its value head:

        [ q(g0) k(g0) v(g0) | q(g1) k(g1) v(g1) | ... ]   each q(g) = heads_per_group x head_dim rows

    Tensor parallelism gives each rank whole groups (a contiguous block of rows). Works for the
    weight [rows, hidden] and the bias [rows] alike. With grouped-query attention
    (num_query_groups < num_heads) q and k/v have different row counts.
    """

    num_heads: int
    num_query_groups: int
    head_dim: int

    def _sizes(self):
        per_group = self.num_heads // self.num_query_groups
        return [per_group * self.head_dim, self.head_dim, self.head_dim]

    def hf_to_megatron(self, hf):
        q, k, v = hf
        g = self.num_query_groups
        grouped = [t.reshape(g, -1, *t.shape[1:]) for t in (q, k, v)]
        return concat(grouped, dim=1).reshape(-1, *q.shape[1:])

    def megatron_to_hf(self, full):
        import torch

        g = self.num_query_groups
        grouped = full.reshape(g, -1, *full.shape[1:])
        q, k, v = torch.split(grouped, self._sizes(), dim=1)
        return [t.reshape(-1, *full.shape[1:]).contiguous() for t in (q, k, v)]

    def shard(self, full, rank, size):
        return full.chunk(size, dim=0)[rank]


class GatedMLP(Rule):
    """SwiGLU gate and up projections fused into linear_fc1.

        full = [gate ; up]       rank r = [gate rows of r ; up rows of r]

    Each rank needs its slice of both halves, so it is not a plain column split.
    """

    def hf_to_megatron(self, hf):
        return concat(list(hf))

    def megatron_to_hf(self, full):
        return [t.contiguous() for t in full.chunk(2, dim=0)]

    def shard(self, full, rank, size):
        gate, up = full.chunk(2, dim=0)
        return concat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]])


REPLICATED = Replicated()
COLUMN = Column()
ROW = Row()
GATED_MLP = GatedMLP()

# Name prefixes of one layer's tensors (`*`: its global index).
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
