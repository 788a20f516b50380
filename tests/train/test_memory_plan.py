"""The memory plan (megatron_ext/train/memory_plan.py) against a real run's model on the CPU.

Parameters, gradient buffers and optimizer state must be the bytes the trainer's own model,
megatron-core's DDP buffers and its Adam hold, exactly; the activation terms within 10% of what
autograd saves in a real forward of the whole model.
"""

from __future__ import annotations

import json

import pytest

from megatron_ext.train.options import TrainConfig
from tests.shapes import SHAPES, narrowed

GIB = 2**30
SMALL_LLAVA = narrowed(json.loads((SHAPES / "llava" / "llava-hf--llava-1.5-7b-hf.json").read_text()))


def cpu_plan(**options):
    from megatron_ext.train.memory_plan import published_shape_plan

    config = TrainConfig(train_iters=1, global_batch_size=1, seq_length=options.pop("seq_length", 256), **options)
    return published_shape_plan(SMALL_LLAVA, config, world_size=1, te=False, on_gpu=False)


def real_state(plan) -> tuple[int, int, int]:
    """(parameter, gradient buffer, optimizer state) bytes of the trainer's model for `plan`, after one
    Adam step (its moments exist from then), in a process group of one."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from megatron_ext import cpu_support
    from megatron_ext.train.model_setup import build_training_model

    cpu_support.apply()
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1)
        trained = build_training_model(plan)
        params = sum(p.numel() * p.element_size() for p in trained.model.parameters())
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in trained.ddp.buffers)
        trained.ddp.zero_grad_buffer()
        trained.optimizer.step()
        by_param = {id(p): p for p in trained.model.parameters()}
        optimizer = 0
        for inner in (trained.optimizer.optimizer,):
            for p, state in inner.state.items():
                # Adam's moments; torch's Adam also keeps a 0-dim step counter per tensor (not counted).
                optimizer += sum(t.numel() * t.element_size() for t in state.values()
                                 if torch.is_tensor(t) and t.numel() == p.numel())
                if id(p) not in by_param:  # an fp32 master copy of a 16-bit parameter
                    optimizer += p.numel() * p.element_size()
        return params, grads, optimizer
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


CASES = {
    "stage 1": dict(stage=1),
    "stage 2": dict(stage=2),
    "stage 2, vision tower trained": dict(stage=2, unfreeze_vit=True),
    "LoRA": dict(stage=2, lora_rank=4, lora_train_projector=True),
}


@pytest.mark.multiprocess  # a gloo process group of one, in this process
@pytest.mark.timeout(240)
def test_state_bytes_equal_a_real_runs_model_buffers_and_optimizer():
    from megatron_ext.train.memory_plan import memory_plan

    for name, options in CASES.items():
        plan = cpu_plan(**options)
        (rank,) = memory_plan(plan, 80 * GIB).ranks
        s = rank.state
        assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == real_state(plan), name
        assert s.trained > 0 and (s.frozen > 0) == (name != "stage 2, vision tower trained"), name


def test_a_plan_over_budget_is_refused_in_one_line_naming_its_largest_part_and_what_fits():
    from megatron_ext.train.memory_plan import gib, largest_part, memory_plan, refusal

    plan = cpu_plan(stage=2, seq_length=2048, attention_backend="local", recompute_granularity="none")
    full = memory_plan(plan, 80 * GIB)
    rank = full.largest
    name, size = largest_part(rank)
    assert name == "language-model activations" and size == rank.lm_activations > rank.state.total
    # A GPU just too small for this, large enough once layers are recomputed.
    budget = int(rank.total / 0.92) - 1
    over = memory_plan(plan, budget)
    assert not over.fits
    line = refusal(plan, over)
    assert "\n" not in line
    assert line.startswith(f"memory plan: stage 1/1, tp rank 0 needs {gib(rank.total)}")
    assert f"largest part: language-model activations {gib(size)} at --seq-length 2048" in line
    assert "--recompute-granularity selective fits" in line and "--recompute-granularity full fits" in line
    selective = memory_plan(plan, budget, dataclasses_replace_recompute(over.knobs, "selective"))
    assert selective.fits and selective.largest.lm_activations < rank.lm_activations / 2


def dataclasses_replace_recompute(knobs, granularity):
    import dataclasses

    from megatron_ext.train.activation_model import Recompute

    return dataclasses.replace(knobs, recompute=Recompute(granularity))
