"""Llama (2, 3, 3.1 ... with llama3 RoPE scaling): the plain Llama-shaped family."""

from megatron_ext.families.llama_like import LlamaLikeFamily

FAMILY = LlamaLikeFamily(model_type="llama", config_class="LlamaConfig")
