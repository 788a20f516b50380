"""The converters' workers check shapes by running the split rules on meta tensors, without
importing TorchDynamo."""

from __future__ import annotations

import sys

import pytest

from tests.support.helpers import run


@pytest.mark.multiprocess  # a fresh interpreter, to see what it imports
def test_shape_checks_on_meta_tensors_do_not_import_torch_dynamo():
    """The converters' workers run every rule on meta tensors to check shapes; torch.cat there
    would import TorchDynamo (0.8 s a worker)."""
    code = """
import sys, torch
from megatron_ext.model.mapping_rules import GATED_MLP, QKV, VocabParallel
meta = lambda *shape: torch.empty(shape, device="meta")
GATED_MLP.shard(GATED_MLP.hf_to_megatron([meta(8, 4), meta(8, 4)]), 1, 2)
QKV(num_heads=4, num_query_groups=2, head_dim=2).hf_to_megatron([meta(8, 4), meta(4, 4), meta(4, 4)])
VocabParallel(vocab_size=6, padded_vocab_size=8).hf_to_megatron([meta(6, 4)])
print("torch._dynamo" in sys.modules)
"""
    assert run([sys.executable, "-c", code], timeout=120).stdout.split() == ["False"]
