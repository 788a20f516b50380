"""LLaVA's own config: which text model and vision tower it joins, and how (feature layer and
strategy, projector, image token, tiling). Their parts are read by their families.

Three HF architectures share the rest of the toolkit (`KINDS`): LLaVA-1.5 (`llava`, one tile per
image), LLaVA-NeXT (`llava_next`, anyres tiles) and LLaVA-OneVision (`llava_onevision`, anyres
tiles downsampled past `anyres_max_N`, videos).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import as_dict
from megatron_ext.model.arch import LlavaArch, TilingArch

IMAGE_TOKEN = "<image>"
VIDEO_TOKEN = "<video>"
# Frames a video is sampled to unless --video-frames says otherwise: LLaVA-OneVision's training
# recipes' frames_upbound, and lmms-eval's llava_hf default.
DEFAULT_VIDEO_FRAMES = 32


@dataclass(frozen=True)
class LlavaKind:
    """One HF LLaVA architecture: its transformers classes, its config's defaults, how it tiles."""

    model_type: str
    arch_flag: str  # build-llava --arch
    config_class: str
    model_class: str
    processor_class: str
    image_processor_class: str | None  # None: the tower's own
    feature_layer: int  # transformers' defaults, for configs that omit them
    select_strategy: str
    # Default grids in tiles (rows, columns), as the published models' pinpoints; empty: not tiled.
    grid_units: tuple[tuple[int, int], ...] = ()
    video_processor_class: str | None = None  # None: the kind takes no videos

    @property
    def video(self) -> bool:
        return self.video_processor_class is not None

    def video_processor_type(self):
        """The transformers class of the video processor, from its module: without torchvision,
        transformers' top-level name for it is a placeholder; the class itself is built, saved and
        loaded (only its preprocessing runs torchvision)."""
        import importlib

        module = importlib.import_module(f"transformers.models.{self.model_type}.video_processing_{self.model_type}")
        return getattr(module, self.video_processor_class)

    @property
    def tiled(self) -> bool:
        return bool(self.grid_units)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        return (IMAGE_TOKEN, VIDEO_TOKEN) if self.video else (IMAGE_TOKEN,)

    def default_pinpoints(self, tile: int) -> list[list[int]]:
        return [[rows * tile, cols * tile] for rows, cols in self.grid_units]

    def config_fields(self, image_seq_length: int, pinpoints: list[list[int]], max_tiles: int, token_ids: dict) -> dict:
        """Fields of build-llava's HF config beyond those every kind has."""
        fields = {"image_seq_length": image_seq_length}
        if self.tiled:
            fields["image_grid_pinpoints"] = pinpoints
        return fields

    def processor_fields(self, patch_size: int, num_patches: int, extra_tokens: int, select_strategy: str,
                         max_tiles: int) -> dict:
        return dict(patch_size=patch_size, vision_feature_select_strategy=select_strategy,
                    num_additional_image_tokens=extra_tokens, image_token=IMAGE_TOKEN)


@dataclass(frozen=True)
class OnevisionKind(LlavaKind):
    """OneVision names its downsampling limit and video token in its config and processor."""

    def config_fields(self, image_seq_length, pinpoints, max_tiles, token_ids):
        return dict(image_grid_pinpoints=pinpoints, vision_aspect_ratio=f"anyres_max_{max_tiles}",
                    video_token_index=token_ids[VIDEO_TOKEN])

    def processor_fields(self, patch_size, num_patches, extra_tokens, select_strategy, max_tiles):
        # Its processor counts a tile's features with the class token, then drops it for "default".
        return dict(num_image_tokens=num_patches + extra_tokens, vision_feature_select_strategy=select_strategy,
                    image_token=IMAGE_TOKEN, video_token=VIDEO_TOKEN, vision_aspect_ratio=f"anyres_max_{max_tiles}")


KINDS = {kind.model_type: kind for kind in (
    LlavaKind("llava", "llava", "LlavaConfig", "LlavaForConditionalGeneration", "LlavaProcessor", None,
              feature_layer=-2, select_strategy="default"),
    LlavaKind("llava_next", "llava-next", "LlavaNextConfig", "LlavaNextForConditionalGeneration", "LlavaNextProcessor",
              "LlavaNextImageProcessorPil", feature_layer=-2, select_strategy="default",
              grid_units=((1, 2), (2, 1), (2, 2), (3, 1), (1, 3))),
    OnevisionKind("llava_onevision", "llava-onevision", "LlavaOnevisionConfig", "LlavaOnevisionForConditionalGeneration",
                  "LlavaOnevisionProcessor", "LlavaOnevisionImageProcessorPil", feature_layer=-1, select_strategy="full",
                  grid_units=tuple((rows, cols) for rows in range(1, 7) for cols in range(1, 7)),
                  video_processor_class="LlavaOnevisionVideoProcessor"),
)}


def kind_of(cfg: Any) -> LlavaKind:
    model_type = as_dict(cfg).get("model_type")
    if model_type not in KINDS:
        raise UserError(f"model_type {model_type!r} is not supported (supported: {', '.join(KINDS)})")
    return KINDS[model_type]


def _max_tiles(aspect: str) -> int:
    """anyres_max_N -> N (transformers' OneVision reads no other form)."""
    match = re.fullmatch(r"anyres_max_(\d+)", str(aspect))
    if not match or int(match.group(1)) < 1:
        raise UserError(f"vision_aspect_ratio {aspect!r} is not supported (anyres_max_N, N >= 1)")
    return int(match.group(1))


def _tiling(cfg: dict, kind: LlavaKind, tile: int) -> TilingArch | None:
    if not kind.tiled:
        return None
    pinpoints = cfg.get("image_grid_pinpoints")
    if not pinpoints:
        raise UserError(f"{kind.model_type} config has no image_grid_pinpoints")
    bad = [p for p in pinpoints if len(p) != 2 or p[0] % tile or p[1] % tile or min(p) <= 0]
    if bad:
        raise UserError(f"image_grid_pinpoints {bad} are not (height, width) multiples of the tower's image size {tile}")
    video_token = cfg.get("video_token_index", cfg.get("video_token_id")) if kind.video else None
    if kind.video and video_token is None:
        raise UserError(f"{kind.model_type} config has no video_token_index")
    # The aspect mode is OneVision's; LLaVA-NeXT never downsamples.
    max_tiles = _max_tiles(cfg.get("vision_aspect_ratio", "anyres_max_9")) if kind.video else None
    return TilingArch(grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints), max_tiles=max_tiles,
                      video_token_index=video_token)


# The sub-configs' fields the families read whose absence means "transformers' default": a config
# holding all of them is read as it is.
_READ_KEYS = {
    "text_config": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
                    "hidden_act", "max_position_embeddings", "rms_norm_eps"),
    "vision_config": ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size",
                      "patch_size", "hidden_act", "layer_norm_eps"),
}


def _complete(cfg: Any, kind: LlavaKind) -> dict:
    """Every field of the config as transformers reads it: published config.json files leave out
    what equals their classes' defaults (llava-1.5-7b-hf gives no text hidden_size, OneVision's
    tower no hidden_act), which transformers' config classes fill in. A config they cannot take
    (a family transformers does not know, sizes it rejects) is read as given: our own checks then
    name what is wrong, in our words."""
    if not isinstance(cfg, dict):
        return cfg.to_dict()
    if all(key in cfg.get(part, {}) for part, keys in _READ_KEYS.items() for key in keys):
        return cfg  # complete already: transformers (and torch, which it imports) stay out of a dry run
    import transformers

    try:
        return getattr(transformers, kind.config_class)(**cfg).to_dict()
    except (TypeError, ValueError, KeyError):
        return cfg


def complete(cfg: Any) -> dict:
    return _complete(cfg, kind_of(cfg))


def read_llava(cfg: Any, text_family, vision_family) -> LlavaArch:
    """The LlavaArch of an HF LLaVA config whose text config `text_family` and vision config
    `vision_family` read."""
    from megatron_ext.model.activation_names import hf_activation

    kind = kind_of(cfg)
    cfg = _complete(cfg, kind)
    feature_layer = cfg.get("vision_feature_layer", kind.feature_layer)
    if not isinstance(feature_layer, int):
        raise UserError(f"vision_feature_layer {feature_layer} (several layers) is not supported")
    strategy = cfg.get("vision_feature_select_strategy", kind.select_strategy)
    vision = vision_family(cfg["vision_config"].get("model_type")).read(cfg["vision_config"], feature_layer)
    if strategy == "default" and not vision.class_token:
        raise UserError(f"vision_feature_select_strategy 'default' drops a class token, but {vision.model_type} "
                        "has none; use 'full'")
    if kind.tiled and vision.class_token and strategy == "full":
        raise UserError(f"vision_feature_select_strategy 'full' keeps {vision.model_type}'s class token, which "
                        f"{kind.model_type} cannot lay out in a tile's grid; use 'default'")
    image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
    # transformers ties the output layer to the embedding when either config says so.
    text_config = {**cfg["text_config"],
                   "tie_word_embeddings": bool(cfg.get("tie_word_embeddings") or cfg["text_config"].get("tie_word_embeddings"))}
    return LlavaArch(
        text=text_family(text_config.get("model_type")).read(text_config),
        vision=vision,
        projector_activation=hf_activation(cfg.get("projector_hidden_act", "gelu")),
        projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
        image_token_index=image_token,
        pad_token_id=cfg.get("pad_token_id", text_config.get("pad_token_id")),
        drop_class_token=strategy == "default",
        tiling=_tiling(cfg, kind, vision.image_size),
    )
