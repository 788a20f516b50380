"""Layer specs for a resolved attention backend (`backends.py`): Transformer Engine modules, or
megatron-core's local (torch) modules with torch SDPA or megatron's reference attention kernel.

All of them save the same dist-checkpoint keys (the local specs map their separate norms onto
TE's fused `layer_norm_weight` names), so a checkpoint written on CPU loads into a TE model on GPU.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, replace

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlavaSpecs:
    language: object
    vision: object
    projector: object
    backend: str


def _local_vit_layer_spec(core_attention):
    """Bidirectional ViT layer from local modules (megatron's own local ViT spec is causal)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=WrappedTorchNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.no_mask},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=core_attention,
                    linear_proj=RowParallelLinear,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=WrappedTorchNorm,
            mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map={
                "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
            },
        ),
    )


def _with_core_attention(layer_spec, core_attention):
    spec = copy.deepcopy(layer_spec)
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return spec


def _add_output_steps(spec, name: str, step_cls: type) -> None:
    """Put a `step_cls` on the layer's attention and MLP outputs (`output_step.py`), in place."""
    from megatron_ext.model.output_step import with_output_step

    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    attention.linear_proj = with_output_step(attention.linear_proj, name, step_cls)
    mlp.linear_fc2 = with_output_step(mlp.linear_fc2, name, step_cls)


@dataclass(frozen=True)
class LanguageExtras:
    """What some text families add to megatron-core's GPT layer (all off for Llama-shaped ones)."""

    post_norms: bool = False  # a norm on the attention and MLP outputs before each residual add
    layer_ropes: tuple | None = None  # (sliding layers' Rope, full layers' Rope), `layer_rope.py`
    layers_here: int = 0  # layers on this pipeline stage: the block spec that sets the final norm needs it


def _with_language_extras(layer_spec, config, extras: LanguageExtras, backend: str):
    """The GPT layer (or block) spec with its family's (1 + w) norms, post-norms and per-layer RoPE."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_ext.model.norms import OnePlusRMSNorm

    spec = copy.deepcopy(layer_spec)
    layer, attention = spec.submodules, spec.submodules.self_attention
    # TE's norms compute (1 + w) themselves from the config; megatron-core's torch norm cannot.
    one_plus = config.layernorm_zero_centered_gamma and backend != "te"
    if one_plus:
        layer.input_layernorm = layer.pre_mlp_layernorm = OnePlusRMSNorm
        if config.qk_layernorm:
            attention.submodules.q_layernorm = attention.submodules.k_layernorm = OnePlusRMSNorm
    if extras.post_norms:
        if backend == "te":
            from megatron.core.extensions.transformer_engine import TENorm as norm
        else:
            norm = OnePlusRMSNorm if one_plus else WrappedTorchNorm
        _add_output_steps(spec, "post_norm", norm)
    if extras.layer_ropes:
        from megatron_ext.model.layer_rope import LayerRopeSelfAttention

        sliding, full = extras.layer_ropes
        layer.self_attention = ModuleSpec(module=LayerRopeSelfAttention, submodules=attention.submodules,
                                          params={**attention.params, "sliding_rope": sliding, "full_rope": full})
    if one_plus:
        return TransformerBlockSubmodules(layer_specs=[spec] * extras.layers_here, layer_norm=OnePlusRMSNorm)
    return spec


def llava_specs(backend: str, language_config, vision_layer_scale: bool = False,
                language_extras: LanguageExtras = LanguageExtras()) -> LlavaSpecs:
    """Specs for a resolved backend (te, sdpa or local). The language layer follows the language
    TransformerConfig its family wrote (its norm class, whether q/k are normalised, (1 + w) norms)
    and `language_extras`; the vision layer gets a layer scale when its tower has one."""
    from megatron.core.transformer.mlp import MLPSubmodules

    if backend == "te":
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec

        specs = LlavaSpecs(
            language=get_gpt_layer_with_transformer_engine_spec(qk_layernorm=language_config.qk_layernorm),
            vision=get_vit_layer_with_transformer_engine_spec(),
            projector=MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear),
            backend=backend,
        )
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from megatron_ext.model.attention import SDPAttention

        core_attention = SDPAttention if backend == "sdpa" else DotProductAttention
        specs = LlavaSpecs(
            language=_with_core_attention(get_gpt_layer_local_spec(
                normalization=language_config.normalization, qk_layernorm=language_config.qk_layernorm), core_attention),
            vision=_local_vit_layer_spec(core_attention),
            projector=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            backend=backend,
        )
    if vision_layer_scale:
        from megatron_ext.model.output_step import LayerScale

        vision = copy.deepcopy(specs.vision)
        _add_output_steps(vision, "layer_scale", LayerScale)
        specs = replace(specs, vision=vision)
    if language_extras.post_norms or language_extras.layer_ropes or language_config.layernorm_zero_centered_gamma:
        specs = replace(specs, language=_with_language_extras(specs.language, language_config, language_extras, backend))
    log.info("layer specs: %s", {"te": "Transformer Engine", "sdpa": "megatron-core local + torch SDPA attention",
                                 "local": "megatron-core local (reference attention)"}[backend])
    return specs
