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
    # The same conversations: the same sample tokens per step, packed (ours) or padded (theirs).
    assert ours["positions_per_step"] == theirs["positions_per_step"] > 0
    assert ours["packing"] and ours["micro_batches_per_step"] < 8
    for result in (ours, theirs):
        assert result["tokens_per_s"] > 0 and result["tflops_per_gpu"] > 0 and result["loss_first"] > 0
