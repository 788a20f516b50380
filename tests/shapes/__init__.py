"""The published shapes: config.json of the LLaVA checkpoints users download (`llava/`) and the
vision configs of the towers LLaVAs are built with (`towers/`), one JSON file each, named after
the Hub repository ("org--name"). Numbers only, no weights: a new published shape is one file.

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


def at_two_layers(config: dict) -> dict:
    """The LLaVA config with two text layers and two tower layers (all else as published)."""
    config = copy.deepcopy(config)
    config["text_config"]["num_hidden_layers"] = 2
    config["vision_config"]["num_hidden_layers"] = 2
    if "max_window_layers" in config["text_config"]:
        config["text_config"]["max_window_layers"] = 2
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
    """The head counts tensor parallelism splits: text query heads, text KV heads, tower heads."""
    text, vision = config["text_config"], config["vision_config"]
    heads = text.get("num_attention_heads", 32)  # LlamaConfig's default, which llava-1.5-7b-hf leaves out
    return [heads, text.get("num_key_value_heads") or heads, vision["num_attention_heads"]]


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
