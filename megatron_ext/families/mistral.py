"""Mistral: Llama-shaped; its config has no `use_sliding_window` switch, so a `sliding_window`
applies to every layer (Mistral-7B-v0.1's 4096; later versions set none)."""

from megatron_ext.families.llama_like import LlamaLikeFamily

FAMILY = LlamaLikeFamily(model_type="mistral", config_class="MistralConfig", sliding_window_by_default=True)
