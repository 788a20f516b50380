"""--fused-adam (train/fused_adam.py): torch's fused AdamW inside megatron-core's optimizer takes the
foreach one's steps, and keeps the run's choice across a checkpoint's load, with `step` where the
kernel wants it (placement checked by the GPU rehearsal's ledger). Training with it:
test_parallel_losses."""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch

from megatron_ext.checkpoint import layout
from megatron_ext.errors import UserError
from megatron_ext.train import fused_adam
from tests.support.training import metrics, trainer_args
from tests.train.gpu_rehearsal import DEVICE, HOST, DeviceLedger, DeviceMixError, mark, place


@contextlib.contextmanager
def _rehearsed_gpu():
    """As the rehearsal runs the trainer: CUDA requests land on the CPU, the ledger above watching."""
    from megatron_ext.compat.cpu_support import _CudaToCpuMode

    with _CudaToCpuMode(), DeviceLedger() as ledger:
        yield ledger


def _megatron_like(params, **kwargs):
    """megatron-core's optimizer as fused_adam sees it: a chain of wrappers around torch's AdamW, built
    the way megatron-core builds it (no `fused`, no `foreach`)."""
    adam = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, **kwargs)
    return types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=adam)]), adam


def _params(where=None):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=gen)) for shape in ((5, 3), (7,), (2, 2, 2))]
    return [mark(p, where) for p in params] if where else params


def _train(adam, params, steps=3):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p)
        adam.step()


def test_the_fused_kernel_takes_the_foreach_kernels_steps():
    runs = {}
    for fused in (False, True):
        params = _params()
        optimizer, adam = _megatron_like(params)
        assert fused_adam.use(optimizer, fused) == 1
        _train(adam, params)
        assert adam.param_groups[0]["fused"] is (True if fused else None)
        runs[fused] = [p.detach().clone() for p in params]
    for foreach, fused in zip(runs[False], runs[True]):
        assert torch.allclose(foreach, fused, rtol=1e-6, atol=1e-7)
    assert not torch.equal(runs[True][0], _params()[0])  # it trained


def _foreach_checkpoint() -> dict:
    params = _params()
    _, saved = _megatron_like(params)
    _train(saved, params)
    return saved.state_dict()


def _load(state_dict: dict, fused: bool, step_place: str):
    """A fused or foreach run on device parameters given `state_dict` as a GPU load leaves it: the
    moments beside their parameters, `step` where the saved run kept it."""
    params = _params(DEVICE)
    optimizer, adam = _megatron_like(params)
    fused_adam.use(optimizer, fused)
    adam.load_state_dict(state_dict)
    for p in params:
        state = adam.state[p]
        mark(state["exp_avg"], DEVICE), mark(state["exp_avg_sq"], DEVICE), mark(state["step"], step_place)
    return adam, params


def test_a_loaded_checkpoint_keeps_the_runs_choice_and_its_step_beside_the_parameter():
    """A foreach run's state loaded into a fused run: the next step runs fused, its steps moved beside
    the parameters (else the fused kernel would mix host and device tensors); loaded back into a
    foreach run, the steps return to the host."""
    adam, params = _load(_foreach_checkpoint(), fused=True, step_place=HOST)
    assert adam.param_groups[0]["fused"] is None  # what the checkpoint said
    with _rehearsed_gpu():
        _train(adam, params, steps=1)
    assert adam.param_groups[0]["fused"] is True
    assert all(place(adam.state[p]["step"]) == DEVICE and float(adam.state[p]["step"]) == 4.0 for p in params)
    foreach, back = _load(adam.state_dict(), fused=False, step_place=DEVICE)
    with _rehearsed_gpu() as ledger:
        _train(foreach, back, steps=2)
    assert foreach.param_groups[0]["fused"] is None
    assert all(place(foreach.state[p]["step"]) == HOST for p in back)
    assert sum(ledger.reads.values()) == len(back)  # each step tensor copied back once, not at every step


def test_the_fused_kernel_refuses_host_steps_beside_device_parameters_in_the_rehearsal():
    """The check above has teeth: without the move, the fused kernel mixes host and device tensors."""
    adam, params = _load(_foreach_checkpoint(), fused=False, step_place=HOST)
    adam.param_groups[0].update(fused=True, foreach=False)
    adam._optimizer_step_pre_hooks.clear()
    with _rehearsed_gpu(), pytest.raises(DeviceMixError):
        _train(adam, params, steps=1)


def test_parameters_the_fused_kernel_cannot_take_are_refused_in_one_line():
    optimizer, _ = _megatron_like([torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)])
    with pytest.raises(UserError) as info:
        fused_adam.use(optimizer, True)
    assert str(info.value).startswith("--fused-adam: torch's fused AdamW takes floating-point parameters")


@pytest.mark.multiprocess
@pytest.mark.timeout(500)
def test_a_fused_run_resumes_a_foreach_runs_distributed_optimizer_on_the_rehearsed_gpu(tmp_path, megatron_clip,
                                                                                      train_data):
    """Two data-parallel ranks, the distributed optimizer's shards saved by a foreach run and resumed
    with --fused-adam: its loaded `step`s (on the host) reach the fused kernel beside their parameters;
    its own checkpoint (counters on the device) resumed without the flag again."""
    from tests.train.test_gpu_rehearsal import rehearse

    save = tmp_path / "run"
    common = dict(global_batch_size=4, micro_batch_size=1, packing_seq_length=128, dtype="bfloat16",
                  attention_backend="sdpa", dist_optim=True, save_interval=2, save_optim=True, eval_interval=None)
    for iters, fused in ((2, False), (4, True), (6, False)):
        rehearse(tmp_path, "scripts/train/pretrain_llava.py",
                 *trainer_args(megatron_clip, train_data, save, train_iters=iters, fused_adam=fused, **common), nproc=2)
    records = metrics(save)
    assert sorted(records) == [1, 2, 3, 4, 5, 6]
    assert all(r["update"] and math.isfinite(r["loss"]) for r in records.values())
    assert layout.find_snapshot(save / layout.snapshot_name(4)).trainer_options["fused_adam"] is True
    assert layout.find_snapshot(save).trainer_options["fused_adam"] is False
