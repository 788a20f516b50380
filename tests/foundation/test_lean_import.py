"""lean_import: a CPU process imports megatron-core without TorchDynamo/Inductor and W&B, in the
converters' fork server and wherever `init_parallel` first imports it (trainer, evaluation); nor
does our attention import them."""

from __future__ import annotations

import sys

import pytest

from tests.support.helpers import run

pytestmark = pytest.mark.multiprocess  # each test runs a fresh interpreter, to see what it imports

_LEAN = """
import sys, torch
compile_before = torch.compile
from megatron_ext.compat.lean_import import import_lean
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


_FIRST_IMPORT = """
import sys
# The CPU entry points import no megatron-core before init_parallel, which imports it lean.
import megatron_ext.train.pretrain_llava, megatron_ext.train.trainer, megatron_ext.commands.eval
import megatron_ext.eval.checkpoints, megatron_ext.convert.compare
# SDPAttention imports torch's varlen_attn (which imports TorchDynamo) only where it calls it: on a GPU.
import megatron_ext.model.attention
before = "megatron.core" in sys.modules
from megatron_ext.distributed import init_parallel, shutdown
init_parallel(1, 1)
shutdown()
print(before, [name for name in ("torch._dynamo", "torch._inductor", "wandb") if name in sys.modules])
"""


def test_cpu_processes_import_megatron_core_lean_through_init_parallel():
    out = run([sys.executable, "-c", _FIRST_IMPORT], timeout=180).stdout.split("\n")[-2]
    assert out == "False []"


_SHUTDOWN_BEFORE_SETUP = """
import sys
from megatron_ext.distributed import shutdown
shutdown()  # what a command's `finally` runs after a bad flag stopped it before any rank was set up
print("megatron.core" in sys.modules)
"""


def test_shutting_down_before_any_setup_imports_no_megatron_core():
    """A command stopped by a bad flag answers in seconds: its shutdown imported megatron-core whole
    (W&B included), 9 of evaluate.py's 14 s to say `--fast-n 0` is wrong."""
    out = run([sys.executable, "-c", _SHUTDOWN_BEFORE_SETUP], timeout=180).stdout.split("\n")[-2]
    assert out == "False"
