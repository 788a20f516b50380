"""The FLOP count behind TFLOP/s and MFU (trainer and bench/gpu_bench.py), against the formula by hand."""

from __future__ import annotations

from megatron_ext import families
from megatron_ext.families import read_llava
from megatron_ext.train.flops import TowerWork, iteration_flops, tower_work
from tests.support import qwen2_5_vl, qwen3_vl

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


def _grids(*images) -> dict:
    import torch

    return {"image_grid_thw": torch.tensor(images), "video_grid_thw": torch.zeros(0, 3, dtype=torch.long)}


def _tower_flops(arch, work, vit_trained=False) -> float:
    """What a native-resolution model's tower adds to a step's count."""
    step = dict(positions=10, squared_lengths=100, images=1, lm_trained=True, vit_trained=vit_trained)
    return iteration_flops(arch, **step, tower=work) - iteration_flops(arch, **step)


def test_a_qwen2_5_vl_tower_counts_its_windowed_and_full_attention_blocks_and_its_merger():
    """The tiny tower: 3 blocks (hidden 64, gated MLP 128), block 1 full attention, windows of 2 x 2
    merged tokens; a 6 x 10 patch image is 3 x 5 merged tokens, its windows 2 + 1 rows by 2 + 2 + 1 columns."""
    arch = families.read_model(qwen2_5_vl.tiny_config())
    work = tower_work(arch, _grids([1, 6, 10]))
    assert work == TowerWork(patches=60, full_pairs=60**2, window_pairs=4**2 * (2**2 + 1**2) * (2**2 + 2**2 + 1**2))
    # Per patch and block: qkv 64*192 + proj 64*64 + gate, up, down 3*64*128 multiply-adds.
    blocks = 3 * 2 * 60 * (64 * 192 + 64 * 64 + 3 * 64 * 128)
    attention = 2 * 2 * 64 * (1 * 3600 + 2 * 720)  # one full block, two windowed
    merger = 2 * 15 * (256 * 256 + 256 * 128)  # 15 merged tokens through 256 -> 256 -> 128
    assert _tower_flops(arch, work) == blocks + attention + 3 * merger == 24_883_200
    assert _tower_flops(arch, work, vit_trained=True) == 3 * (blocks + attention) + 3 * merger


def test_a_qwen3_vl_tower_counts_full_attention_in_every_block_and_its_deepstack_mergers():
    arch = families.read_model(qwen3_vl.tiny_config())
    # Two images in one micro batch: 4 x 6 and 2 x 2 patches of 16 pixels, each attending within itself.
    work = tower_work(arch, _grids([1, 4, 6], [1, 2, 2]))
    assert work == TowerWork(patches=28, full_pairs=24**2 + 4**2, window_pairs=0)
    blocks = 3 * 2 * 28 * (64 * 192 + 64 * 64 + 2 * 64 * 128)  # plain MLP
    attention = 3 * 2 * 2 * 64 * (24**2 + 4**2)
    mergers = 3 * 2 * 7 * (256 * 256 + 256 * 128)  # the main merger and two DeepStack ones, 7 merged tokens
    assert _tower_flops(arch, work) == blocks + attention + 3 * mergers == 18_345_984


def test_the_trainers_batch_statistics_carry_each_micro_batchs_tower_work():
    import torch

    from megatron_ext.model.mrope_inputs import MRopeInputs
    from megatron_ext.train.trainer import BATCH_STATS, batch_stats

    arch = families.read_model(qwen2_5_vl.tiny_config())
    ids = torch.tensor([[1, 2] + [arch.image_token_id] * 15 + [3, 0]])
    batch = {"input_ids": ids, "segment_ids": torch.tensor([[1] * 18 + [0]]), "num_samples": 1, "num_truncated": 0,
             "num_skipped": 0, **_grids([1, 6, 10])}
    inputs = MRopeInputs(arch.image_token_id, torch.float32, torch.device("cpu"), "sdpa")
    stats = dict(zip(BATCH_STATS, batch_stats([batch, batch], inputs, arch).tolist()))
    assert (stats["positions"], stats["tower_patches"], stats["tower_full_pairs"], stats["tower_window_pairs"]) == (
        36, 120, 2 * 3600, 2 * 720)
