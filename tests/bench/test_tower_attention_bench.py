"""bench/tower_attention_bench.py runs end to end on its tiny preset (the code the GPU figures come from)."""

from __future__ import annotations

import json

import pytest

from tests.support.helpers import run_python


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_each_family_and_batch_has_an_sdpa_and_a_varlen_row_with_the_same_features():
    proc = run_python("bench/tower_attention_bench.py", "--preset", "tiny", "--iters", "1", timeout=180)
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    pairs = [(family, attention) for family in ("qwen2_5_vl", "qwen3_vl")
             for attention in ("sdpa", "varlen", "varlen, compiled blocks")]
    assert sorted((row["family"], row["attention"]) for row in rows) == sorted(pairs * 2)  # two batches each
    assert all(row["forward_ms"] > 0 and row["forward_backward_ms"] > 0 for row in rows)
    assert all(row["relative_difference"] <= 1e-6 for row in rows)
