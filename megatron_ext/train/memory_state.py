"""Parameters, gradient buffers and optimizer state of one rank, read from its model's module tree.

The model is the one the run builds for that rank (on the meta device: `model/meta_ranks.py`),
frozen the way the trainer freezes it (`model_setup.freeze_for_stage`: stage, --freeze-lm,
--unfreeze-vit, LoRA adapters), so which tensors train is decided by the same code as in the run.
"""

from __future__ import annotations

from dataclasses import dataclass

# megatron-core's DDP keeps gradients in fp32: the trainer sets grad_reduce_in_fp32 (model_setup.py).
GRAD_BYTES = 4
# Adam's two moments are fp32; a 16-bit model also gets an fp32 master copy of each trained
# parameter (megatron-core's Float16OptimizerWithFloat16Params / distributed optimizer).
MOMENT_BYTES = 2 * 4
MASTER_BYTES = 4


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


def state_bytes(model, dist_optim: bool, dp: int) -> StateBytes:
    """`model`: this rank's LLaVAModel, frozen for the run. With --dist-optim megatron-core shards the
    optimizer state over the `dp` data-parallel ranks (not counted: its padding of each gradient
    bucket to a multiple of the DP size, under 128 x DP elements a bucket)."""
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    trained_numel = sum(p.numel() for p in trained)
    sixteen_bit = any(p.element_size() == 2 for p in trained)
    per_element = MOMENT_BYTES + (MASTER_BYTES if sixteen_bit else 0)
    optimizer = trained_numel * per_element
    if dist_optim:
        optimizer = -(-optimizer // dp)
    return StateBytes(
        trained=trained_numel,
        frozen=sum(p.numel() for p in params) - trained_numel,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        grad_bytes=trained_numel * GRAD_BYTES,
        optimizer_bytes=optimizer,
    )
