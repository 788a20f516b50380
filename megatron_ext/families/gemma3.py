"""Gemma 3 text (`gemma3_text`, e.g. google/gemma-3-1b-it): a Llama-shaped decoder with
- (1 + weight) RMSNorms in float32, also over each head's q and k (`model/norms.py`, TE's
  `layernorm_zero_centered_gamma`),
- a norm after attention and after the MLP, before each residual add (`model/output_step.py`;
  HF's `post_attention_layernorm` is that one here, `pre_feedforward_layernorm` the MLP's input norm),
- text embeddings scaled by sqrt(hidden_size), GeGLU (tanh GELU), attention scaled by
  `query_pre_attn_scalar ** -0.5`, tied embeddings,
- sliding-window layers (`layer_types`) with their own RoPE base, full layers with theirs and
  optionally linear position scaling (`model/layer_rope.py`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from megatron_ext.errors import UserError
from megatron_ext.families.hf_config import get
from megatron_ext.families.llama_like import LlamaLikeFamily
from megatron_ext.model.arch import TextArch
from megatron_ext.model.mapping_rules import HF_LM, LM, REPLICATED, Mapping, row


def _rope(params: dict, what: str) -> tuple[float, float | None]:
    """(theta, linear factor or None) of one layer type's RoPE."""
    kind = params.get("rope_type", "default")
    if kind == "default":
        return float(params["rope_theta"]), None
    if kind == "linear" and what == "full_attention":
        return float(params["rope_theta"]), float(params["factor"])
    raise UserError(f"gemma3_text RoPE {kind!r} on {what} layers is not supported (supported: default; linear on "
                    "full_attention layers)")


@dataclass(frozen=True, kw_only=True)
class Gemma3Arch(TextArch):
    """What Gemma 3 adds to the numbers of a text model."""

    query_pre_attn_scalar: float  # attention scores are scaled by its -1/2 power
    sliding_rope_theta: float  # RoPE base of sliding layers (rope_theta: full layers')
    rope_linear_factor: float | None  # full layers' positions divided by it (HF rope_type "linear")


@dataclass(frozen=True)
class Gemma3Family(LlamaLikeFamily):
    def read(self, cfg: Any) -> Gemma3Arch:
        refusals = [
            (get(cfg, "hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh",
             f"hidden_activation {get(cfg, 'hidden_activation')!r}"),
            (get(cfg, "attn_logit_softcapping") is not None, "attn_logit_softcapping (Gemma 2's)"),
            (get(cfg, "final_logit_softcapping") is not None, "final_logit_softcapping (Gemma 2's)"),
            (get(cfg, "use_bidirectional_attention", False), "use_bidirectional_attention=true"),
            (get(cfg, "attention_bias", False), "attention_bias=true"),
        ]
        for refused, what in refusals:
            if refused:
                raise UserError(f"gemma3_text models with {what} are not supported")
        params = get(cfg, "rope_parameters") or {}
        full_theta, factor = _rope(params.get("full_attention") or {"rope_theta": get(cfg, "rope_theta", 1e6)},
                                   "full_attention")
        sliding_theta, _ = _rope(params.get("sliding_attention")
                                 or {"rope_theta": get(cfg, "rope_local_base_freq", 1e4)}, "sliding_attention")
        layer_types = get(cfg, "layer_types") or ["full_attention"] * get(cfg, "num_hidden_layers")
        return Gemma3Arch(
            **self.sizes(cfg),
            rope_theta=full_theta,
            rope_scaling_factor=None,
            qkv_bias=False,
            qk_layernorm=True,
            tie_word_embeddings=bool(get(cfg, "tie_word_embeddings", True)),
            sliding_window=get(cfg, "sliding_window"),
            sliding_layers=tuple(kind == "sliding_attention" for kind in layer_types),
            query_pre_attn_scalar=float(get(cfg, "query_pre_attn_scalar")),
            sliding_rope_theta=sliding_theta,
            rope_linear_factor=factor,
        )

    def language_config(self, t: Gemma3Arch) -> dict:
        from megatron_ext.model.activation_functions import ACTIVATIONS

        return {**super().language_config(t), "layernorm_zero_centered_gamma": True,
                "activation_func": ACTIVATIONS["gelu_tanh"], "softmax_scale": t.query_pre_attn_scalar ** -0.5}

    def language_spec(self, t: Gemma3Arch, spec, config, backend: str, vp_stage: int | None):
        """(1 + w) norms, a norm on the attention's and MLP's outputs, and RoPE computed per layer."""
        from megatron.core.transformer.spec_utils import ModuleSpec
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

        from megatron_ext.model.layer_rope import LayerRopeSelfAttention, Rope
        from megatron_ext.model.norms import OnePlusRMSNorm
        from megatron_ext.model.output_step import add_output_steps

        spec = copy.deepcopy(spec)
        layer, attention = spec.submodules, spec.submodules.self_attention
        if backend == "te":
            # TE's norms compute (1 + w) themselves from the config (layernorm_zero_centered_gamma).
            from megatron.core.extensions.transformer_engine import TENorm as post_norm
        else:
            post_norm = OnePlusRMSNorm
            layer.input_layernorm = layer.pre_mlp_layernorm = OnePlusRMSNorm
            attention.submodules.q_layernorm = attention.submodules.k_layernorm = OnePlusRMSNorm
        add_output_steps(spec, "post_norm", post_norm)
        ropes = {"sliding_rope": Rope(t.sliding_rope_theta), "full_rope": Rope(t.rope_theta, t.rope_linear_factor)}
        layer.self_attention = ModuleSpec(module=LayerRopeSelfAttention, submodules=attention.submodules,
                                          params={**attention.params, **ropes})
        if backend == "te":
            return spec
        # megatron-core's torch final norm cannot compute (1 + w): a block spec names the norm.
        return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                          layer_norm=OnePlusRMSNorm)

    def after_build(self, t: Gemma3Arch, model) -> None:
        """Text embeddings scaled by sqrt(hidden_size) in their own dtype. LLaVAModel embeds only the
        text tokens with its embedding; image features join afterwards, unscaled, as in HF."""
        import torch

        if not model.language_model.pre_process:
            return
        scale = t.hidden_size ** 0.5

        def scaled(module, inputs, output):
            # float32 first, then the embeddings' dtype: transformers rounds the scale that way.
            return output * torch.tensor(scale).to(dtype=output.dtype, device=output.device)

        model.language_model.embedding.register_forward_hook(scaled)

    def layout_problems(self, t: Gemma3Arch, cp: int) -> list[str]:
        if cp > 1:
            return [f"--cp {cp}: {t.model_type} layers compute their own RoPE, which is not split over "
                    "context-parallel ranks; use --cp 1"]
        return []

    def rows(self, t: TextArch) -> tuple[list[Mapping], list[Mapping]]:
        once, layer = super().rows(t)
        pre_mlp = LM + "mlp.linear_fc1.layer_norm_weight"
        layer = [r for r in layer if r.megatron != pre_mlp] + [
            row(pre_mlp, HF_LM + "pre_feedforward_layernorm.weight", REPLICATED),
            row(LM + "self_attention.linear_proj.post_norm.weight", HF_LM + "post_attention_layernorm.weight", REPLICATED),
            row(LM + "mlp.linear_fc2.post_norm.weight", HF_LM + "post_feedforward_layernorm.weight", REPLICATED),
        ]
        return once, layer


FAMILY = Gemma3Family(model_type="gemma3_text", config_class="Gemma3TextConfig", chat_template="gemma")
