"""Mistral: Llama-shaped; its config has no `use_sliding_window` switch, so a `sliding_window`
shorter than the context applies (and is refused: megatron-core's local attention has no window)."""

from megatron_ext.families.llama_like import LlamaLikeFamily

FAMILY = LlamaLikeFamily(model_type="mistral", config_class="MistralConfig", sliding_window_by_default=True,
                         tiny_norm_eps=1e-5)
