"""Gemma 3 text: (1 + w) norms, post-norms, scaled embeddings, GeGLU, its own attention scale, and
sliding-window layers with their own RoPE base. Conversion, bit-exact round trip at TP/PP 1 and 2
and logit parity (prompts longer than the window) are in tests/convert/test_roundtrip.py (fixture
"gemma3"); here: what is read from its config, what is refused, greedy generation at TP2 and a
stage-2 run."""

from __future__ import annotations

import json

import pytest

from megatron_ext import families
from megatron_ext.errors import UserError
from tests.families.checks import assert_greedy_at_tp2_equals_transformers, assert_stage2_trains_all_but_the_tower


def test_config_gives_the_gemma_pieces(llava_gemma3_siglip):
    from megatron_ext.convert.mapping import llava_mapping
    from megatron_ext.model.activation_functions import gelu_tanh

    arch = families.read_llava(json.loads((llava_gemma3_siglip / "config.json").read_text()))
    t = arch.text
    assert (t.qk_layernorm, t.kv_channels, t.query_pre_attn_scalar) == (True, 32, 24)
    assert (t.sliding_window, t.sliding_layers, t.sliding_rope_theta, t.rope_theta) == (5, (True, False), 1e4, 1e6)
    config = families.of(arch).text.language_config(t)
    assert (config["window_size"], config["window_attn_skip_freq"], config["layernorm_zero_centered_gamma"]) == \
        ((4, 0), [1, 0], True)
    assert (config["activation_func"], config["softmax_scale"]) == (gelu_tanh, 24 ** -0.5)
    table = llava_mapping(arch)
    layer = "language_model.decoder.layers.1."
    assert table[layer + "self_attention.linear_proj.post_norm.weight"].hf == (
        "language_model.model.layers.1.post_attention_layernorm.weight",)
    assert table[layer + "mlp.linear_fc1.layer_norm_weight"].hf == (
        "language_model.model.layers.1.pre_feedforward_layernorm.weight",)
    assert table[layer + "mlp.linear_fc2.post_norm.weight"].hf == (
        "language_model.model.layers.1.post_feedforward_layernorm.weight",)


def test_linear_rope_scaling_of_the_full_layers_is_read():
    config = {"model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "vocab_size": 100, "query_pre_attn_scalar": 16, "sliding_window": 8,
              "layer_types": ["sliding_attention", "full_attention"],
              "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    t = families.text_family("gemma3_text").read(config)
    assert (t.rope_theta, t.rope_linear_factor, t.sliding_rope_theta) == (1e6, 8.0, 1e4)


@pytest.mark.parametrize("field,value,what", [
    ("final_logit_softcapping", 30.0, r"final_logit_softcapping \(Gemma 2's\)"),
    ("attn_logit_softcapping", 50.0, r"attn_logit_softcapping \(Gemma 2's\)"),
    ("hidden_activation", "silu", "hidden_activation 'silu'"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=true"),
])
def test_what_gemma3_text_does_not_compute_is_refused(field, value, what):
    with pytest.raises(UserError, match=rf"^gemma3_text models with {what} are not supported$"):
        families.text_family("gemma3_text").read({"model_type": "gemma3_text", field: value})


def test_other_rope_types_are_refused():
    config = {"model_type": "gemma3_text", "rope_parameters": {
        "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}}
    with pytest.raises(UserError, match=r"^gemma3_text RoPE 'yarn' on full_attention layers is not supported "
                                        r"\(supported: default; linear on full_attention layers\)$"):
        families.text_family("gemma3_text").read(config)


def test_context_parallelism_is_refused_before_launch(llava_gemma3_siglip, tmp_path):
    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import make_plan
    from tests.support.launcher import write_prepared_dataset

    data = write_prepared_dataset(tmp_path, {"a.tar": 4}, {"train": ["a.tar"]})
    config = TrainConfig(init=True, tokenizer_load_dir=str(llava_gemma3_siglip), data_path=str(data),
                         stage=2, cp=2, micro_batch_size=1, train_iters=1)
    with pytest.raises(UserError, match=r"^--cp 2: gemma3_text layers compute their own RoPE, which is not split over "
                                        r"context-parallel ranks; use --cp 1$"):
        make_plan(config, world_size=2, on_gpu=True, te=True)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_greedy_tokens_at_tp2_equal_transformers_and_stage2_trains_the_language_model(
        llava_gemma3_siglip, train_data, tmp_path):
    megatron = assert_greedy_at_tp2_equals_transformers(llava_gemma3_siglip, tmp_path)
    changed = assert_stage2_trains_all_but_the_tower(llava_gemma3_siglip, megatron, train_data, tmp_path)
    assert "language_model.model.layers.0.post_feedforward_layernorm.weight" in changed

    # LoRA on every target, the post-normed o_proj and down_proj included: the adapters act before
    # the norms, so the merged export and PEFT's adapter (both on the HF layers) equal Megatron's.
    import torch
    from peft import PeftModel
    from transformers import LlavaForConditionalGeneration

    from megatron_ext import hf_loading
    from megatron_ext.convert.compare import compare, hf_logits, process_inputs, synthetic_image
    from megatron_ext.convert.lora_export import write_peft_adapter
    from megatron_ext.convert.to_hf import convert as to_hf
    from tests.support.training import train, trainer_args

    lora = tmp_path / "lora"
    train(1, *trainer_args(megatron, train_data, lora, stage=2, lr=1e-2, train_iters=2, chat_template="plain",
                           lora_rank=4, lora_alpha=8.0))
    # In this process, not through the script (a process of imports): tests/lora/test_lora.py runs its options.
    merged, adapter = to_hf(lora, tmp_path / "merged", lora_merge=True), write_peft_adapter(lora, tmp_path / "adapter")
    assert compare(merged, lora).max_abs <= 1e-4
    batch = process_inputs(hf_loading.load_processor(str(merged), "--hf-dir"), [synthetic_image()])
    base = LlavaForConditionalGeneration.from_pretrained(llava_gemma3_siglip, dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(**batch).logits
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(**batch).logits
    assert (peft_logits - hf_logits(merged, batch)).abs().max() <= 1e-4
    assert (peft_logits - base_logits).abs().max() > 1e-3
