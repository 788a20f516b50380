"""Model FLOPs per training iteration, for TFLOP/s and MFU (the trainer and bench/gpu_bench.py).

Matmul FLOPs only (2 per multiply-add), counted per module and multiplied by how much of the
backward pass that module needs: 3x when its weights train (forward, input grads, weight grads),
2x when frozen but something before it trains (input grads only), 1x when nothing before it trains
(the frozen ViT: forward only). Attention is counted per sample over the (query, key) pairs it
really has: L^2 / 2 for a causal language-model sample of L positions (packed samples do not see
each other), L^2 for a bidirectional ViT image. Recomputation is not counted (model FLOPs).
"""

from __future__ import annotations

from megatron_ext.model.arch import LlavaArch

# What MFU is taken against unless told otherwise: an H100 SXM's dense bf16 TFLOP/s.
H100_BF16_PEAK_TFLOPS = 989.0


def _transformer_flops(tokens: float, attention_pairs: float, layers: int, hidden: int, ffn: int, heads: int,
                       groups: int, head_dim: int, gated: bool) -> float:
    qkv = hidden * (heads + 2 * groups) * head_dim
    proj = heads * head_dim * hidden
    mlp = hidden * ffn * (3 if gated else 2)
    attention = 2 * 2 * heads * head_dim * attention_pairs  # scores + weighted sum
    return layers * (2.0 * tokens * (qkv + proj + mlp) + attention)


def iteration_flops(arch: LlavaArch, *, positions: float, squared_lengths: float, images: float, lm_trained: bool,
                    vit_trained: bool, logit_positions: float | None = None) -> float:
    """FLOPs of one optimizer step. `images`: vision tower inputs (a tiled model's tiles and video
    frames); `positions`: language-model positions holding samples (image embeddings included,
    padding not); `squared_lengths`: the sum of L^2 over those samples; `logit_positions`: where
    the output layer computes logits (default: every position; fewer with --logits-where-loss,
    so the count follows what is computed). A model that is not a LLaVA (Qwen2.5-VL): its decoder's
    FLOPs only, as if it were frozen before it (its windowed tower is not counted yet)."""
    lm = _language_flops(arch.text, positions, squared_lengths, logit_positions)
    if not isinstance(arch, LlavaArch):
        return lm * (3 if lm_trained else 2)
    v = arch.vision
    image_tokens = v.num_patches + int(v.class_token)
    vit = _transformer_flops(images * image_tokens, images * image_tokens**2, v.num_layers, v.hidden_size,
                             v.ffn_hidden_size, v.num_attention_heads, v.num_attention_heads,
                             v.hidden_size // v.num_attention_heads, False)
    # The projector maps every tile's kept patches (a tiled model's features are rearranged after it).
    tile_features = v.num_patches + int(v.class_token and not arch.drop_class_token)
    projector = 2.0 * images * tile_features * (v.hidden_size * arch.text.hidden_size + arch.text.hidden_size**2)
    lm_factor = 3 if lm_trained else 2  # the projector before it always trains
    return vit * (3 if vit_trained else 1) + projector * 3 + lm * lm_factor


def _language_flops(t, positions: float, squared_lengths: float, logit_positions: float | None) -> float:
    """The decoder's forward FLOPs and its output layer's."""
    lm = _transformer_flops(positions, squared_lengths / 2, t.num_layers, t.hidden_size, t.ffn_hidden_size,
                            t.num_attention_heads, t.num_query_groups, t.kv_channels, True)
    return lm + 2.0 * (positions if logit_positions is None else logit_positions) * t.hidden_size * t.padded_vocab_size
