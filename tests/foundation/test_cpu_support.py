"""megatron-core runs a real LLaVAModel training step on CPU through megatron_ext.cpu_support."""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers import run_torchrun

WORKER = "tests/foundation/cpu_llava_step.py"


def _run(tmp_path, llava_dir, tp, pp):
    out = tmp_path / f"tp{tp}pp{pp}.json"
    run_torchrun(tp * pp, WORKER, llava_dir, tp, pp, out, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_llava_step_on_cpu_matches_across_tensor_parallel_sizes(tmp_path, llava_clip):
    tp1 = _run(tmp_path, llava_clip, 1, 1)
    tp2 = _run(tmp_path, llava_clip, 2, 1)
    assert tp1["cpu_mode"] and tp2["cpu_mode"]
    assert all(math.isfinite(x) for step in tp1["losses"] for x in step)
    # Every parameter is trained (nothing is frozen here) and moved by the optimizer step.
    assert tp1["changed"] == tp1["params"] and tp2["changed"] == tp2["params"]
    # use_cpu_initialization builds full weights then slices them: TP2 starts from TP1's weights.
    for a, b in zip(sum(tp1["losses"], []), sum(tp2["losses"], [])):
        assert a == pytest.approx(b, rel=1e-5)
    for a, b in zip(tp1["grad_norms"], tp2["grad_norms"]):
        assert a == pytest.approx(b, rel=1e-4)


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
