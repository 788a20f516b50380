"""One training iteration: megatron-core's forward/backward schedule, then the optimizer step.

The loss is the token-weighted mean over every loss-masked token of the global batch (per-token
loss mode), so TP/PP/DP layouts and packed or unpacked batches give the same number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from megatron_ext.distributed import device


@dataclass
class StepResult:
    loss: float  # token-weighted mean over the global batch (nan when not finite)
    loss_tokens: int
    grad_norm: float | None
    updated: bool  # False: skipped iteration or non-finite loss

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)


def combined_length(input_ids: torch.Tensor, image_token_index: int, img_seq_len: int, max_length: int,
                    pipeline_parallel: bool) -> int:
    """The language-model sequence length LLaVAModel makes of this batch (images expanded).

    Mirrors LLaVAModel._preprocess_data: under pipeline parallelism it pads to the max length.
    """
    if pipeline_parallel:
        return max_length
    images = (input_ids == image_token_index).sum(dim=1)
    return int(min(max_length, (input_ids.shape[1] + images * (img_seq_len - 1)).max()))


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    loss_mask = loss_mask.float()
    total = (per_token_loss.float() * loss_mask).sum()
    tokens = loss_mask.sum().to(torch.int)
    return total, tokens, {"loss": torch.stack([total.detach(), tokens.float()])}


def make_forward_step(arch, seq_length: int, pipeline_parallel: bool):
    from megatron_ext.data.packing import packed_attention_mask

    dev = device()

    def forward_step(data_iterator, model):
        batch = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in next(data_iterator).items()}
        mask = None
        if int(batch["segment_ids"].max()) > 1:
            length = combined_length(batch["input_ids"], arch.image_token_index, arch.img_seq_len, seq_length,
                                     pipeline_parallel)
            mask = packed_attention_mask(batch["input_ids"], batch["segment_ids"], arch.image_token_index,
                                         arch.img_seq_len, length)
        # An empty images tensor (not None) is how LLaVAModel takes a text-only batch.
        output, loss_mask = model(images=batch["images"], input_ids=batch["input_ids"],
                                  position_ids=None, attention_mask=mask, labels=batch["labels"],
                                  loss_mask=batch["loss_mask"])
        return output, partial(_loss_func, loss_mask)

    return forward_step


def reduce_loss(losses: list[dict]) -> tuple[float, int]:
    """Token-weighted loss over the global batch, known on every rank."""
    from megatron.core import parallel_state

    summed = torch.zeros(2, dtype=torch.float64, device=device())
    for item in losses:
        summed += item["loss"].to(summed)
    # Only the last pipeline stage has losses: spread them over the stage group, then sum over DP.
    torch.distributed.all_reduce(summed, group=parallel_state.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(summed, group=parallel_state.get_data_parallel_group())
    total, tokens = summed.tolist()
    return (total / tokens if tokens else float("nan")), int(tokens)


def _schedule(model, forward_step, micro_batches: list[dict], seq_length: int, micro_batch_size: int,
              forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def train_step(trained, forward_step, micro_batches: list[dict], seq_length: int, micro_batch_size: int) -> StepResult:
    trained.ddp.zero_grad_buffer()
    trained.optimizer.zero_grad()
    loss, tokens = reduce_loss(_schedule(trained.ddp, forward_step, micro_batches, seq_length, micro_batch_size, False))
    if not math.isfinite(loss):
        return StepResult(loss, tokens, None, updated=False)
    _, grad_norm, _ = trained.optimizer.step()
    trained.scheduler.step(increment=1)
    return StepResult(loss, tokens, grad_norm, updated=True)


def eval_loss(model, forward_step, micro_batches: list[dict], seq_length: int, micro_batch_size: int) -> tuple[float, int]:
    """Token-weighted loss of one global batch, forward only. `model`: the trainer's DDP module or a
    bare LLaVAModel (scripts/eval/evaluate.py)."""
    with torch.no_grad():
        return reduce_loss(_schedule(model, forward_step, micro_batches, seq_length, micro_batch_size, True))
