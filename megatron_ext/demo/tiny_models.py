"""Tiny random Hugging Face models for tests and the CPU demo; nothing is downloaded.

The weights are random, but everything else is what a real checkpoint has: configs, safetensors,
a BPE tokenizer trained here with `tokenizers` (with a chat template), and image processors. They
load with the ordinary `from_pretrained` calls, so the code under test is the real loading code.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_ext.data.chat_template import TEMPLATE_DIR
from megatron_ext.demo.tiny_presets import DEFAULT_TEXT_ARCH, TEXT_PRESETS, TOWER_PRESETS

# Renders string content, or HF multimodal content lists ({"type": "image"} / {"type": "text"}).
# `{% generation %}` marks assistant text so HF can return assistant-token masks.
CHAT_TEMPLATE = (
    "{% macro render(content) %}"
    "{% if content is string %}{{ content }}"
    "{% else %}{% for part in content %}"
    "{% if part['type'] == 'image' %}{{ '<image>\n' }}{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% endmacro %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ render(message['content']) + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ render(message['content']) + '<|end|>' }}{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TokenizerFormat:
    """A tiny tokenizer's special tokens (in vocabulary order) and chat template, as a model family's."""

    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    unk: str | None
    pad: str | None
    additional: tuple[str, ...]
    chat_template: str


TOKENIZER_FORMATS = {
    # Role markers and end-of-turn are single special tokens, as in current chat models; the tokenizer
    # adds its BOS (as Llama's do).
    "roles": TokenizerFormat(("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
                             bos="<s>", eos="<|end|>", unk="<unk>", pad=None,
                             additional=("<|system|>", "<|user|>", "<|assistant|>"), chat_template=CHAT_TEMPLATE),
    # Qwen2's: ChatML's tokens, no BOS, <|endoftext|> pads, ChatML without {% generation %} markers.
    "chatml": TokenizerFormat(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None, eos="<|im_end|>",
                              unk=None, pad="<|endoftext|>", additional=("<|im_start|>",),
                              chat_template=(TEMPLATE_DIR / "chatml.jinja").read_text()),
}

_CORPUS = [
    "A photo of a cat sitting on a red sofa next to a window.",
    "Two dogs are running across a green field under a blue sky.",
    "What is in this image? Describe the picture in detail.",
    "The image shows a bowl of fruit with apples, bananas and oranges.",
    "A man is riding a bicycle down a busy street in the city.",
    "Question: how many people are in the picture? Answer: three.",
    "The quick brown fox jumps over the lazy dog.",
    "この画像には何が写っていますか？",
    "赤いソファの上に猫が座っています。",
    "青い空の下で二匹の犬が走っています。",
    "画像を詳しく説明してください。",
    "これは果物の入ったボウルの写真です。",
    "colors: red green blue yellow black white purple orange brown gray",
    "shapes: circle square triangle rectangle star line dot",
    "numbers: zero one two three four five six seven eight nine ten",
]


def _corpus() -> list[str]:
    """The fixed sentences plus every word pair of them, enough text for ~1000 BPE merges."""
    words = sorted({w for line in _CORPUS for w in line.split()})
    pairs = [f"{a} {b}" for a in words for b in words[:40]]
    return _CORPUS * 4 + pairs


@dataclass(frozen=True)
class TinyTextSpec:
    """Shape of the tiny text model. Defaults give GQA (4 query heads, 2 KV heads)."""

    arch: str = DEFAULT_TEXT_ARCH  # a text family's model_type, a key of TEXT_PRESETS
    vocab_size: int = 1000
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    tokenizer: str = "roles"  # a key of TOKENIZER_FORMATS
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    # Larger than the usual 0.02 so logits differ visibly and parity tests can tell models apart.
    initializer_range: float = 0.1


@dataclass(frozen=True)
class TinyVisionSpec:
    hidden_size: int = 32
    num_layers: int = 3
    num_heads: int = 4
    intermediate_size: int = 64
    image_size: int | None = None  # None: the tower preset's
    patch_size: int = 14


def train_tokenizer(vocab_size: int, format_name: str = "roles"):
    """A byte-level BPE tokenizer trained on a small English/Japanese corpus, with the special tokens
    and chat template of `format_name` (a key of TOKENIZER_FORMATS)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    form = TOKENIZER_FORMATS[format_name]
    tok = Tokenizer(models.BPE(unk_token=form.unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(form.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if form.bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{form.bos} $A", pair=f"{form.bos} $A {form.bos} $B", special_tokens=[(form.bos, tok.token_to_id(form.bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=form.bos,
        eos_token=form.eos,
        unk_token=form.unk,
        pad_token=form.pad,
        additional_special_tokens=list(form.additional),
    )
    fast.chat_template = form.chat_template
    return fast


def _seeded(seed: int):
    torch.manual_seed(seed)


def tiny_text_config(arch: str, **fields):
    """A transformers config of the text family `arch` with `fields` (sizes, vocab, special tokens)
    and the family's tiny preset over them."""
    import transformers

    from megatron_ext.families import text_family

    preset = TEXT_PRESETS[arch]
    derived = preset.fields_of(fields) if preset.fields_of else {}
    # A copy: transformers may change the nested dicts it is given, and the preset is shared.
    fields = {**fields, **copy.deepcopy(preset.fields), **derived, "rms_norm_eps": preset.norm_eps}
    return getattr(transformers, text_family(arch).config_class)(**fields)


def make_text_model(save_dir: Path, spec: TinyTextSpec = TinyTextSpec(), seed: int = 0) -> Path:
    """Write a random causal LM of family `spec.arch` and its tokenizer to `save_dir`."""
    tokenizer = train_tokenizer(spec.vocab_size, spec.tokenizer)
    config = tiny_text_config(
        spec.arch,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=spec.initializer_range,
    )
    return _save_text_model(save_dir, config, tokenizer, seed)


def make_text_model_like(save_dir: Path, text_config: dict, seed: int = 0,
                         initializer_range: float = TinyTextSpec.initializer_range) -> Path:
    """Write a random causal LM of the published `text_config` (a config.json's fields: every size and
    setting as given), with the local tokenizer, whose length becomes the vocabulary size."""
    from transformers import AutoConfig

    tokenizer = train_tokenizer(TinyTextSpec.vocab_size)
    fields = {**text_config, "vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": None, "initializer_range": initializer_range}
    return _save_text_model(save_dir, AutoConfig.for_model(**fields), tokenizer, seed)


def _save_text_model(save_dir: Path, config, tokenizer, seed: int) -> Path:
    from transformers import AutoModelForCausalLM, GenerationConfig

    _seeded(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = TEXT_PRESETS[config.model_type].weights
    if weights:
        weights(model)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir


def make_vision_model(save_dir: Path, kind: str, spec: TinyVisionSpec = TinyVisionSpec(), seed: int = 0) -> Path:
    """Write a random vision tower and its image processor to `save_dir`; `kind` names a tower
    family by the model_type of the whole checkpoints holding it (clip, siglip, internvl)."""
    from megatron_ext.families import vision_families

    towers = {f.full_model_type: f for f in vision_families().values()}
    if kind not in towers:
        raise ValueError(f"unknown tiny vision tower {kind!r} ({', '.join(sorted(towers))})")
    tower = towers[kind]
    fields = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        patch_size=spec.patch_size,
    )
    return _save_tower(save_dir, tower, fields, spec.image_size or TOWER_PRESETS[kind].image_size, seed)


def make_vision_model_like(save_dir: Path, vision_config: dict, seed: int = 0) -> Path:
    """Write a random tower of the published `vision_config` (its family's, every size as given) and
    its family's image processor at the config's image size."""
    from megatron_ext.families import vision_family

    fields = {k: v for k, v in vision_config.items() if k not in ("model_type", "image_size")}
    size = vision_config["image_size"]
    return _save_tower(save_dir, vision_family(vision_config["model_type"]), fields,
                       size[0] if isinstance(size, (list, tuple)) else size, seed)


def tiny_tower(tower, fields: dict, image_size: int):
    """(random tower of the family `tower` with config `fields` and its tiny preset (the preset's
    activation unless `fields` name one), its image processor)."""
    import transformers

    preset = TOWER_PRESETS[tower.full_model_type]
    config = getattr(transformers, tower.config_class)(
        **{"hidden_act": preset.hidden_act, **fields, **copy.deepcopy(preset.fields)}, image_size=image_size)
    model = getattr(transformers, tower.model_class)(config)
    if preset.weights:
        preset.weights(model)
    return model, tower.image_processor(image_size)


def _save_tower(save_dir: Path, tower, fields: dict, image_size: int, seed: int) -> Path:
    _seeded(seed)
    model, processor = tiny_tower(tower, fields, image_size)
    model.save_pretrained(save_dir)
    processor.save_pretrained(save_dir)
    return save_dir


def make_all(save_dir: Path, text_spec: TinyTextSpec = TinyTextSpec(), seed: int = 0) -> dict[str, Path]:
    """The folders the demo and tests use: text, and vision-NAME for every tower family NAME
    (vision-clip, vision-siglip, vision-internvl)."""
    from megatron_ext.families import vision_families

    save_dir = Path(save_dir)
    made = {"text": make_text_model(save_dir / "text", text_spec, seed)}
    for i, kind in enumerate(sorted(f.full_model_type for f in vision_families().values()), start=1):
        made[f"vision-{kind}"] = make_vision_model(save_dir / f"vision-{kind}", kind, seed=seed + i)
    return made


# A tiny Qwen2.5-VL: a 2-layer decoder with GQA and mRoPE sections (T 2, H 3, W 3 of a head's 8
# frequency channels), a 2-block tower with 56-pixel windows and one full-attention block.
QWEN2_5_VL_TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 128, "head_dim": 16, "max_position_embeddings": 1024,
                   "initializer_range": TinyTextSpec.initializer_range,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}
# The towers' output width is the decoder's (`make_qwen_vl` sets it).
QWEN2_5_VL_VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                     "fullatt_block_indexes": [1], "window_size": 56, "tokens_per_second": 4}
# A tiny Qwen3-VL: the same decoder (its sections interleaved over the channels, as Qwen3-VL's are),
# a 2-block tower of 16-pixel patches with an 8 x 8 learned position grid, and the first block's
# DeepStack feature added after the first decoder layer.
QWEN3_VL_TEXT = QWEN2_5_VL_TEXT
QWEN3_VL_VISION = {"depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                   "deepstack_visual_indexes": [0], "num_position_embeddings": 64}
QWEN_VL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# family: (config class, model class, its decoder's and tower's tiny configs)
QWEN_VL_MODELS = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", QWEN2_5_VL_TEXT,
                                 QWEN2_5_VL_VISION),
                  "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", QWEN3_VL_TEXT, QWEN3_VL_VISION)}


def make_qwen_vl(save_dir: Path, family: str = "qwen2_5_vl", seed: int = 0, text_fields: dict | None = None) -> Path:
    """Write a random Qwen2.5-VL or Qwen3-VL (`family`) with the byte-level BPE tokenizer in ChatML's
    format (no BOS, <|im_end|> ends a turn) and Qwen-VL's vision tokens added after it;
    `text_fields` over the decoder's tiny config (bench/generate_bench.py's wider one)."""
    import transformers

    config_class, model_class, text_config, vision_config = QWEN_VL_MODELS[family]
    tokenizer = train_tokenizer(400, "chatml")
    tokenizer.add_tokens(list(QWEN_VL_TOKENS), special_tokens=True)
    image, video, start, end = tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    special = {"bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    # The vocabulary rounded up to a multiple of 64, as published checkpoints pad theirs.
    text = {**copy.deepcopy(text_config), **(text_fields or {}), "vocab_size": -(-len(tokenizer) // 64) * 64, **special}
    config = getattr(transformers, config_class)(
        text_config=text, vision_config={**copy.deepcopy(vision_config), "out_hidden_size": text["hidden_size"]},
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        tie_word_embeddings=False, **special)
    _seeded(seed)
    model = getattr(transformers, model_class)(config)
    model.generation_config = transformers.GenerationConfig(**special)
    model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir
