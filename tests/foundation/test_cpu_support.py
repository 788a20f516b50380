"""megatron_ext.cpu_support turns megatron-core's CUDA requests into CPU ones (every CPU training,
conversion and generation test runs megatron-core through it)."""

from __future__ import annotations

import pytest


def test_cuda_requests_become_cpu_tensors():
    import torch

    from megatron_ext import cpu_support

    if torch.cuda.is_available():
        pytest.skip("CUDA present: cpu_support must stay inactive")
    assert cpu_support.apply() is True
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(3).cuda().device.type == "cpu"
    assert torch.empty(1, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    torch.cuda.synchronize()
