"""Qwen3 (dense): Llama-shaped, no q/k/v bias, an RMSNorm over each head's query and key before
RoPE (megatron-core's `qk_layernorm` with the RMSNorm class), and a `head_dim` that need not be
hidden_size / heads."""

from megatron_ext.families.llama_like import LlamaLikeFamily

FAMILY = LlamaLikeFamily(model_type="qwen3", config_class="Qwen3Config", qk_layernorm=True, chat_template="chatml")
