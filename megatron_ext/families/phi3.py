"""Phi-3 (mini, medium; e.g. microsoft/Phi-3-mini-4k-instruct): Llama-shaped, with q/k/v stored as
one HF tensor (`qkv_proj`: [q; k; v] rows) and the gate and up projections as one
(`gate_up_proj`: [gate; up] rows, the order megatron-core's fc1 holds them in). A `sliding_window`
applies to every layer, as Mistral's does. Refused with the reason: partial rotary embeddings
(Phi-4-mini) and LongRoPE scaling (the 128k checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import get
from megatron_ext.families.llama_like import LlamaLikeFamily
from megatron_ext.model.arch import TextArch
from megatron_ext.model.mapping_rules import HF_LM, LM, QKV, GatedMLP, Mapping, concat, row


@dataclass(frozen=True)
class FusedQKV(QKV):
    """Megatron's grouped q/k/v rows from one HF tensor holding all of q, then k, then v."""

    def _hf_sizes(self) -> list[int]:
        return [self.num_heads * self.head_dim, *[self.num_query_groups * self.head_dim] * 2]

    def hf_to_megatron(self, hf):
        (fused,) = hf
        return super().hf_to_megatron(list(fused.split(self._hf_sizes())))

    def megatron_to_hf(self, full):
        return [concat(super().megatron_to_hf(full))]


class FusedGatedMLP(GatedMLP):
    """fc1 from one HF tensor that already holds [gate; up]; shards as the gated MLP does."""

    def hf_to_megatron(self, hf):
        return hf[0]

    def megatron_to_hf(self, full):
        return [full]


@dataclass(frozen=True)
class Phi3Family(LlamaLikeFamily):
    def read(self, cfg: Any) -> TextArch:
        rope = get(cfg, "rope_parameters") or {}
        if float(rope.get("partial_rotary_factor", get(cfg, "partial_rotary_factor", 1.0))) != 1.0:
            raise UserError("phi3 models with partial_rotary_factor < 1 (rotary embeddings on part of each head) are "
                            "not supported")
        return super().read(cfg)

    def rows(self, t: TextArch) -> tuple[list[Mapping], list[Mapping]]:
        once, layer = super().rows(t)
        qkv = FusedQKV(t.num_attention_heads, t.num_query_groups, t.kv_channels)
        fused = {r.megatron: r for r in (
            row(LM + "self_attention.linear_qkv.weight", HF_LM + "self_attn.qkv_proj.weight", qkv),
            row(LM + "mlp.linear_fc1.weight", HF_LM + "mlp.gate_up_proj.weight", FusedGatedMLP()),
        )}
        return once, [fused.get(r.megatron, r) for r in layer]


FAMILY = Phi3Family(model_type="phi3", config_class="Phi3Config", sliding_window_by_default=True)
