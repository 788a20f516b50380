"""The forward step and loss that megatron-core's pipeline schedules run, for training and evaluation.

The loss is the token-weighted mean over every loss-masked token of the global batch (per-token
loss mode), so TP/PP/DP layouts and packed or unpacked batches give the same number. The trainer
(`train.step`) and scripts/eval/evaluate.py both use these, so their losses are the same number.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from megatron_ext.distributed import device
from megatron_ext.model.inputs import ModelInputs
from megatron_ext.model.mrope_inputs import MRopeInputs


def _loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    loss_mask = loss_mask.float()
    total = (per_token_loss.float() * loss_mask).sum()
    tokens = loss_mask.sum().to(torch.int)
    return total, tokens, {"loss": torch.stack([total.detach(), tokens.float()])}


def _llava(model):
    """The LLaVAModel (or `mrope_vlm` model) inside megatron's wrappers (DDP, Float16Module)."""
    while not hasattr(model, "add_encoder"):
        model = model.module
    return model


def _zero_from_trained_encoder(llava) -> torch.Tensor:
    """0, computed from every trained parameter of the vision tower and projector.

    megatron's DDP reduces a gradient bucket once every parameter in it has a gradient from the last
    micro batch (with --overlap-grad-reduce); a micro batch without images never runs the vision
    side, so its buckets would never be reduced. Adding this to the output gives those parameters a
    zero gradient instead (LLaVA and megatron-core's FSDP path do the same with a dummy image).
    """
    trained = [p for module in (llava.vision_model, llava.vision_projection) if module is not None
               for p in module.parameters() if p.requires_grad]
    # A tiled LLaVA's row newline is applied to image features only.
    newline = getattr(llava, "image_newline", None)
    if newline is not None and newline.requires_grad:
        trained.append(newline)
    return sum((p.sum() for p in trained), torch.zeros(())) * 0.0


def token_loss(batch: dict, inputs: dict, loss_mask: torch.Tensor):
    """The language-model loss function of a micro batch (megatron's `loss_func` of the output)."""
    return partial(_loss_func, loss_mask)


class ForwardStep:
    """megatron's forward_step_func over micro-batch dicts, laid out for the model by `inputs`;
    `loss_of(batch, model_inputs, loss_mask)` gives the loss function of its output (DPO's: `objectives.dpo`)."""

    def __init__(self, inputs: ModelInputs | MRopeInputs, loss_of=token_loss):
        self.inputs, self.loss_of = inputs, loss_of

    def __call__(self, data_iterator, model):
        batch = next(data_iterator)
        kwargs = self.inputs(batch)
        output, loss_mask = model(**kwargs)
        llava = _llava(model)
        if llava.add_encoder and self.inputs.media_count(batch) == 0 and torch.is_grad_enabled():
            output = output + _zero_from_trained_encoder(llava).to(output)
        return output, self.loss_of(batch, kwargs, loss_mask)

    def step_batches(self, model, micro_batches: list[dict]) -> Iterator[dict]:
        """The step's micro batches, in order, with what is computed once for many of them (a frozen
        tower's output), each computed when the schedule reaches it."""
        from megatron_ext.model.step_vision import with_tower_features

        return with_tower_features(_llava(model), self.inputs, micro_batches)


def make_forward_step(inputs: ModelInputs, loss_of=token_loss) -> ForwardStep:
    return ForwardStep(inputs, loss_of)


def reduce_sums(items: list[dict], key: str, size: int) -> list[float]:
    """The sum over the global batch of the loss functions' `key` vectors, known on every rank."""
    from megatron.core import parallel_state

    summed = torch.zeros(size, dtype=torch.float64, device=device())
    for item in items:
        summed += item[key].to(summed)
    # Only the last pipeline stage has losses: spread them over the stage group, then sum over DP
    # (context-parallel ranks each hold part of every sequence).
    torch.distributed.all_reduce(summed, group=parallel_state.get_pipeline_model_parallel_group())
    torch.distributed.all_reduce(summed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return summed.tolist()


def reduce_loss(losses: list[dict]) -> tuple[float, int]:
    """Token-weighted loss over the global batch, known on every rank."""
    total, tokens = reduce_sums(losses, "loss", 2)
    return (total / tokens if tokens else float("nan")), int(tokens)


def token_objective(losses: list[dict]) -> tuple[float, int, dict]:
    """The language-model loss of a step's loss-function outputs, with no further metrics."""
    return (*reduce_loss(losses), {})


def run_schedule(model, forward_step: ForwardStep, micro_batches: list[dict], seq_length: int, micro_batch_size: int,
              forward_only: bool) -> list[dict]:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=forward_step.step_batches(model, micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def eval_loss(model, forward_step, micro_batches: list[dict], seq_length: int, micro_batch_size: int) -> tuple[float, int]:
    """Token-weighted loss of one global batch, forward only. `model`: the trainer's DDP module or a
    bare LLaVAModel (scripts/eval/evaluate.py). No `micro_batches` (a data-parallel rank whose share
    of a small split is used up): this rank adds nothing to the others' sums."""
    with torch.no_grad():
        return reduce_loss(run_schedule(model, forward_step, micro_batches, seq_length, micro_batch_size, True)
                           if micro_batches else [])
