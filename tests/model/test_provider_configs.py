"""The TransformerConfigs a GPU run builds (fused kernels on) for every model family: megatron-core
accepts them, and fuses bias + activation only where its kernel computes what HF does (SwiGLU);
the local backend's softmax keeps the packing mask, on a GPU as here."""

from __future__ import annotations

import json

import pytest
import torch

FIXTURES = ["llava_clip", "llava_qwen2_siglip", "llava_internvit", "llava_gemma3_siglip"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_gpu_configs_are_accepted_and_fuse_only_swiglu(request, fixture, monkeypatch):
    import torch.nn.functional as F

    from megatron_ext import families
    from megatron_ext.model.provider import ModelOptions, transformer_configs

    arch = families.read_llava(json.loads((request.getfixturevalue(fixture) / "config.json").read_text()))
    # What provider.build_model sees on a GPU machine (the configs are only built here).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    configs = transformer_configs(arch, families.of(arch), ModelOptions(dtype="bfloat16"), "sdpa", tp=2, pp=1)
    for config in configs:
        assert config.bias_dropout_fusion and not config.masked_softmax_fusion
        swiglu = config.activation_func is F.silu and config.gated_linear_unit
        assert config.bias_activation_fusion == swiglu
    language, vision, projector = configs
    # RoPE over packed rows with no host read per layer (rope_kernels where TE is absent).
    assert language.apply_rope_fusion
    assert language.bias_activation_fusion == (fixture != "llava_gemma3_siglip")  # Gemma's GeGLU is not fused
    assert not vision.bias_activation_fusion and not projector.bias_activation_fusion


def test_local_attention_keeps_packed_samples_apart_with_the_gpu_config(llava_clip, monkeypatch):
    """Where Apex's fused softmax would take over (bf16, 16 < S <= 4096, S % 4 == 0) it would ignore
    the mask of a causal layer; the GPU config keeps megatron's masked torch softmax instead."""
    from types import SimpleNamespace

    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ext import families
    from megatron_ext.model.packed_sequences import packed_attention_mask
    from megatron_ext.model.provider import ModelOptions, transformer_configs

    arch = families.read_llava(json.loads((llava_clip / "config.json").read_text()))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    language, _, _ = transformer_configs(arch, families.of(arch), ModelOptions(dtype="bfloat16"), "local", tp=1, pp=1)
    monkeypatch.undo()
    tp = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    attention = DotProductAttention(language, 1, AttnMaskType.causal, "self", pg_collection=tp)
    s, heads = 32, language.num_attention_heads
    scores = torch.randn(1, heads, s, s, generator=torch.Generator().manual_seed(0)).bfloat16()
    segments = torch.tensor([[1] * 12 + [2] * 20])
    mask = packed_attention_mask(torch.arange(s)[None], segments, -1, 1, s)
    softmax = attention.scale_mask_softmax
    assert not softmax.is_kernel_available(mask, 1, heads, s, s)
    probs = softmax(scores, mask).float()
    # No query of sample 2 gives weight to a key of sample 1, nor any query to a later key.
    assert probs[..., 12:, :12].abs().max() == 0
    assert torch.equal(probs[0, 0] > 0, ~mask[0, 0])


def test_execution_options_reach_the_language_config(llava_clip):
    from megatron_ext import families
    from megatron_ext.model.execution import ModelExecution
    from megatron_ext.model.provider import ModelOptions, transformer_configs

    arch = families.read_llava(json.loads((llava_clip / "config.json").read_text()))

    def configs(**execution):
        return transformer_configs(arch, families.of(arch), ModelOptions(execution=ModelExecution(**execution)), "sdpa",
                                   tp=1, pp=1)

    language, vision, projector = configs(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert (language.recompute_granularity, language.recompute_method, language.recompute_num_layers) == ("full", "block", 2)
    assert vision.recompute_granularity is None and projector.recompute_granularity is None
    language = configs(recompute_granularity="selective")[0]
    assert (language.recompute_granularity, language.recompute_modules) == ("selective", ["core_attn"])
    language = configs()[0]
    assert (language.recompute_granularity, language.sequence_parallel, language.context_parallel_size, language.fp8,
            language.gradient_accumulation_fusion) == (None, False, 1, None, False)
