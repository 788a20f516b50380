"""The vocabulary-parallel embedding without a host read (model/vocab_embedding.py) computes what
megatron-core's does; that it reads nothing is the sync ledger's test (tests/train/test_gpu_rehearsal.py)."""

from pathlib import Path

import pytest

from tests.support.helpers import run_ranks

WORKER = str(Path(__file__).with_name("vocab_embedding_worker.py"))


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_the_masked_fill_embedding_equals_megatrons_at_tp2_with_and_without_sequence_parallelism():
    result = run_ranks(2, WORKER, timeout=180)
    assert result.stdout.count("equal") == 2, result.stdout
