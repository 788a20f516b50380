"""The published shapes: config.json of the LLaVA checkpoints users download (`llava/`), the
vision configs of the towers LLaVAs are built with (`towers/`) and the config.json of the Qwen-VL
checkpoints (`qwen_vl/`: Qwen2.5-VL, whose Hub configs keep the text model's fields at the top
level, and Qwen3-VL), one JSON file each, named after the Hub repository ("org--name"). Numbers
only, no weights: a new published shape is one file.

The configs are as the Hub has them, which leave out whatever equals transformers' defaults
(llava-1.5-7b-hf's text config gives no hidden size), so they are read the way a user's download is.
"""

from __future__ import annotations

import copy
import json
from math import gcd
from pathlib import Path

SHAPES = Path(__file__).parent
# Layouts checked: every tensor-parallel size up to 8 and pipeline-parallel size up to 2.
LAYOUTS = [(tp, pp) for pp in (1, 2) for tp in (1, 2, 4, 8)]


def _read(folder: str) -> dict[str, dict]:
    return {path.stem: json.loads(path.read_text()) for path in sorted((SHAPES / folder).glob("*.json"))}


def llava_shapes() -> dict[str, dict]:
    return _read("llava")


def tower_shapes() -> dict[str, dict]:
    return _read("towers")


def qwen_vl_shapes() -> dict[str, dict]:
    return _read("qwen_vl")


def is_qwen_vl(config: dict) -> bool:
    from megatron_ext.families import vision_language_families

    return config["model_type"] in vision_language_families()


def _text(config: dict) -> dict:
    """The text model's fields (a Qwen2.5-VL config on the Hub keeps them at its top level)."""
    return config.get("text_config", config)


def at_two_layers(config: dict) -> dict:
    """The config with two text layers and two tower layers (all else as published); a Qwen3-VL's
    decoder gets two layers per DeepStack feature (`_decoder_layers`)."""
    config = _with_decoder_layers(config)
    vision = config["vision_config"]
    vision["depth" if is_qwen_vl(config) else "num_hidden_layers"] = 2
    return config


def _with_decoder_layers(config: dict) -> dict:
    """A copy of `config` with two decoder layers, or two per DeepStack feature: PP2's first stage
    then holds a layer for each feature."""
    config = copy.deepcopy(config)
    text = _text(config)
    text["num_hidden_layers"] = max(2, 2 * len(config["vision_config"].get("deepstack_visual_indexes") or ()))
    if "max_window_layers" in text:
        text["max_window_layers"] = text["num_hidden_layers"]
    return config


def tower_llava(vision_config: dict) -> dict:
    """A LLaVA-1.5 config joining the tower to a Llama whose 8 heads (8 KV heads) split to TP8, reading
    the tower's features as its family does (CLIP: penultimate layer without the class token; SigLIP:
    last layer, every patch; InternViT: last layer without the class token)."""
    from megatron_ext.families import vision_family

    family = vision_family(vision_config["model_type"])
    text = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
            "num_key_value_heads": 8, "num_hidden_layers": 2, "vocab_size": 1003, "max_position_embeddings": 4096}
    return {"model_type": "llava", "text_config": text, "vision_config": copy.deepcopy(vision_config),
            "image_token_index": 1001, "pad_token_id": 1002, "vision_feature_layer": family.feature_layer,
            "vision_feature_select_strategy": family.select_strategy}


def _heads(config: dict) -> list[int]:
    """The head counts tensor parallelism splits: text query heads, text KV heads, tower heads (not
    a Qwen-VL's: its tower is whole on every rank)."""
    text = _text(config)
    heads = text.get("num_attention_heads", 32)  # LlamaConfig's default, which llava-1.5-7b-hf leaves out
    kv_heads = text.get("num_key_value_heads") or heads
    return [heads, kv_heads] if is_qwen_vl(config) else [heads, kv_heads, config["vision_config"]["num_attention_heads"]]


def layouts_allowed(config: dict) -> list[tuple[int, int]]:
    """The layouts of LAYOUTS whose TP size divides every head count (what any Megatron split needs)."""
    common = 0
    for count in _heads(config):
        common = gcd(common, count)
    return [(tp, pp) for tp, pp in LAYOUTS if common % tp == 0]


def narrowed(config: dict, text_head_dim: int = 8, vision_head_dim: int = 4) -> dict:
    """`at_two_layers(config)` with every head count, KV head count, image and patch size, grid and
    setting as published, but small heads (`*_head_dim`) and MLPs: the model computes what the
    published one would on a CPU in seconds. What the head widths decide at real size (every
    tensor's shape on every rank) is checked on the meta device instead."""
    config = at_two_layers(config)
    text, vision = config["text_config"], config["vision_config"]
    heads = text.get("num_attention_heads", 32)
    text.update(num_attention_heads=heads, num_key_value_heads=text.get("num_key_value_heads") or heads,
                hidden_size=heads * text_head_dim, head_dim=text_head_dim, intermediate_size=2 * heads * text_head_dim)
    vision_heads = vision["num_attention_heads"]
    vision.update(hidden_size=vision_heads * vision_head_dim, intermediate_size=2 * vision_heads * vision_head_dim)
    return config


def narrowed_qwen_vl(config: dict, text_head_dim: int = 16, vision_head_dim: int = 8) -> dict:
    """A Qwen-VL config with two decoder layers (`_with_decoder_layers`), every head count, tower
    block, window, full-attention block, DeepStack index, patch and merge size, vocabulary and tying
    as published, but small heads and MLPs. The mRoPE sections keep their shares of the narrower
    head's frequency channels (`scaled_sections`)."""
    config = _with_decoder_layers(config)
    text, vision = _text(config), config["vision_config"]
    heads = text["num_attention_heads"]
    published_head_dim = text.get("head_dim") or text["hidden_size"] // heads
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    rope["mrope_section"] = scaled_sections(rope["mrope_section"], published_head_dim // 2, text_head_dim // 2)
    text.update(hidden_size=heads * text_head_dim, head_dim=text_head_dim, intermediate_size=2 * heads * text_head_dim,
                # random weights of this spread give logits that differ visibly (std > 1) at these widths
                initializer_range=0.2)
    hidden = vision["num_heads"] * vision_head_dim
    vision.update(hidden_size=hidden, intermediate_size=2 * hidden, out_hidden_size=text["hidden_size"])
    return config


def scaled_sections(sections: list[int], channels: int, narrow: int) -> list[int]:
    """mRoPE sections over `channels` frequency channels, scaled to `narrow` channels with the
    largest remainders rounded up (ties: the earlier axis): [16, 24, 24] of 64 -> [2, 3, 3] of 8,
    [24, 20, 20] of 64 -> [3, 3, 2] of 8."""
    exact = [s * narrow / channels for s in sections]
    out = [int(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (out[i] - exact[i], i))
    for i in by_remainder[:narrow - sum(out)]:
        out[i] += 1
    return out


def build(config: dict, out: Path) -> Path:
    """A random HF LLaVA of `config` (all its sizes as given) in `out`, assembled by build-llava's code
    from a text model and a tower written from the config's parts (the local tokenizer: its own vocabulary)."""
    import re

    from megatron_ext.demo.tiny_models import make_text_model_like, make_vision_model_like
    from megatron_ext.families import llava_kind
    from megatron_ext.hf.build_llava import build_llava

    text = make_text_model_like(out / "text", config["text_config"])
    vision = make_vision_model_like(out / "vision", config["vision_config"])
    kind = llava_kind(config)
    anyres = re.fullmatch(r"anyres_max_(\d+)", config.get("vision_aspect_ratio", "anyres_max_9"))
    return build_llava(out / "hf", str(text), str(vision), arch=kind.arch_flag,
                       image_grid_pinpoints=config.get("image_grid_pinpoints"), anyres_max=int(anyres.group(1)))


def build_qwen_vl(config: dict, out: Path, seed: int = 0) -> Path:
    """A random float32 HF Qwen-VL of `config` (all its sizes as given), saved as transformers saves it, with
    the demo's tiny tokenizer (the converters copy it)."""
    import torch
    import transformers

    from megatron_ext.demo.tiny_models import train_tokenizer
    from megatron_ext.families import model_kind

    kind = model_kind(config)
    torch.manual_seed(seed)
    model = getattr(transformers, kind.model_class)(getattr(transformers, kind.config_class).from_dict(config))
    model.float().save_pretrained(out)  # float32 throughout: the published dtype would give some parts bfloat16
    train_tokenizer(400).save_pretrained(out)
    return out


def qwen_vl_sample(config: dict, size: tuple[int, int]) -> dict:
    """A prompt for a Qwen-VL of `config`: text, one random image of `size` (width, height),
    smart-resized by the family's processor, text; its ids [1, S], mRoPE positions [3, 1, S], token
    types and pixels, as `data/native_resolution.py` makes them."""
    import numpy as np
    import torch
    from PIL import Image

    from megatron_ext.data.native_resolution import QWEN2_5_VL, QWEN3_VL, image_inputs, mrope_positions, token_types
    from megatron_ext.families import complete_config, read_model

    arch = read_model(complete_config(config))
    vision = {v.name: v for v in (QWEN2_5_VL, QWEN3_VL)}[arch.name]
    rng = np.random.RandomState(0)
    media = image_inputs([Image.fromarray(rng.randint(0, 256, (size[1], size[0], 3), dtype=np.uint8))], vision)
    (grid,) = media["image_grid_thw"].tolist()
    words = rng.randint(0, config.get("vision_start_token_id", 151652), 11).tolist()
    image = [arch.image_token_id] * (int(np.prod(grid)) // vision.merge_size ** 2)
    ids = words[:5] + [config["vision_start_token_id"], *image, config["vision_end_token_id"]] + words[5:]
    types = token_types(ids, arch.image_token_id, arch.video_token_id)
    positions = mrope_positions(types, vision, media["image_grid_thw"])
    return {"input_ids": torch.tensor([ids]), "position_ids": positions[:, None, :],
            "mm_token_type_ids": torch.from_numpy(types)[None].int(), **media}
