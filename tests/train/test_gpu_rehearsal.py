"""The GPU rehearsal on CPU (tests/train/gpu_rehearsal.py): real trainer iterations in which a host
tensor meeting a device tensor, or a host tensor in an NCCL collective, fails as on a GPU.

The trainer before this test existed failed it at iteration 1: its batch statistics were a host
tensor all-reduced over the data-parallel group ("No backend type associated with device type cpu",
the error NCCL gives)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from megatron_ext.checkpoint import layout
from tests.helpers import child_env, run_torchrun
from tests.train.conftest import metrics, trainer_args
from tests.train.gpu_rehearsal import DEVICE, HOST, DeviceLedger, DeviceMixError, mark, place

REHEARSAL = "tests/train/gpu_rehearsal.py"


def rehearse(tmp_path, script, *args, check=True):
    """Run SCRIPT under the rehearsal; returns the process and its attention counts."""
    report = tmp_path / "rehearsal.json"
    proc = run_torchrun(1, REHEARSAL, script, *args, timeout=240, check=check,
                        env=child_env(REHEARSAL_REPORT=str(report)))
    return proc, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("options", [
    dict(attention_backend="sdpa", micro_batch_size=1),  # one packed row: THD, cu_seqlens on the device
    dict(attention_backend="sdpa", micro_batch_size=2),  # packed rows: the mask built on the device
    dict(attention_backend="local", micro_batch_size=1),  # megatron's reference kernel with that mask
], ids=["sdpa-thd", "sdpa-rows", "local"])
def test_trainer_iterations_keep_host_and_device_apart(tmp_path, megatron_clip, train_data, options):
    save = tmp_path / "run"
    args = trainer_args(megatron_clip, train_data, save, global_batch_size=4, train_iters=2, packing_seq_length=128,
                        dtype="bfloat16", eval_interval=2, eval_iters=1, **options)
    _, counts = rehearse(tmp_path, "scripts/train/pretrain_llava.py", *args)
    records = metrics(save)
    assert sorted(records) == [1, 2]
    assert all(r["update"] and math.isfinite(r["loss"]) and r["samples"] > 2 for r in records.values())
    assert math.isfinite(metrics(save, "val")[2]["loss"])
    assert layout.find_snapshot(save).iteration == 2
    if options["attention_backend"] == "sdpa":
        # One attention kernel call per layer and micro batch, packed or not.
        assert counts["attention_layers"] > 0 and counts["attention_kernels"] == counts["attention_layers"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_host_tensor_in_an_nccl_collective_fails_as_on_a_gpu(tmp_path):
    script = tmp_path / "collective.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from megatron_ext.distributed import device, init_parallel\n"
        "init_parallel()\n"
        "dist.all_reduce(torch.ones(3, device=device()))\n"
        "print('device tensor reduced', flush=True)\n"
        "dist.all_reduce(torch.ones(3))\n")
    proc, _ = rehearse(tmp_path, str(script), check=False)
    assert proc.returncode != 0
    assert "device tensor reduced" in proc.stdout
    assert "No backend type associated with device type cpu" in proc.stderr


def test_the_ledger_refuses_host_and_device_tensors_in_one_op():
    host, gpu = mark(torch.ones(4), HOST), mark(torch.ones(4), DEVICE)
    with DeviceLedger():
        with pytest.raises(DeviceMixError, match="cuda:0 and cpu"):
            host * gpu
        assert place(gpu * torch.tensor(2.0)) == DEVICE  # a 0-dim host tensor is a scalar, as on CUDA
        assert place(torch.zeros(2)) == HOST and place(torch.zeros_like(gpu)) == DEVICE
        assert gpu.device == torch.device("cuda", 0) and host.device == torch.device("cpu")
        assert place(gpu.cpu()) == HOST and place(gpu.cpu() + host) == HOST
        with pytest.raises(DeviceMixError, match="numpy"):
            gpu.numpy()
        assert place(gpu[host.long() - 1]) == DEVICE  # host indices are fine
