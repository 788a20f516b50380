"""Qwen2 / Qwen2.5: Llama-shaped with a bias on the q, k and v projections (none on o_proj)."""

from megatron_ext.families.llama_like import LlamaLikeFamily

FAMILY = LlamaLikeFamily(model_type="qwen2", config_class="Qwen2Config", qkv_bias=True, chat_template="chatml")
