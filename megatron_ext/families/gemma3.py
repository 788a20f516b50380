"""Gemma 3 text: not a family yet. What megatron-core 0.16.1 lacks for it, so the refusal says so
(docs/families.md lists what adding it takes)."""

REFUSED = {
    "gemma3_text": "megatron-core 0.16.1 has no norm after attention and after the MLP in its TransformerLayer "
    "(Gemma's post_attention_layernorm, post_feedforward_layernorm), no sqrt(hidden_size) embedding scale in "
    "GPTModel, no (1 + weight) RMSNorm outside Transformer Engine, and one RoPE base for all layers (Gemma 3's "
    "sliding layers use their own)",
}
