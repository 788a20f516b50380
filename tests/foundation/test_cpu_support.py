"""megatron_ext.compat.cpu_support turns megatron-core's CUDA requests into CPU ones (every CPU training,
conversion and generation test runs megatron-core through it)."""

from __future__ import annotations

import pytest


def test_cuda_requests_become_cpu_tensors():
    import torch

    from megatron_ext.compat import cpu_support

    if torch.cuda.is_available():
        pytest.skip("CUDA present: cpu_support must stay inactive")
    assert cpu_support.apply() is True
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(3).cuda().device.type == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    torch.cuda.synchronize()


def test_installed_megatron_core_has_every_name_the_patches_use():
    from megatron_ext.compat import cpu_support, without_te

    assert cpu_support._missing_megatron_names() == []
    assert cpu_support._missing_megatron_names(without_te._MEGATRON_NAMES) == []
    cpu_support.check_megatron_core()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_no_te_fixes_apply_without_the_cpu_support():
    """A GPU without Transformer Engine needs the norm and optimizer fixes too (the vision tower did not
    build on an H100 while they lived in cpu_support): they take effect in a process where
    cpu_support is never applied."""
    code = """
import torch
from megatron.core.models.vision import clip_vit_model
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron_ext.compat import cpu_support, without_te
defaults = clip_vit_model.CLIPViTModel.__init__.__defaults__
assert torch.nn.LayerNorm in defaults and WrappedTorchNorm not in defaults
loading = DistributedOptimizer.sharded_state_dict
without_te.apply()
defaults = clip_vit_model.CLIPViTModel.__init__.__defaults__
assert WrappedTorchNorm in defaults and torch.nn.LayerNorm not in defaults
assert DistributedOptimizer.sharded_state_dict is not loading
from megatron.core.optimizer import clip_grads
assert clip_grads.l2_norm_impl is without_te.l2_norm_on_device
from megatron.core.optimizer import optimizer
assert clip_grads.multi_tensor_scale_impl is optimizer.multi_tensor_scale_impl is without_te.scale_as_foreach
assert not cpu_support.cpu_mode_active()
print("ok")
"""
    import subprocess
    import sys

    from tests.support.helpers import child_env

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


@pytest.mark.parametrize("module_name, attribute, expected", [
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER",
     "megatron.core.tensor_parallel.random._CUDA_RNG_STATE_TRACKER"),
    ("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker",
     "megatron.core.tensor_parallel.random.CudaRNGStatesTracker"),
])
def test_a_missing_private_name_refuses_before_anything_is_patched(monkeypatch, module_name, attribute, expected):
    import importlib

    import megatron.core
    import torch

    from megatron_ext.compat import cpu_support, releases
    from megatron_ext.errors import UserError

    if torch.cuda.is_available():
        pytest.skip("CUDA present: apply() patches nothing and checks nothing")
    owner = importlib.import_module(module_name)
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    monkeypatch.delattr(owner, name)
    # Another test of this process may have applied the patches already: make apply() start over,
    # with stand-ins that show whether it replaced anything.
    monkeypatch.setattr(cpu_support, "_APPLIED", False)
    current_device = object()
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.tensor_parallel import random as mp_random

    get_rng_state, sharded_state_dict = mp_random._get_cuda_rng_state, DistributedOptimizer.sharded_state_dict
    mode_stack_depth = torch._C._len_torch_function_stack()

    with pytest.raises(UserError) as refused:
        cpu_support.apply()

    message = str(refused.value)
    assert "\n" not in message
    assert expected in message
    assert f"megatron-core {megatron.core.__version__} " in message
    assert f"install {releases.SUPPORTED}," in message
    assert cpu_support._APPLIED is False
    assert torch.cuda.current_device is current_device
    assert mp_random._get_cuda_rng_state is get_rng_state
    assert DistributedOptimizer.sharded_state_dict is sharded_state_dict
    assert torch._C._len_torch_function_stack() == mode_stack_depth


def test_a_missing_constructor_parameter_is_named(monkeypatch):
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel

    from megatron_ext.compat import cpu_support, without_te

    def without_ln_post_impl(self, transformer_config, transformer_layer_spec, ln_pre_impl=None):
        pass

    monkeypatch.setattr(CLIPViTModel, "__init__", without_ln_post_impl)
    assert cpu_support._missing_megatron_names(without_te._MEGATRON_NAMES) == [
        "megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__(ln_post_impl)"]


def test_the_gradient_norm_kept_on_the_device_equals_megatron_cores_host_one():
    """megatron-core's local_multi_tensor_l2_norm: each tensor's norm, a host tensor of them, its
    norm; ours reads nothing back and gives the same float32 number."""
    import torch

    from megatron_ext.compat.without_te import l2_norm_on_device

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) * scale for shape, scale in (((7, 5), 1e-3), ((11,), 3.0), ((2, 3, 4), 0.5))]
    megatrons = torch.norm(torch.tensor([torch.norm(g) for g in grads]))
    norm, per_tensor = l2_norm_on_device(2048 * 32, None, [grads], False)
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    assert torch.equal(norm[0], megatrons)


@pytest.mark.parametrize("case", ["clip gradients in place", "main fp32 params into bf16 model params",
                                  "another scale into other tensors"])
def test_the_foreach_multi_tensor_scale_equals_megatron_cores_loop(case):
    import torch
    from megatron.core.utils import local_multi_tensor_scale

    from megatron_ext.compat.without_te import scale_as_foreach

    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(shape, generator=gen) for shape in ((7, 5), (11,), (2, 3, 4))]
    dtype, scale = {"clip gradients in place": (None, 0.37), "main fp32 params into bf16 model params":
                    (torch.bfloat16, 1.0), "another scale into other tensors": (torch.float32, 2.5)}[case]
    results = []
    for impl in (local_multi_tensor_scale, scale_as_foreach):
        src = [t.clone() for t in sources]
        dst = src if dtype is None else [torch.zeros_like(t, dtype=dtype) for t in src]
        impl(2048 * 32, None, [src, dst], scale)
        results.append(dst)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(*results))
