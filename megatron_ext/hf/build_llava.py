"""Assemble a Hugging Face LLaVA from a text model and a vision tower: `LlavaForConditionalGeneration`
(LLaVA-1.5, the default), `LlavaNextForConditionalGeneration` or `LlavaOnevisionForConditionalGeneration`
(`arch`, the names of `families.llava_kinds()`).

What it does, in order:
1. loads the text model's config and tokenizer, and the vision tower's config and image processor;
2. adds `<image>` (`<video>` for OneVision, and `<pad>` when the tokenizer has no pad token) as
   special tokens;
3. builds the LLaVA skeleton on the meta device and moves the pretrained text and vision weights
   into it (so the big text model is held in memory once), with a freshly initialised 2-layer GELU
   projector mapping the vision hidden size to the text hidden size (and, for tiled models, a
   fresh `image_newline`);
4. resizes the embedding and LM head to the tokenizer (to a multiple of 128 with vocab padding);
5. writes model, tokenizer and processor (tiled models: the anyres image processor with the
   tower's settings and the grid; OneVision: a video processor with the tower's frame settings)
   through a temporary directory.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

from megatron_ext import hf_loading
from megatron_ext.data.chat_template import processor_template
from megatron_ext.errors import UserError
from megatron_ext.families import llava_kinds, vision_tower
from megatron_ext.families.llava import IMAGE_TOKEN
from megatron_ext.fsutil import atomic_output_dir, check_output_dir
from megatron_ext.hf.processors import build_processor, save_processor
from megatron_ext.model.arch import VOCAB_MULTIPLE

log = logging.getLogger(__name__)

# LLaVA-1.5's vision tower, also the original toolkit's default.
DEFAULT_VISION_MODEL = "openai/clip-vit-large-patch14-336"
PAD_TOKEN = "<pad>"


def add_special_tokens(tokenizer, media_tokens: tuple[str, ...] = (IMAGE_TOKEN,)) -> tuple[int, int]:
    """Add `media_tokens` (`<image>`, ...) and, if the tokenizer has none, a `<pad>` token.
    Returns (image_id, pad_id)."""
    missing = [token for token in media_tokens if token not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_special_tokens({"additional_special_tokens": missing}, replace_extra_special_tokens=False)
    if tokenizer.pad_token is None:
        if PAD_TOKEN not in tokenizer.get_vocab():
            tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        else:
            tokenizer.pad_token = PAD_TOKEN
    return tokenizer.convert_tokens_to_ids(IMAGE_TOKEN), tokenizer.pad_token_id


# The tower's image processor settings a tiled model's anyres image processor keeps.
_IMAGE_PROCESSOR_FIELDS = ("size", "crop_size", "do_convert_rgb", "do_resize", "resample", "do_rescale",
                           "rescale_factor", "do_normalize", "image_mean", "image_std")


@contextlib.contextmanager
def _transformers_quiet():
    """transformers' log kept to errors for the calls inside."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _anyres_image_processor(kind, tower_processor, pinpoints: list[list[int]]):
    """The tiled model's image processor (its PIL one: the torchvision ones need torchvision),
    resizing, cropping and normalising tiles as the tower's own does."""
    import transformers

    settings = tower_processor.to_dict()
    fields = {key: settings[key] for key in _IMAGE_PROCESSOR_FIELDS if settings.get(key) is not None}
    return getattr(transformers, kind.image_processor_class)(
        **fields, do_center_crop=bool(settings.get("do_center_crop")), image_grid_pinpoints=pinpoints)


def parse_pinpoints(text: str) -> list[list[int]]:
    """--image-grid-pinpoints "672x336,336x672" -> [[672, 336], [336, 672]] ((height, width) each)."""
    try:
        pinpoints = [[int(n) for n in item.lower().split("x")] for item in text.split(",")]
    except ValueError:
        pinpoints = []
    if not pinpoints or any(len(p) != 2 or min(p) <= 0 for p in pinpoints):
        raise UserError(f"--image-grid-pinpoints {text!r} is not a list of HEIGHTxWIDTH sizes (e.g. 672x336,336x672)")
    return pinpoints


def _resolve_dtype(dtype: str, text_config):
    import torch

    if dtype == "auto":
        stored = getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)
        if isinstance(stored, torch.dtype):
            return stored
        return getattr(torch, stored) if isinstance(stored, str) else torch.float32
    from megatron_ext.model.provider import DTYPES

    return DTYPES[dtype]


def _load_tower(tower, source: str, whole: bool, dtype):
    """The tower's weights from a tower checkpoint or a whole one (`whole`), refusing one that lacks
    any: transformers would initialise those at random with only a warning."""
    import transformers

    # Towers transformers cannot load from a whole checkpoint by itself are found under their prefix.
    mapping = {"key_mapping": {"^" + re.escape(tower.tower_prefix): ""}} if whole and tower.tower_prefix else {}
    model, info = hf_loading.load_pretrained(getattr(transformers, tower.model_class), source, "--vision-model",
                                          dtype=dtype, output_loading_info=True, **mapping)
    missing = sorted(info["missing_keys"])
    if missing:
        raise UserError(f"--vision-model {source}: the checkpoint lacks {len(missing)} of the {tower.model_class} tensors "
                        f"(e.g. {missing[0]}); give a {tower.model_type} or {tower.full_model_type} checkpoint")
    return model


def build_llava(
    save_dir: str | Path,
    text_model: str,
    vision_model: str = DEFAULT_VISION_MODEL,
    vocab_size_padding: bool = False,
    force: bool = False,
    dtype: str = "auto",
    seed: int = 0,
    arch: str = "llava",
    image_grid_pinpoints: list[list[int]] | None = None,
    anyres_max: int = 9,
) -> Path:
    """Write a LLaVA checkpoint + tokenizer + processor to `save_dir`; returns its path.
    `image_grid_pinpoints` (tiled archs; default: the published models' grids of the tower's image
    size) and `anyres_max` (OneVision's vision_aspect_ratio anyres_max_N)."""
    import math

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    kinds = llava_kinds()
    if arch not in kinds:
        raise UserError(f"--arch {arch!r} is not supported (supported: {', '.join(kinds)})")
    kind = kinds[arch]
    if anyres_max < 1:
        raise UserError(f"--anyres-max {anyres_max} must be at least 1")
    save_dir = check_output_dir(save_dir, force, "--save-dir")

    text_config = hf_loading.load_config(text_model, "--text-model")
    tokenizer = hf_loading.load_tokenizer(text_model, "--text-model")
    loaded_config = hf_loading.load_config(vision_model, "--vision-model")
    found = vision_tower(loaded_config, "--vision-model")
    vision_config, tower = found.config, found.family
    image_processor = hf_loading.load_image_processor(vision_model, "--vision-model")
    torch_dtype = _resolve_dtype(dtype, text_config)

    image_token_id, pad_token_id = add_special_tokens(tokenizer, kind.special_tokens)
    tower_arch = tower.read(vision_config, tower.feature_layer)
    num_patches = tower_arch.num_patches
    image_seq_length = num_patches + (tower.extra_tokens if tower.select_strategy == "full" else 0)
    pinpoints = image_grid_pinpoints or kind.default_pinpoints(tower_arch.image_size)
    if kind.tiled and any(h % tower_arch.image_size or w % tower_arch.image_size for h, w in pinpoints):
        raise UserError(f"--image-grid-pinpoints {pinpoints} are not multiples of the tower's image size "
                        f"{tower_arch.image_size}")
    token_ids = {token: tokenizer.convert_tokens_to_ids(token) for token in kind.special_tokens}

    text = hf_loading.load_pretrained(AutoModelForCausalLM, text_model, "--text-model", dtype=torch_dtype)
    vision = _load_tower(tower, vision_model, found.whole, torch_dtype)

    config = getattr(transformers, kind.config_class)(
        text_config=text.config.to_dict(),
        vision_config=vision.config.to_dict(),
        image_token_index=image_token_id,
        projector_hidden_act="gelu",
        vision_feature_layer=tower.feature_layer,
        vision_feature_select_strategy=tower.select_strategy,
        multimodal_projector_bias=True,
        tie_word_embeddings=bool(text.config.tie_word_embeddings),
        **kind.config_fields(image_seq_length, pinpoints, anyres_max, token_ids),
    )

    with torch.device("meta"):
        llava = getattr(transformers, kind.model_class)(config)
    llava.model.language_model.load_state_dict(text.model.state_dict(), assign=True)
    llava.lm_head.load_state_dict(text.lm_head.state_dict(), assign=True)
    llava.model.vision_tower.load_state_dict(vision.state_dict(), assign=True)
    torch.manual_seed(seed)
    llava.model.multi_modal_projector = type(llava.model.multi_modal_projector)(config).to(torch_dtype)
    if kind.tiled:
        hidden = config.text_config.hidden_size
        # As transformers initialises it.
        llava.model.image_newline = torch.nn.Parameter(torch.randn(hidden, dtype=torch_dtype) / math.sqrt(hidden))
    if config.tie_word_embeddings:
        llava.lm_head.weight = llava.model.language_model.embed_tokens.weight
    del text, vision

    # Rows for the added tokens start from the mean of the existing ones; padding rows are added
    # in a second step so they never change the rows (and logits) of tokens the tokenizer has.
    with _transformers_quiet():  # it announces the mean resizing asked for here, twice (embeddings, LM head)
        llava.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    if vocab_size_padding:
        llava.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=VOCAB_MULTIPLE, mean_resizing=False)
    # Only now is the pad id inside the (resized) vocabulary.
    llava.config.pad_token_id = pad_token_id
    llava.config.text_config.pad_token_id = pad_token_id
    llava.generation_config.pad_token_id = pad_token_id
    llava.generation_config.eos_token_id = tokenizer.eos_token_id
    llava.generation_config.bos_token_id = tokenizer.bos_token_id

    processor = build_processor(
        kind, _anyres_image_processor(kind, image_processor, pinpoints) if kind.tiled else image_processor, tokenizer,
        **kind.processor_fields(tower_arch.patch_size, num_patches, tower.extra_tokens, tower.select_strategy, anyres_max),
        # Wrapped so that HF's structured messages render as training renders them (lmms-eval, vLLM).
        chat_template=processor_template(tokenizer.chat_template, tokenizer) if tokenizer.chat_template else None,
    )

    with atomic_output_dir(save_dir) as tmp:
        llava.save_pretrained(tmp)
        save_processor(processor, kind, tmp)
    log.info(
        "wrote %s (%s): vocab %d (tokenizer %d), <image>=%d, <pad>=%d, vision %s, feature layer %d (%s)",
        save_dir, kind.model_class, llava.config.text_config.vocab_size, len(tokenizer), image_token_id, pad_token_id,
        vision_config.model_type, tower.feature_layer, tower.select_strategy,
    )
    return save_dir
