"""Layer specs: megatron-core local (torch) modules or Transformer Engine modules.

Both families save the same dist-checkpoint keys (the local specs map their separate norms onto
TE's fused `layer_norm_weight` names), so a checkpoint written on CPU loads into a TE model on GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def resolve_use_te(use_te: bool | None) -> bool:
    """None means: TE when it is importable and CUDA is present."""
    chosen = te_available() if use_te is None else use_te
    if chosen and not te_available():
        from megatron_ext.errors import UserError

        raise UserError("Transformer Engine layers were requested but transformer_engine is not importable "
                        "with CUDA here; install the gpu extra: pip install 'megatron-ext[gpu]'")
    return chosen


@dataclass(frozen=True)
class LlavaSpecs:
    language: object
    vision: object
    projector: object
    use_te: bool


def _local_vit_layer_spec():
    """Bidirectional ViT layer from local modules (megatron's own local ViT spec is causal)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
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
                    core_attention=DotProductAttention,
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


def llava_specs(use_te: bool | None = None) -> LlavaSpecs:
    from megatron.core.transformer.mlp import MLPSubmodules

    use_te = resolve_use_te(use_te)
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TERowParallelLinear
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_transformer_engine_spec

        specs = LlavaSpecs(
            language=get_gpt_layer_with_transformer_engine_spec(),
            vision=get_vit_layer_with_transformer_engine_spec(),
            projector=MLPSubmodules(linear_fc1=TEColumnParallelLinear, linear_fc2=TERowParallelLinear),
            use_te=True,
        )
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        specs = LlavaSpecs(
            language=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vision=_local_vit_layer_spec(),
            projector=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            use_te=False,
        )
    log.info("layer specs: %s", "Transformer Engine" if use_te else "megatron-core local (torch)")
    return specs
