"""What a Hugging Face LLaVA config means for megatron-core, checked once.

`LlavaArch.from_hf_config` reads an HF `LlavaConfig` (object or config.json dict) and derives every
number the Megatron model needs, refusing what megatron-core cannot compute exactly; the text and
vision parts are read by their family (`megatron_ext.families`). Everything
downstream (model provider, converters, trainer) reads these dataclasses, never the HF config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from megatron_ext.errors import UserError

# Megatron's vocab is padded to a TP-independent multiple so checkpoints reshard across TP sizes.
VOCAB_MULTIPLE = 128
# megatron-core's RotaryEmbedding implements llama3 scaling with these constants only.
_LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _as_dict(cfg: Any) -> dict:
    return cfg if isinstance(cfg, dict) else cfg.to_dict()


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
    # What Gemma-style models add (the defaults are Llama's):
    gated_activation: str = "silu"  # key of model.activations.ACTIVATIONS, applied to the gate
    norm_plus_one: bool = False  # RMSNorm scales by (1 + weight)
    post_norms: bool = False  # an RMSNorm on the attention and MLP outputs before each residual add
    embedding_scale: float | None = None  # text token embeddings are multiplied by it
    softmax_scale: float | None = None  # None: 1 / sqrt(kv_channels)
    sliding_window: int | None = None  # keys a query sees in a sliding layer, itself included
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it slides (empty: none does)
    sliding_rope_theta: float | None = None  # RoPE base of sliding layers when it differs from rope_theta
    rope_linear_factor: float | None = None  # full layers' positions divided by it (HF rope_type "linear")

    @property
    def layer_ropes(self) -> bool:
        """Whether layers compute their own RoPE (`model/layer_rope.py`) instead of sharing one."""
        return self.sliding_rope_theta is not None or self.rope_linear_factor is not None

    @classmethod
    def from_hf(cls, cfg: Any) -> "TextArch":
        from megatron_ext.families import text_family

        return text_family(get(cfg, "model_type")).read(cfg)


def rope(cfg: Any) -> tuple[float, float | None]:
    """(theta, llama3 scaling factor or None) from transformers 5 `rope_parameters` or older keys."""
    params = get(cfg, "rope_parameters") or {}
    legacy = get(cfg, "rope_scaling") or {}
    theta = float(params.get("rope_theta", get(cfg, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise UserError(f"RoPE scaling type {rope_type!r} is not supported (supported: default, llama3)")
    source = params if params.get("rope_type") == "llama3" else legacy
    for key, expected in _LLAMA3_ROPE_CONSTANTS.items():
        if float(source.get(key, expected)) != expected:
            raise UserError(f"llama3 RoPE scaling with {key}={source[key]} is not supported (megatron-core uses {expected})")
    return theta, float(source["factor"])


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
    activation: str  # key of megatron_ext.model.activations.ACTIVATIONS
    class_token: bool
    init_std: float
    layer_scale: bool = False  # a learned scale on each layer's attention and MLP outputs (InternViT)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @classmethod
    def from_hf(cls, cfg: Any, feature_layer: int) -> "VisionArch":
        from megatron_ext.families import vision_family

        return vision_family(get(cfg, "model_type")).read(cfg, feature_layer)


@dataclass(frozen=True)
class LlavaArch:
    text: TextArch
    vision: VisionArch
    projector_activation: str
    projector_bias: bool
    image_token_index: int
    pad_token_id: int | None
    drop_class_token: bool

    @property
    def img_seq_len(self) -> int:
        """Image embeddings the language model sees per image."""
        keep_cls = self.vision.class_token and not self.drop_class_token
        return self.vision.num_patches + int(keep_cls)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "LlavaArch":
        from megatron_ext.model.activation_names import hf_activation

        cfg = _as_dict(cfg)
        if cfg.get("model_type") != "llava":
            raise UserError(f"model_type {cfg.get('model_type')!r} is not supported (supported: llava)")
        feature_layer = cfg.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int):
            raise UserError(f"vision_feature_layer {feature_layer} (several layers) is not supported")
        strategy = cfg.get("vision_feature_select_strategy", "default")
        vision = VisionArch.from_hf(cfg["vision_config"], feature_layer)
        if strategy == "default" and not vision.class_token:
            raise UserError(f"vision_feature_select_strategy 'default' drops a class token, but {vision.model_type} "
                            "has none; use 'full'")
        image_token = cfg.get("image_token_index", cfg.get("image_token_id"))
        return cls(
            text=TextArch.from_hf(cfg["text_config"]),
            vision=vision,
            projector_activation=hf_activation(cfg.get("projector_hidden_act", "gelu")),
            projector_bias=bool(cfg.get("multimodal_projector_bias", True)),
            image_token_index=image_token,
            pad_token_id=cfg.get("pad_token_id", cfg["text_config"].get("pad_token_id")),
            drop_class_token=strategy == "default",
        )

    def parallel_problems(self, tp: int, pp: int) -> list[str]:
        """Every reason this model cannot be split `tp` x `pp` ways (empty when it can)."""
        t, v = self.text, self.vision
        checks = [
            ("text attention heads", t.num_attention_heads, tp),
            ("text KV heads (num_key_value_heads)", t.num_query_groups, tp),
            ("text FFN size (intermediate_size)", t.ffn_hidden_size, tp),
            ("padded vocabulary", t.padded_vocab_size, tp),
            ("vision attention heads", v.num_attention_heads, tp),
            ("vision FFN size", v.ffn_hidden_size, tp),
            ("text hidden size (projector)", t.hidden_size, tp),
            ("text layers", t.num_layers, pp),
        ]
        problems = []
        for what, value, size in checks:
            if size < 1:
                problems.append(f"parallel size must be >= 1, got {size}")
            elif value % size:
                flag = "--pp" if what == "text layers" else "--tp"
                problems.append(f"{flag} {size} does not divide the {what} ({value})")
        return problems

    def check_parallel(self, tp: int, pp: int) -> None:
        problems = self.parallel_problems(tp, pp)
        if problems:
            raise UserError("; ".join(problems))

    def summary(self) -> dict:
        return {"text": asdict(self.text), "vision": asdict(self.vision), "img_seq_len": self.img_seq_len}
