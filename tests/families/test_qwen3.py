"""Qwen3: per-head q/k RMSNorm and a head_dim other than hidden / heads. Conversion, bit-exact round
trip at TP/PP 1 and 2 and logit parity are in tests/convert/test_roundtrip.py (fixture "qwen3");
here: what is read from its config, greedy generation at TP2 and a stage-2 run."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.errors import UserError
from megatron_ext.model.arch import LlavaArch, TextArch
from tests.eval.test_generate import MAX_NEW_TOKENS, _expected, _requests
from tests.helpers import hf_tensors, run_torchrun
from tests.train.conftest import train, trainer_args


def test_config_gives_per_head_qk_norms_and_its_own_head_dim(llava_qwen3_siglip):
    from megatron_ext.convert.mapping import llava_mapping

    arch = LlavaArch.from_hf_config(json.loads((llava_qwen3_siglip / "config.json").read_text()))
    t = arch.text
    assert (t.hidden_size, t.num_attention_heads, t.kv_channels) == (64, 4, 32)
    assert t.qk_layernorm and not t.qkv_bias
    table = llava_mapping(arch)
    assert table["language_model.decoder.layers.1.self_attention.q_layernorm.weight"].hf == (
        "language_model.model.layers.1.self_attn.q_norm.weight",)
    assert "language_model.decoder.layers.0.self_attention.linear_qkv.bias" not in table


def test_attention_bias_is_refused():
    config = {"model_type": "qwen3", "attention_bias": True}
    with pytest.raises(UserError, match=r"^qwen3 models with attention_bias=true \(bias on o_proj too\) are not supported$"):
        TextArch.from_hf(config)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_greedy_tokens_at_tp2_equal_transformers_and_stage2_trains_the_language_model(
        llava_qwen3_siglip, train_data, tmp_path):
    from megatron_ext.convert.compare import synthetic_image
    from megatron_ext.convert.mapping import normalize_hf_name
    from megatron_ext.convert.to_hf import convert as to_hf
    from megatron_ext.convert.to_megatron import convert as to_megatron
    from tests.eval.conftest import HFReference

    megatron = to_megatron(llava_qwen3_siglip, tmp_path / "megatron", tp=2, pp=1)
    images = [tmp_path / "images" / "a.png", tmp_path / "images" / "b.png"]
    images[0].parent.mkdir()
    synthetic_image(0).save(images[0])
    synthetic_image(1, size=(90, 40)).save(images[1])
    requests, answers = _requests(tmp_path, images), tmp_path / "answers.jsonl"
    run_torchrun(2, "scripts/eval/generate.py", "--megatron-dir", megatron, "--input-jsonl", requests,
                 "--output-jsonl", answers, "--max-new-tokens", MAX_NEW_TOKENS, "--tp", 2, timeout=180)
    expected = _expected(HFReference(llava_qwen3_siglip), images)
    assert [json.loads(line)["token_ids"] for line in answers.read_text().splitlines()] == expected
    assert all(len(ids) == MAX_NEW_TOKENS for ids in expected)

    save = tmp_path / "run"
    train(1, *trainer_args(megatron, train_data, save, stage=2, lr=1e-2, train_iters=2, chat_template="plain"))
    before = {normalize_hf_name(k): v for k, v in hf_tensors(llava_qwen3_siglip).items()}
    after = {normalize_hf_name(k): v for k, v in hf_tensors(to_hf(save, tmp_path / "hf")).items()}
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {n for n in before if n.split(".")[0] in ("language_model", "multi_modal_projector")}
    assert "language_model.model.layers.1.self_attn.k_norm.weight" in changed
