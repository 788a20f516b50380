"""bench/qwen_vl_bench.py runs end to end on the tiny models (the code the GPU figures come from)."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import run_python

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def _bench(*args) -> dict:
    proc = run_python("bench/qwen_vl_bench.py", "--iters", "2", "--warmup", "1", *args, timeout=240)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["qwen2_5_vl-tiny", "qwen3_vl-tiny"])
def test_ours_and_transformers_train_the_same_samples_side_by_side(model):
    ours, theirs = _bench("--model", model), _bench("--model", model, "--hf")
    assert (ours["implementation"], theirs["implementation"]) == ("megatron-ext", "transformers")
    # The same conversations in the same packs: the same sample tokens and micro batches per step.
    assert ours["positions_per_step"] == theirs["positions_per_step"] > 0
    assert ours["packing"] and theirs["packing"] and ours["micro_batches_per_step"] < 8
    assert theirs["micro_batches_per_step"] == ours["micro_batches_per_step"]
    for result in (ours, theirs):
        assert result["tokens_per_s"] > 0 and result["tflops_per_gpu"] > 0 and result["loss_first"] > 0


@pytest.mark.parametrize("model", ["qwen2_5_vl-tiny", "qwen3_vl-tiny"])
def test_transformers_packed_rows_train_the_same_tokens_as_padded_micro_batches(tmp_path, model):
    """--hf's packs (one row each: text positions restarting per sample above each sample's mRoPE
    positions, no padding) give transformers' model the per-token losses of each sample alone (fp32)."""
    import numpy as np
    import torch
    import transformers

    from bench import qwen_vl_bench
    from megatron_ext import families
    from megatron_ext.train.batches import task_encoder
    from tests.bench.test_gpu_bench import _summed_token_losses

    config = qwen_vl_bench.model_config(model)
    qwen_vl_bench._tiny_tokenizer(str(tmp_path))
    plan = qwen_vl_bench.make_plan(config, tmp_path, {}, 1, 2048)
    encoder = task_encoder(str(tmp_path), plan.arch, plan.config, plan.seq_length, plan.execution.alignment)
    samples = qwen_vl_bench.synthetic_samples(encoder, 6, (28, 112), np.random.default_rng(0))
    packs = encoder.select_samples_to_pack(samples)
    assert len(packs) < len(samples)  # packs of several samples
    family = families.of(plan.arch)
    torch.manual_seed(0)
    hf = getattr(transformers, family.model_class)._from_config(
        getattr(transformers, family.config_class).from_dict(config), attn_implementation="sdpa").eval()
    ids = (plan.arch.image_token_id, plan.arch.video_token_id)
    packed = qwen_vl_bench.hf_packed_micro_batches(hf, packs, *ids)
    padded = qwen_vl_bench.hf_micro_batches([s for pack in packs for s in pack], *ids, encoder.pad_token_id, 1)
    with torch.no_grad():
        packed_sum, packed_tokens = _summed_token_losses(hf, packed)
        padded_sum, padded_tokens = _summed_token_losses(hf, padded)
    assert packed_tokens == padded_tokens
    assert packed_sum == pytest.approx(padded_sum, rel=1e-5)
