"""The FLOP count behind TFLOP/s and MFU (trainer and bench/gpu_bench.py), against the formula by hand."""

from __future__ import annotations

from megatron_ext.families import read_llava
from megatron_ext.train.flops import iteration_flops

ARCH_CONFIG = {
    "model_type": "llava", "image_token_index": 999, "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "text_config": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "hidden_act": "silu",
                    "max_position_embeddings": 512},
    "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "num_hidden_layers": 3,
                      "num_attention_heads": 4, "intermediate_size": 64, "image_size": 28, "patch_size": 14,
                      "hidden_act": "quick_gelu"},
}
ARCH = read_llava(ARCH_CONFIG)


def test_one_sample_by_hand():
    # LM per layer and position: q/k/v 64*(4+2*2)*16 + out 4*16*64 + gated MLP 3*64*128 = 36864 multiply-adds;
    # causal attention of 10 positions: 10^2/2 pairs x (scores + sum) x 4 heads x 16 = 6400 multiply-adds.
    lm = 2 * 2 * (10 * 36864 + 6400)
    logits = 2 * 10 * 64 * 1024  # vocabulary padded to 1024 rows
    # ViT (2 of 3 layers used, frozen: forward only) on 4 patches + CLS = 5 positions, bidirectional.
    vit = 2 * 2 * (5 * (32 * 12 * 8 + 4 * 8 * 32 + 2 * 32 * 64) + 25 * 2 * 4 * 8)
    projector = 2 * 4 * (32 * 64 + 64 * 64)  # 4 image embeddings through the 2-layer MLP
    expected = 3 * (lm + logits) + vit + 3 * projector
    assert expected == 8_750_336
    assert iteration_flops(ARCH, positions=10, squared_lengths=100, images=1, lm_trained=True,
                           vit_trained=False) == expected
    # Stage 1: the LM is frozen, but the projector before it trains, so its input gradients are computed.
    assert iteration_flops(ARCH, positions=10, squared_lengths=100, images=1, lm_trained=False,
                           vit_trained=False) == 2 * (lm + logits) + vit + 3 * projector


def test_packed_samples_count_their_own_attention_only():
    two_apart = iteration_flops(ARCH, positions=20, squared_lengths=2 * 10**2, images=2, lm_trained=True,
                                vit_trained=False)
    assert two_apart == 2 * iteration_flops(ARCH, positions=10, squared_lengths=100, images=1, lm_trained=True,
                                            vit_trained=False)
    one_long = iteration_flops(ARCH, positions=20, squared_lengths=20**2, images=2, lm_trained=True,
                               vit_trained=False)
    assert one_long - two_apart == 3 * 2 * 2 * (400 - 200) / 2 * 2 * 4 * 16


def test_a_tiled_model_counts_every_tile():
    """LLaVA-NeXT with the same towers: the ViT and the projector run on each tile's 4 patches (its
    class token dropped), although each of the features is one image token (img_seq_len 1)."""
    tiled = read_llava({**ARCH_CONFIG, "model_type": "llava_next", "image_grid_pinpoints": [[28, 56]]})
    assert tiled.img_seq_len == 1
    lm = 2 * 2 * (10 * 36864 + 6400)
    logits = 2 * 10 * 64 * 1024
    vit = 2 * 2 * (5 * (32 * 12 * 8 + 4 * 8 * 32 + 2 * 32 * 64) + 25 * 2 * 4 * 8)
    projector = 2 * 4 * (32 * 64 + 64 * 64)
    # A base tile and a 1x2 grid: 3 tiles.
    assert iteration_flops(tiled, positions=10, squared_lengths=100, images=3, lm_trained=False,
                           vit_trained=False) == 2 * (lm + logits) + 3 * vit + 3 * 3 * projector == 6_574_848
