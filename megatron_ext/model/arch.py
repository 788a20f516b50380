"""What a LLaVA model is, as numbers: pure data, read from a Hugging Face config by its families.

`megatron_ext.families.read_llava` reads an HF LLaVA config (object or config.json dict), lets the
text model's and the vision tower's families read their parts, and refuses what megatron-core
cannot compute exactly. Everything downstream (model provider, converters, trainer) reads these
dataclasses, never the HF config. A family whose models need more numbers than these subclasses
`TextArch` / `VisionArch` in its own module.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_ext.errors import UserError

# Megatron's vocab is padded to a TP-independent multiple so checkpoints reshard across TP sizes.
VOCAB_MULTIPLE = 128


def padded_vocab_size(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclass(frozen=True)
class TextArch:
    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int  # rows of the HF embedding
    padded_vocab_size: int  # rows of the Megatron embedding
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # llama3-style scaling, None when absent
    qkv_bias: bool
    qk_layernorm: bool  # RMSNorm over each head's query and key
    tie_word_embeddings: bool
    max_position_embeddings: int
    init_std: float
    sliding_window: int | None = None  # keys a query sees in a sliding layer, itself included
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it slides (empty: none does)


@dataclass(frozen=True)
class VisionArch:
    model_type: str
    subtype: str  # megatron-core CLIPViTModel subtype
    num_layers: int  # layers up to the feature layer; the ones after it are never used by LLaVA
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    norm_eps: float
    activation: str  # key of megatron_ext.model.activation_functions.ACTIVATIONS
    class_token: bool
    init_std: float

    @property
    def patches_per_side(self) -> int:
        # transformers' patch convolution has no padding: the pixels past the last whole patch are
        # never seen (SigLIP so400m-patch14-384: 27 patches, 6 pixels left over per side).
        return self.image_size // self.patch_size

    @property
    def patched_size(self) -> int:
        """The pixels per side the patches cover: `image_size` where it is a multiple of the patch."""
        return self.patches_per_side * self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2


@dataclass(frozen=True)
class TilingArch:
    """How a LLaVA-NeXT / OneVision model sees an image: resized into one of `grid_pinpoints`,
    cut into tiles of the tower's size, after a base tile of the whole image; features unpadded,
    a learned newline after every row. Videos are frames of one tile each, pooled 2x2."""

    grid_pinpoints: tuple[tuple[int, int], ...]  # (height, width) resolutions, multiples of the tile size
    max_tiles: int | None  # anyres_max_N: larger grids are downsampled to about N tiles' features; None: never
    video_token_index: int | None  # None: the model takes no video


def text_parallel_checks(t: TextArch, tp: int, pp: int) -> list[tuple[str, int, int]]:
    """(what, its size, the parallel size that must divide it) of a megatron-core GPT decoder."""
    return [
        ("text attention heads", t.num_attention_heads, tp),
        ("text KV heads (num_key_value_heads)", t.num_query_groups, tp),
        ("text FFN size (intermediate_size)", t.ffn_hidden_size, tp),
        ("padded vocabulary", t.padded_vocab_size, tp),
        ("text layers", t.num_layers, pp),
    ]


def divisibility_problems(checks: list[tuple[str, int, int]]) -> list[str]:
    """One line per check whose parallel size does not divide its size (`--pp` for the layers)."""
    problems = []
    for what, value, size in checks:
        if size < 1:
            problems.append(f"parallel size must be >= 1, got {size}")
        elif value % size:
            flag = "--pp" if what == "text layers" else "--tp"
            problems.append(f"{flag} {size} does not divide the {what} ({value})")
    return problems


@dataclass(frozen=True)
class LlavaArch:
    text: TextArch
    vision: VisionArch
    projector_activation: str
    projector_bias: bool
    image_token_index: int
    pad_token_id: int | None
    drop_class_token: bool
    tiling: TilingArch | None = None  # None: LLaVA-1.5, one tile per image

    @property
    def img_seq_len(self) -> int:
        """Language-model positions per image token. A tiled model's inputs carry one image token
        per feature already (as HF's processor expands them), so each is one position."""
        if self.tiling is not None:
            return 1
        keep_cls = self.vision.class_token and not self.drop_class_token
        return self.vision.num_patches + int(keep_cls)

    @property
    def smallest_image_positions(self) -> int:
        """Fewest language-model positions an image takes: LLaVA-1.5's `img_seq_len`; a tiled
        model's image at least one tile's features and its newline (OneVision's image among several)."""
        if self.tiling is None:
            return self.img_seq_len
        return self.vision.num_patches + 1

    def parallel_problems(self, tp: int, pp: int) -> list[str]:
        """Every reason this model cannot be split `tp` x `pp` ways (empty when it can)."""
        v = self.vision
        return divisibility_problems(text_parallel_checks(self.text, tp, pp) + [
            ("vision attention heads", v.num_attention_heads, tp),
            ("vision FFN size", v.ffn_hidden_size, tp),
            ("text hidden size (projector)", self.text.hidden_size, tp),
        ])

    def check_parallel(self, tp: int, pp: int) -> None:
        problems = self.parallel_problems(tp, pp)
        if problems:
            raise UserError("; ".join(problems))

    def summary(self) -> dict:
        return {"text": asdict(self.text), "vision": asdict(self.vision), "img_seq_len": self.img_seq_len}
