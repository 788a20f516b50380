"""What the converters' CPU workers import: megatron-core without TorchDynamo/Inductor and W&B
(lean_import, preloaded by their fork server), and rules that check shapes on meta tensors
without importing TorchDynamo."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import run

pytestmark = pytest.mark.multiprocess  # each test runs a fresh interpreter, to see what it imports

_LEAN = """
import sys, torch
compile_before = torch.compile
from megatron_ext.lean_import import import_lean
import_lean(["megatron.core.dist_checkpointing", "megatron.core.models.multimodal.llava_model"])
from megatron.core import jit
from megatron.core.fusions.fused_bias_gelu import bias_gelu
left_out = [name for name in ("torch._dynamo", "torch._inductor", "wandb") if name in sys.modules]
import wandb  # the caller's own import of W&B works as usual afterwards
print(left_out, torch.compile is compile_before, jit.jit_fuser(bias_gelu) is bias_gelu,
      hasattr(bias_gelu, "_torchdynamo_orig_callable"), callable(wandb.init))
"""


def test_megatron_core_is_imported_without_dynamo_and_wandb_and_torch_compile_is_left_as_it_was():
    out = run([sys.executable, "-c", _LEAN], timeout=180).stdout.split("\n")[-2]
    # megatron-core's fused kernels are plain functions there, and torch.compile is torch's own again
    assert out == "[] True True False True"


def test_shape_checks_on_meta_tensors_do_not_import_torch_dynamo():
    """The converters' workers run every rule on meta tensors to check shapes; torch.cat there
    would import TorchDynamo (0.8 s a worker)."""
    code = """
import sys, torch
from megatron_ext.convert.rules import GATED_MLP, QKV, VocabParallel
meta = lambda *shape: torch.empty(shape, device="meta")
GATED_MLP.shard(GATED_MLP.hf_to_megatron([meta(8, 4), meta(8, 4)]), 1, 2)
QKV(num_heads=4, num_query_groups=2, head_dim=2).hf_to_megatron([meta(8, 4), meta(4, 4), meta(4, 4)])
VocabParallel(vocab_size=6, padded_vocab_size=8).hf_to_megatron([meta(6, 4)])
print("torch._dynamo" in sys.modules)
"""
    assert run([sys.executable, "-c", code], timeout=120).stdout.split() == ["False"]
