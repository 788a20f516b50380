"""Parameters, gradient buffers and optimizer state of one rank, read from its model's module tree.

The model is the one the run builds for that rank (on the meta device: `memory/meta_ranks.py`),
frozen the way the trainer freezes it (`model_setup.freeze_for_stage`: stage, --freeze-lm,
--unfreeze-vit, LoRA adapters), so which tensors train is decided by the same code as in the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ext.model.sequence_alignment import round_up

# megatron-core's DDP keeps gradients in fp32: the trainer sets grad_reduce_in_fp32 (model_setup.py).
GRAD_BYTES = 4
# Optimizer state is fp32: Adam's two moments, SGD's momentum buffer (none without momentum); a
# 16-bit model also gets an fp32 master copy of each trained parameter (megatron-core's
# Float16OptimizerWithFloat16Params / distributed optimizer).
MOMENT_BYTES = 4
MASTER_BYTES = 4


def moments(optimizer: str, sgd_momentum: float) -> int:
    """fp32 tensors of optimizer state per trained parameter (--optimizer, --sgd-momentum)."""
    return 2 if optimizer == "adam" else int(sgd_momentum != 0)


@dataclass(frozen=True)
class StateBytes:
    trained: int  # parameters (elements) that train on this rank
    frozen: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


def ddp_bucket_size(overlap_grad_reduce: bool, bucket_size: int | None, dp: int, stage: int) -> int | None:
    """The bucket size megatron-core 0.16's DDP uses on a rank of pipeline stage `stage` (None: one
    bucket per buffer): its default grows with DP; without overlapped reduction, and on every stage
    but the first, it does not split buffers."""
    if not overlap_grad_reduce or stage > 0:
        return None
    return bucket_size if bucket_size is not None else max(40_000_000, 1_000_000 * dp)


@dataclass(frozen=True)
class Bucket:
    start: int  # elements into its buffer
    end: int  # padded: with the distributed optimizer, a multiple of lcm(DP, 128)
    params: tuple[tuple[int, int], ...]  # each parameter's (start, end) in the buffer


def buffer_layout(params: list, dist_optim: bool, dp: int, bucket_size: int | None) -> list[Bucket]:
    """Where megatron-core 0.16's `_ParamAndGradBuffer` puts `params` (one dtype's trained parameters,
    in the module's order): from the last parameter back, in buckets of about `bucket_size`
    elements; with the distributed optimizer each parameter starts at a multiple of 64 and each
    bucket ends at a multiple of lcm(DP, 128), and a shared embedding gets a bucket of its own."""
    buckets, current, bucket_start, start = [], [], 0, 0
    end_divisor = math.lcm(dp, 128) if dist_optim else 1

    def close(end: int) -> int:
        nonlocal current, bucket_start
        end = round_up(end, end_divisor)
        buckets.append(Bucket(bucket_start, end, tuple(current)))
        current, bucket_start = [], end
        return end

    for param in reversed(params):
        own_bucket = dist_optim and getattr(param, "shared_embedding", False)
        start = round_up(start, 64) if dist_optim else start
        if own_bucket and current:
            start = close(start)
        end = start + param.numel()
        current.append((start, end))
        start = close(end) if (bucket_size is not None and end - bucket_start >= bucket_size) or own_bucket else end
    if current:
        close(start)
    return buckets


def _shard_elements(buckets: list[Bucket], dp: int, dp_rank: int) -> int:
    """Elements of parameters (padding not) in `dp_rank`'s shard of every bucket: what the
    distributed optimizer keeps state for on that rank."""
    total = 0
    for b in buckets:
        size = (b.end - b.start) // dp
        lo, hi = b.start + dp_rank * size, b.start + (dp_rank + 1) * size
        total += sum(max(0, min(hi, e) - max(lo, s)) for s, e in b.params)
    return total


def state_bytes(model, dist_optim: bool, dp: int, bucket_size: int | None = None, moments: int = 2) -> StateBytes:
    """`model`: this rank's LLaVAModel, frozen for the run; `bucket_size`: `ddp_bucket_size`'s;
    `moments`: `moments(...)` of the run's optimizer. With
    --dist-optim megatron-core keeps trained parameters and gradients in padded buffers and shards
    the optimizer state over the `dp` data-parallel ranks, unevenly where padding falls: the largest
    share is counted."""
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    trained_numel = sum(p.numel() for p in trained)
    frozen_bytes = sum(p.numel() * p.element_size() for p in params if not p.requires_grad)
    sixteen_bit = any(p.element_size() == 2 for p in trained)
    per_element = moments * MOMENT_BYTES + (MASTER_BYTES if sixteen_bit else 0)
    buffers = {}
    for p in trained:
        buffers.setdefault(p.dtype, []).append(p)
    layouts = {dtype: buffer_layout(ps, dist_optim, dp, bucket_size) for dtype, ps in buffers.items()}
    buffer_numel = {dtype: (b[-1].end if b else 0) for dtype, b in layouts.items()}
    if dist_optim:
        # The distributed optimizer maps trained parameters into the padded buffer too.
        param_bytes = frozen_bytes + sum(n * buffers[dtype][0].element_size() for dtype, n in buffer_numel.items())
        optimizer_elements = max(sum(_shard_elements(b, dp, r) for b in layouts.values()) for r in range(dp))
    else:
        param_bytes = frozen_bytes + sum(p.numel() * p.element_size() for p in trained)
        optimizer_elements = trained_numel
    return StateBytes(
        trained=trained_numel,
        frozen=sum(p.numel() for p in params) - trained_numel,
        param_bytes=param_bytes,
        grad_bytes=sum(buffer_numel.values()) * GRAD_BYTES,
        optimizer_bytes=optimizer_elements * per_element,
    )
