"""Layer specs for a resolved attention backend (`backends.py`): Transformer Engine modules, or
megatron-core's local (torch) modules with torch SDPA or megatron's reference attention kernel.

All of them save the same dist-checkpoint keys (the local specs map their separate norms onto
TE's fused `layer_norm_weight` names), so a checkpoint written on CPU loads into a TE model on GPU.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

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
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    from megatron_ext.compat.releases import mlp_spec

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
            mlp=mlp_spec(MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
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


def llava_specs(backend: str, language_config) -> LlavaSpecs:
    """megatron-core's specs for a resolved backend (te, sdpa or local). The language layer follows
    the language TransformerConfig its family wrote (its norm class, whether q/k are normalised);
    the families change them further through their hooks (`provider.build_model`)."""
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
    log.info("layer specs: %s", {"te": "Transformer Engine", "sdpa": "megatron-core local + torch SDPA attention",
                                 "local": "megatron-core local (reference attention)"}[backend])
    return specs
