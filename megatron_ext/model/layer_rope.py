"""Self-attention whose RoPE depends on the layer: sliding-window layers and full layers with their
own base and linear position scaling (Gemma 3: base 10k locally, 1M globally).

megatron-core's GPTModel computes one rotary embedding and hands it to every layer; this layer
computes its own for the same positions (the given one's length, so KV-cache decoding, which slices
it by offset, stays right) and attends with that.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.utils import is_layer_window_attention


@dataclass(frozen=True)
class Rope:
    base: float
    linear_factor: float | None = None  # positions divided by this (HF rope_type "linear")


@cache
def _rotary(kv_channels: int, rope: Rope, cp_group) -> RotaryEmbedding:
    """One RotaryEmbedding per RoPE (and parallel world), shared by the layers that use it: it
    caches the embeddings it computed (per length), which would otherwise be held once per layer."""
    return RotaryEmbedding(kv_channels=kv_channels, rotary_percent=1.0, rotary_base=rope.base,
                           seq_len_interpolation_factor=rope.linear_factor, use_cpu_initialization=True,
                           cp_group=cp_group)


class LayerRopeSelfAttention(SelfAttention):
    def __init__(self, config, submodules, layer_number: int, *args, sliding_rope: Rope, full_rope: Rope, **kwargs):
        if config.context_parallel_size != 1:
            raise ValueError("per-layer RoPE does not split its positions over context-parallel ranks; use --cp 1")
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        sliding = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
        self.layer_rope = _rotary(config.kv_channels, sliding_rope if sliding else full_rope,
                                  parallel_state.get_context_parallel_group(check_initialized=False))

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            rotary_pos_emb = self.layer_rope(rotary_pos_emb.shape[0]).to(rotary_pos_emb.device)
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
