"""model/float8_linears.py: megatron-core's linear function through a weight's torchao float8 twin
(`--fp8 --fp8-backend torchao`). Training with it: tests/train/test_parallel_losses.py,
tests/train/test_compiled_layers.py; refusals: tests/launch/test_validation.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.errors import UserError
from megatron_ext.model import float8_linears

pytest.importorskip("torchao", reason="needs torchao (pip install 'megatron-ext[fp8]')")


def _count_float8_gemms(monkeypatch) -> list:
    """torch._scaled_mm's calls with float8 operands from now on (one entry each): the GEMM torchao calls."""
    calls, scaled_mm = [], torch._scaled_mm

    def counted(a, b, *args, **kwargs):
        if a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            calls.append((a.dtype, b.dtype))
        return scaled_mm(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


def _weight(out_features=48, in_features=32, seed=0) -> torch.nn.Parameter:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(torch.randn(out_features, in_features, generator=gen) / in_features**0.5)
    float8_linears.attach([("decoder.layers.0.mlp.linear_fc1", weight)])
    return weight


def test_a_weight_with_a_twin_runs_forward_and_both_backward_gemms_in_float8(monkeypatch):
    weight, bias = _weight(), torch.nn.Parameter(torch.randn(48))
    x = torch.randn(4, 8, 32, requires_grad=True)
    reference = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    gemms = _count_float8_gemms(monkeypatch)
    output = float8_linears.linear(x, weight, bias, False, False, False)
    assert gemms == [(torch.float8_e4m3fn, torch.float8_e4m3fn)]  # activations and weights in e4m3
    output.square().sum().backward()
    assert len(gemms) == 3 and all(torch.float8_e5m2 in operands for operands in gemms[1:])  # e5m2 gradients
    expected = F.linear(*reference)
    expected.square().sum().backward()
    # float8 operands (3 mantissa bits for e4m3, 2 for e5m2 gradients): near the fp32 result, never equal to it.
    for got, exact in zip((output, x.grad, weight.grad, bias.grad), (expected, *(t.grad for t in reference))):
        error = ((got - exact).norm() / exact.norm()).item()
        assert 0 < error < 0.1, error


def test_the_twin_holds_the_layers_own_parameter_so_updates_and_checkpoints_are_the_layers():
    module = torch.nn.Module()
    module.weight = _weight()
    twin = getattr(module.weight, float8_linears.TWIN)
    assert twin.weight is module.weight
    assert list(module.state_dict()) == ["weight"] and [p for p in module.parameters()] == [module.weight]
    x = torch.randn(16, 32)
    before = float8_linears.linear(x, module.weight, None, False, False, False)
    with torch.no_grad():
        module.weight.mul_(2)  # what an optimizer step does to the layer's parameter
    after = float8_linears.linear(x, module.weight, None, False, False, False)
    assert torch.allclose(after, 2 * before, rtol=0.1, atol=0.1) and not torch.equal(after, before)


def test_calls_that_communicate_or_have_no_twin_go_to_the_function_replaced(monkeypatch):
    calls = []
    monkeypatch.setattr(float8_linears, "_PREVIOUS", lambda *args: calls.append(args) or "replaced")
    plain, twinned, x = torch.nn.Parameter(torch.randn(48, 32)), _weight(), torch.randn(2, 32)
    assert float8_linears.linear(x, plain, None, False, False, False) == "replaced"
    assert float8_linears.linear(x, twinned, None, False, True, False) == "replaced"  # all-reduces its dgrad
    assert float8_linears.linear(x, twinned, None, False, False, True) == "replaced"  # sequence parallel
    assert len(calls) == 3
    assert float8_linears.linear(x, twinned, None, False, False, False).shape == (2, 48)


def test_megatron_cores_warn_once_flag_moves_to_its_replacement(monkeypatch):
    """megatron-core's function reads and sets its flag through the name the replacement now holds."""
    from megatron.core.tensor_parallel import layers

    original = layers.linear_with_grad_accumulation_and_async_allreduce
    monkeypatch.setattr(layers, "linear_with_grad_accumulation_and_async_allreduce", original)
    monkeypatch.setattr(float8_linears, "_PREVIOUS", None)
    float8_linears._install()
    assert layers.linear_with_grad_accumulation_and_async_allreduce is float8_linears.linear
    assert float8_linears._PREVIOUS is original and float8_linears.linear.warned is original.warned


def test_a_layer_whose_sizes_float8_gemms_cannot_take_is_refused_in_one_line():
    weight = torch.nn.Parameter(torch.randn(24, 32))
    with pytest.raises(UserError) as error:
        float8_linears.attach([("layers.1.self_attention.linear_qkv", weight)])
    assert str(error.value) == ("--fp8-backend torchao: the language model's layers.1.self_attention.linear_qkv is "
                                "24 x 32; float8 GEMMs need both sizes multiples of 16 (use --fp8-backend te or drop "
                                "--fp8)")
    assert not hasattr(weight, float8_linears.TWIN)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_run_saved_with_float8_linears_resumes_without_them_and_back(tmp_path, megatron_clip, train_data):
    """The twins are outside the module tree: the checkpoint holds the layers' own weights and optimizer
    state, which a run without --fp8 loads, and a float8 run loads back."""
    import math

    from megatron_ext.checkpoint import layout
    from tests.support.training import metrics, train, trainer_args

    save = tmp_path / "run"
    common = dict(global_batch_size=4, micro_batch_size=2, save_interval=2, save_optim=True, eval_interval=None)
    for iters, fp8 in ((2, True), (4, False), (6, True)):
        options = dict(fp8=True, fp8_backend="torchao") if fp8 else {}
        train(1, *trainer_args(megatron_clip, train_data, save, train_iters=iters, **common, **options), timeout=300)
    records = metrics(save)
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert all(r["update"] and math.isfinite(r["loss"]) for r in records.values())
    assert layout.find_snapshot(save / layout.snapshot_name(2)).trainer_options["fp8_backend"] == "torchao"
    assert layout.find_snapshot(save / layout.snapshot_name(4)).trainer_options["fp8"] is False
    assert layout.find_snapshot(save).trainer_options["fp8"] is True
