"""Model FLOPs per training iteration, for TFLOP/s and MFU (the trainer and bench/gpu_bench.py).

Matmul FLOPs only (2 per multiply-add), counted per module and multiplied by how much of the
backward pass that module needs: 3x when its weights train (forward, input grads, weight grads),
2x when frozen but something before it trains (input grads only), 1x when nothing before it trains
(the frozen ViT: forward only). Attention is counted per sample over the (query, key) pairs it
really has: L^2 / 2 for a causal language-model sample of L positions (packed samples do not see
each other), L^2 for a bidirectional ViT image (a native-resolution tower's: per frame, or per
window in its windowed blocks). Recomputation is not counted (model FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

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


@dataclass(frozen=True)
class TowerWork:
    """What a native-resolution tower (Qwen2.5-VL's, Qwen3-VL's) computes over a batch's images and
    video frames: their patches, and the (query, key) pairs of one full-attention block (each frame
    attends within itself) and of one windowed block (each window within itself)."""

    patches: float = 0.0
    full_pairs: float = 0.0
    window_pairs: float = 0.0


def tower_work(arch, batch: dict) -> TowerWork:
    """The `TowerWork` of a micro batch (its `image_grid_thw` and `video_grid_thw` rows, in patches);
    none for a LLaVA, whose tower `images` counts."""
    if isinstance(arch, LlavaArch):
        return TowerWork()
    v = arch.vision_config
    merge, side = v["spatial_merge_size"], _window_side(v)
    patches = full = window = 0
    for key in ("image_grid_thw", "video_grid_thw"):
        for t, h, w in batch[key].tolist():
            patches += t * h * w
            full += t * (h * w) ** 2
            if side:
                # Windows of side x side merged tokens, the last ones along each axis cut short.
                window += t * merge**4 * _squares(h // merge, side) * _squares(w // merge, side)
    return TowerWork(patches, full, window)


def _window_side(vision_config: dict) -> int | None:
    """A windowed tower's window side in merged tokens (transformers' `vit_merger_window_size`)."""
    size = vision_config.get("window_size")
    return size // vision_config["spatial_merge_size"] // vision_config["patch_size"] if size else None


def _squares(length: int, side: int) -> int:
    """The sum of the squared window lengths along an axis of `length` merged tokens."""
    return (length // side) * side**2 + (length % side) ** 2


def iteration_flops(arch: LlavaArch, *, positions: float, squared_lengths: float, images: float, lm_trained: bool,
                    vit_trained: bool, logit_positions: float | None = None, tower: TowerWork = TowerWork()) -> float:
    """FLOPs of one optimizer step. `images`: vision tower inputs (a tiled model's tiles and video
    frames); `positions`: language-model positions holding samples (image embeddings included,
    padding not); `squared_lengths`: the sum of L^2 over those samples; `logit_positions`: where
    the output layer computes logits (default: every position; fewer with --logits-where-loss,
    so the count follows what is computed). A model that is not a LLaVA (Qwen2.5-VL, Qwen3-VL): its
    decoder's FLOPs and its tower's over `tower` (`_native_tower_flops`)."""
    lm = _language_flops(arch.text, positions, squared_lengths, logit_positions)
    if not isinstance(arch, LlavaArch):
        return _native_tower_flops(arch, tower, vit_trained) + lm * (3 if lm_trained else 2)
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


def _native_tower_flops(arch, work: TowerWork, vit_trained: bool) -> float:
    """A native-resolution tower's FLOPs: each block's linear layers over every patch, its attention
    over the full or windowed pairs (blocks listed in `fullatt_block_indexes` full, the others windowed;
    all full in a tower without windows), and its mergers (the main one, Qwen3-VL's DeepStack ones)
    over every merged token. The blocks count 3x when the tower trains, else 1x; the mergers always
    3x (they train with the projector). Like a LLaVA's, the patch embedding is not counted."""
    v = arch.vision_config
    block, mergers = _linear_sizes(arch)
    depth = v["depth"]
    full = len(v.get("fullatt_block_indexes") or ()) if _window_side(v) else depth
    attention = 2 * 2 * v["hidden_size"] * (full * work.full_pairs + (depth - full) * work.window_pairs)
    blocks = depth * 2.0 * work.patches * block + attention
    return blocks * (3 if vit_trained else 1) + 3 * 2.0 * work.patches / v["spatial_merge_size"] ** 2 * mergers


@cache
def _linear_sizes(arch) -> tuple[int, int]:
    """(multiply-adds of one tower block's linear layers per patch, of all its mergers' per merged
    token), read off transformers' module of `arch` built without memory."""
    import torch

    from megatron_ext import families

    with torch.device("meta"):
        tower = families.of(arch).tower(arch)

    def size(module) -> int:
        return sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear))

    block = size(tower.blocks[0])
    # Every linear layer outside the blocks is a merger's (the patch embedding is a convolution).
    return block, size(tower) - len(tower.blocks) * block
