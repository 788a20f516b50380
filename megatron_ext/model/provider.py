"""Build megatron-core's `LLaVAModel` for this rank from a `LlavaArch` and its families' hooks.

The three TransformerConfigs (language model, ViT, projector) are derived here and nowhere else;
what a family computes beyond megatron-core's layers comes from its hooks (`family_hooks.py`).
Pipeline parallelism follows Megatron-LM's multimodal layout: the ViT and projector live on the
first stage, the language model's layers are split across stages.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial

import torch

from megatron_ext.distributed import device
from megatron_ext.model import rope_kernels
from megatron_ext.model.activation_functions import ACTIVATIONS
from megatron_ext.model.arch import LlavaArch, TextArch
from megatron_ext.model.backends import STORED_DTYPES, resolve_backend, te_available
from megatron_ext.model.build_errors import megatron_refusals
from megatron_ext.model.execution import ModelExecution
from megatron_ext.model.family_hooks import ModelFamilies, TextHooks
from megatron_ext.model.padded_vocab import mask_padded_vocab
from megatron_ext.model.specs import llava_specs

DTYPES = {name: getattr(torch, name) for name in STORED_DTYPES}


@dataclass(frozen=True)
class ModelOptions:
    """Runtime choices that are not part of the weights."""

    seq_length: int = 1024  # language-model sequence length (text + image embeddings)
    dtype: str = "float32"  # params / compute dtype: one of DTYPES
    init_weights: bool = True  # False when a checkpoint will overwrite every weight anyway
    parallel_output: bool = True  # False gathers full-vocab logits (inference, comparisons)
    execution: ModelExecution = ModelExecution()

    @classmethod
    def for_run(cls, plan, init_weights: bool) -> "ModelOptions":
        """A training run's options from its `RunPlan` (the trained model's and DPO's frozen reference's)."""
        return cls(seq_length=plan.seq_length, dtype=plan.dtype, init_weights=init_weights, parallel_output=True,
                   execution=plan.execution.model)

    def resolved_backend(self) -> str:
        return resolve_backend(self.execution.attention_backend, te_available())


def _common(opts: ModelOptions, backend: str, tp: int, init_std: float) -> dict:
    dtype = DTYPES[opts.dtype]
    on_gpu = torch.cuda.is_available()
    return dict(
        tensor_model_parallel_size=tp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        # Full weights built then sliced: identical initial weights at every TP size.
        use_cpu_initialization=True,
        perform_initialization=opts.init_weights,
        init_method_std=init_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        # Fused kernels exist only on GPU; on CPU they would only add torch.compile time.
        bias_dropout_fusion=on_gpu,
        # Only the local backend's softmax reads this. Its fused kernel is Apex's (imported unchecked:
        # ModuleNotFoundError without Apex) and, for causal layers, ignores the packing mask, so
        # samples of a pack would attend to each other. That backend is the reference: never fused.
        masked_softmax_fusion=False,
        # megatron-core's unfused THD RoPE reads cu_seqlens back to the host in every layer; the
        # "fused" entry points are TE's or, without TE, rope_kernels' (installed below).
        apply_rope_fusion=backend in ("te", "sdpa"),
        gradient_accumulation_fusion=opts.execution.gradient_accumulation_fusion,
        # Pipeline p2p must not wait on CUDA streams that do not exist on CPU.
        batch_p2p_sync=on_gpu,
    )


def _activation(fields: dict) -> dict:
    """`fields` with megatron-core's fused bias + activation kernel where it computes what HF does:
    SwiGLU, on GPU. Its GELU kernels use the tanh approximation (HF's gelu is erf) and it refuses
    other functions (quick_gelu, gelu_pytorch_tanh) at config time."""
    import torch.nn.functional as F

    fused = torch.cuda.is_available() and fields["activation_func"] is F.silu and fields["gated_linear_unit"]
    return {**fields, "bias_activation_fusion": fused}


def _recompute(ex: ModelExecution) -> dict:
    if ex.recompute_granularity == "full":
        return dict(recompute_granularity="full", recompute_method=ex.recompute_method,
                    recompute_num_layers=ex.recompute_num_layers)
    if ex.recompute_granularity == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    return {}


def language_transformer_config(t: TextArch, family: TextHooks, opts: ModelOptions, backend: str, tp: int, pp: int):
    """The language model's TransformerConfig for a `tp` x `pp` layout (a LLaVA's, or any model's
    whose decoder is megatron-core's GPT)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    rope_kernels.install()  # before the configs: they check that fused RoPE entry points exist
    ex = opts.execution
    fp8 = dict(fp8=ex.fp8, fp8_recipe="delayed") if ex.fp8 and ex.fp8_backend == "te" else {}
    return TransformerConfig(
        **_common(opts, backend, tp, t.init_std),
        **fp8,
        **_recompute(ex),
        sequence_parallel=ex.sequence_parallel,
        context_parallel_size=ex.cp,
        pipeline_model_parallel_size=pp,
        num_layers=t.num_layers,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.ffn_hidden_size,
        num_attention_heads=t.num_attention_heads,
        num_query_groups=t.num_query_groups,
        kv_channels=t.kv_channels,
        **_activation(family.language_config(t)),
    )


def transformer_configs(arch: LlavaArch, families: ModelFamilies, opts: ModelOptions, backend: str, tp: int, pp: int):
    """(language, vision, projector) TransformerConfigs for a `tp` x `pp` layout."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    t, v = arch.text, arch.vision
    language = language_transformer_config(arch.text, families.text, opts, backend, tp, pp)
    vision = TransformerConfig(
        **_common(opts, backend, tp, v.init_std),
        # The ViT lives whole on the first pipeline stage; a PP size here would drop layers.
        pipeline_model_parallel_size=1,
        **_activation(families.vision.vision_config(v)),
    )
    vision.vision_model_type = v.subtype
    projector = TransformerConfig(
        **_common(opts, backend, tp, t.init_std),
        pipeline_model_parallel_size=1,
        num_layers=1,
        hidden_size=t.hidden_size,
        ffn_hidden_size=t.hidden_size,
        num_attention_heads=t.num_attention_heads,
        add_bias_linear=arch.projector_bias,
        **_activation(dict(gated_linear_unit=False, activation_func=ACTIVATIONS[arch.projector_activation])),
    )
    return language, vision, projector


def build_model(arch: LlavaArch, families: ModelFamilies, opts: ModelOptions = ModelOptions(),
                vp_stage: int | None = None, meta: bool = False):
    """This rank's LLaVAModel under the current megatron parallel state; `families`:
    `megatron_ext.families.of(arch)`. `meta`: every tensor on PyTorch's meta device (shapes and
    dtypes, no memory; `memory/meta_ranks.py`), with `opts.init_weights` False."""
    from megatron.core import parallel_state

    from megatron_ext.compat import without_te

    without_te.apply()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    arch.check_parallel(tp, pp)
    if meta and opts.init_weights:
        raise ValueError("a model on the meta device has no values to initialise: use init_weights=False")
    with megatron_refusals(), torch.device("meta") if meta else contextlib.nullcontext():
        model = _build(arch, families, opts, vp_stage, tp, pp)
    if meta:
        return model
    # use_cpu_initialization leaves every weight on the host; it computes on this process's device.
    return model.to(device())


def _build(arch: LlavaArch, families: ModelFamilies, opts: ModelOptions, vp_stage: int | None, tp: int, pp: int):
    from megatron.core import parallel_state
    from megatron.core.enums import ModelType

    backend = opts.resolved_backend()
    language_cfg, vision_cfg, projector_cfg = transformer_configs(arch, families, opts, backend, tp, pp)
    specs = llava_specs(backend, language_cfg)
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    t = arch.text
    model = _model_class(arch)(
        language_transformer_config=language_cfg,
        language_transformer_layer_spec=families.text.language_spec(t, specs.language, language_cfg, backend, vp_stage),
        language_vocab_size=t.padded_vocab_size,
        language_max_sequence_length=opts.seq_length,
        vision_transformer_config=vision_cfg,
        vision_transformer_layer_spec=families.vision.vision_spec(arch.vision, specs.vision, backend),
        drop_vision_class_token=arch.drop_class_token,
        vision_projection_config=projector_cfg,
        vision_projection_layer_spec=specs.projector,
        vision_projection_type="mlp",
        parallel_output=opts.parallel_output,
        share_embeddings_and_output_weights=t.tie_word_embeddings,
        language_position_embedding_type="rope",
        language_rotary_base=t.rope_theta,
        language_rope_scaling=t.rope_scaling_factor is not None,
        language_rope_scaling_factor=t.rope_scaling_factor or 8.0,
        pre_process=first,
        post_process=last,
        add_encoder=first,
        add_decoder=True,
        # megatron-core's ViT refuses images off its patch grid; its convolution, like transformers',
        # ignores the pixels past the last whole patch, so it takes the full image as it is.
        img_h=arch.vision.patched_size,
        img_w=arch.vision.patched_size,
        patch_dim=arch.vision.patch_size,
        image_token_index=arch.image_token_index,
        vp_stage=vp_stage,
    )
    families.text.after_build(t, model)
    if first:
        from megatron_ext.model.vocab_embedding import use_masked_fill

        use_masked_fill(model)
    if last:
        mask_padded_vocab(model.language_model.output_layer, t.vocab_size, t.padded_vocab_size)
    if model.vision_model is not None:
        # HF LLaVA reads features from hidden_states, which no tower's post_layernorm touches;
        # megatron's CLIPViTModel applies one for some subtypes (siglip). Without it both agree.
        model.vision_model.ln_post = None
    model.model_type = ModelType.encoder_or_decoder
    # How batches must express packing to it (model.inputs).
    model.attention_backend = backend
    model.logits_where_loss = opts.execution.logits_where_loss
    if not opts.init_weights:
        mark_tensor_parallel_weights(model)
    return model


def _model_class(arch: LlavaArch):
    """megatron-core's LLaVAModel taking a host-computed layout (`combined_layout`), or for tiled
    models (LLaVA-NeXT, OneVision) its subclass; either takes shared images (a preference pair's,
    `shared_images`)."""
    from megatron_ext.model.shared_images import with_shared_images

    if arch.tiling is None:
        from megatron_ext.model.combined_layout import LaidOutLLaVAModel

        return with_shared_images(LaidOutLLaVAModel)
    from megatron_ext.model.tiled_llava import TiledLLaVAModel

    return partial(with_shared_images(TiledLLaVAModel), tiling=arch.tiling, tile=arch.vision.image_size)


def mark_tensor_parallel_weights(model) -> None:
    """Tag TP-split weights the way megatron-core does while initialising them.

    megatron-core sets `tensor_model_parallel` on a ColumnParallelLinear / RowParallelLinear /
    VocabParallelEmbedding weight only inside its init function, so a model built without
    initialisation (weights come from a checkpoint) lacks it. Gradient clipping then counts
    every shard as a TP duplicate and sees a smaller norm than TP=1 does (measured at TP2).
    """
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            dim = 1
        elif isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, dim, 1)

