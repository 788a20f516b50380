"""The TransformerConfigs a GPU run builds (fused kernels on) for every model family: megatron-core
accepts them, and fuses bias + activation only where its kernel computes what HF does (SwiGLU)."""

from __future__ import annotations

import json

import pytest
import torch

FIXTURES = ["llava_clip", "llava_qwen2_siglip", "llava_internvit", "llava_gemma3_siglip"]


@pytest.mark.parametrize("fixture", FIXTURES)
def test_gpu_configs_are_accepted_and_fuse_only_swiglu(request, fixture, monkeypatch):
    import torch.nn.functional as F

    from megatron_ext.model.arch import LlavaArch
    from megatron_ext.model.provider import ModelOptions, transformer_configs

    arch = LlavaArch.from_hf_config(json.loads((request.getfixturevalue(fixture) / "config.json").read_text()))
    # What provider.build_model sees on a GPU machine (the configs are only built here).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    configs = transformer_configs(arch, ModelOptions(dtype="bfloat16"), "sdpa", tp=2, pp=1)
    for config in configs:
        assert config.bias_dropout_fusion and config.masked_softmax_fusion
        swiglu = config.activation_func is F.silu and config.gated_linear_unit
        assert config.bias_activation_fusion == swiglu
    language, vision, projector = configs
    assert language.bias_activation_fusion == (arch.text.gated_activation == "silu")
    assert not vision.bias_activation_fusion and not projector.bias_activation_fusion
