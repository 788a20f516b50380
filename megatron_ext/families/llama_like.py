"""What Llama-shaped text families share: RMSNorm, SwiGLU, RoPE, grouped-query attention and
the HF names `LlamaForCausalLM` uses. A family module creates one `LlamaLikeFamily` with the few
things that set it apart (q/k/v bias, per-head q/k norms, a sliding-window default); one whose
models compute more subclasses it and overrides the hooks (`model/family_hooks.py`), as
`gemma3.py` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import get
from megatron_ext.model.arch import TextArch, padded_vocab_size
from megatron_ext.model.mapping_rules import GATED_MLP, HF_LM, LM, QKV, REPLICATED, ROW, Mapping, VocabParallel, row

_ATTN = HF_LM + "self_attn."
# megatron-core's RotaryEmbedding implements llama3 scaling with these constants only.
_LLAMA3_ROPE_CONSTANTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


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
class LlamaLikeFamily:
    model_type: str  # HF config's model_type
    config_class: str  # transformers config class of the family's models
    qkv_bias: bool = False  # bias on q/k/v (not on o_proj) whatever the config says (Qwen2)
    qk_layernorm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3)
    # Whether `sliding_window` applies when the config has no `use_sliding_window` (Mistral).
    sliding_window_by_default: bool = False
    # Bundled chat template (data/chat_templates/) in the family's own format, used when a tokenizer
    # has none; only where every tokenizer of the family holds that format's tokens (not Llama's: a
    # Llama-2 or llm-jp tokenizer has no Llama-3 headers), so elsewhere the language's default.
    chat_template: str | None = None

    def read(self, cfg: Any) -> TextArch:
        """The TextArch of an HF text config of this family, refusing what megatron-core cannot compute."""
        if get(cfg, "hidden_act", "silu") != "silu":
            raise UserError(f"text hidden_act {get(cfg, 'hidden_act')!r} is not supported (only silu / SwiGLU)")
        if get(cfg, "mlp_bias", False):
            raise UserError("text models with mlp_bias=true are not supported")
        if get(cfg, "attention_bias", False) and not self.qkv_bias:
            raise UserError(f"{self.model_type} models with attention_bias=true (bias on o_proj too) are not supported")
        sliding_layers = self._sliding_layers(cfg)
        theta, scaling = rope(cfg)
        return TextArch(
            **self.sizes(cfg),
            rope_theta=theta,
            rope_scaling_factor=scaling,
            qkv_bias=self.qkv_bias,
            qk_layernorm=self.qk_layernorm,
            tie_word_embeddings=bool(get(cfg, "tie_word_embeddings", False)),
            sliding_window=get(cfg, "sliding_window") if any(sliding_layers) else None,
            sliding_layers=sliding_layers,
        )

    def sizes(self, cfg: Any) -> dict:
        """The TextArch fields every decoder's HF config gives under the same names."""
        heads, hidden, vocab = get(cfg, "num_attention_heads"), get(cfg, "hidden_size"), get(cfg, "vocab_size")
        return dict(
            model_type=self.model_type,
            num_layers=get(cfg, "num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=get(cfg, "intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=get(cfg, "num_key_value_heads") or heads,
            kv_channels=get(cfg, "head_dim") or hidden // heads,
            vocab_size=vocab,
            padded_vocab_size=padded_vocab_size(vocab),
            norm_eps=float(get(cfg, "rms_norm_eps", 1e-6)),
            max_position_embeddings=get(cfg, "max_position_embeddings"),
            init_std=float(get(cfg, "initializer_range", 0.02)),
        )

    def _sliding_layers(self, cfg: Any) -> tuple[bool, ...]:
        """Per layer, whether it attends through `sliding_window`: as `layer_types` says (Qwen2 with
        `use_sliding_window`), else every layer when the window applies (Mistral), else none."""
        if get(cfg, "sliding_window") is None or not get(cfg, "use_sliding_window", self.sliding_window_by_default):
            return ()
        layer_types = get(cfg, "layer_types") or ["sliding_attention"] * get(cfg, "num_hidden_layers")
        return tuple(kind == "sliding_attention" for kind in layer_types)

    def language_config(self, t: TextArch) -> dict:
        """megatron-core TransformerConfig fields of the language model (the layer spec follows
        `normalization` and `qk_layernorm`)."""
        from megatron_ext.model.activation_functions import ACTIVATIONS

        # megatron-core's window: (keys before, keys after) a query; HF's counts the query itself.
        window = dict(window_size=(t.sliding_window - 1, 0),
                      window_attn_skip_freq=[int(s) for s in t.sliding_layers]) if any(t.sliding_layers) else {}
        return dict(
            normalization="RMSNorm",
            layernorm_epsilon=t.norm_eps,
            gated_linear_unit=True,
            activation_func=ACTIVATIONS["silu"],
            add_bias_linear=False,
            add_qkv_bias=t.qkv_bias,
            qk_layernorm=t.qk_layernorm,
            **window,
        )

    def language_spec(self, t: TextArch, spec, config, backend: str, vp_stage: int | None):
        """megatron-core's GPT layer as it is: Llama-shaped models need nothing else."""
        return spec

    def after_build(self, t: TextArch, model) -> None:
        """Nothing: megatron-core's LLaVAModel computes a Llama-shaped model as built."""

    def layout_problems(self, t: TextArch, cp: int) -> list[str]:
        """Reasons this family's model cannot run with context parallelism `cp` (none here)."""
        return []

    def rows(self, t: TextArch) -> tuple[list[Mapping], list[Mapping]]:
        """(tensors held once, tensors of every layer `*`) of the language model."""
        vocab = VocabParallel(t.vocab_size, t.padded_vocab_size)
        qkv = QKV(t.num_attention_heads, t.num_query_groups, t.kv_channels)
        projections = tuple(_ATTN + f"{p}_proj." for p in "qkv")
        layer = [
            row(LM + "self_attention.linear_qkv.layer_norm_weight", HF_LM + "input_layernorm.weight", REPLICATED),
            row(LM + "self_attention.linear_qkv.weight", tuple(p + "weight" for p in projections), qkv),
            row(LM + "self_attention.linear_proj.weight", _ATTN + "o_proj.weight", ROW),
            row(LM + "mlp.linear_fc1.layer_norm_weight", HF_LM + "post_attention_layernorm.weight", REPLICATED),
            row(LM + "mlp.linear_fc1.weight", (HF_LM + "mlp.gate_proj.weight", HF_LM + "mlp.up_proj.weight"), GATED_MLP),
            row(LM + "mlp.linear_fc2.weight", HF_LM + "mlp.down_proj.weight", ROW),
        ]
        if t.qkv_bias:
            layer.append(row(LM + "self_attention.linear_qkv.bias", tuple(p + "bias" for p in projections), qkv))
        if t.qk_layernorm:
            layer += [row(LM + "self_attention.q_layernorm.weight", _ATTN + "q_norm.weight", REPLICATED),
                      row(LM + "self_attention.k_layernorm.weight", _ATTN + "k_norm.weight", REPLICATED)]
        embed = "language_model.model.embed_tokens.weight"
        once = [
            row("language_model.embedding.word_embeddings.weight", embed, vocab),
            row("language_model.decoder.final_layernorm.weight", "language_model.model.norm.weight", REPLICATED),
            # With tied embeddings only the last pipeline stage has its own copy of this tensor.
            row("language_model.output_layer.weight", embed if t.tie_word_embeddings else "language_model.lm_head.weight",
                vocab, tied=t.tie_word_embeddings),
        ]
        return once, layer
