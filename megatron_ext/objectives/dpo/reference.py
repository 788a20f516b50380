"""DPO's reference policy: the starting checkpoint, frozen, at the run's layout.

--reference-logprobs live (default): each step runs the reference forward-only through
megatron-core's schedule on the step's micro batches and stores each pair's (chosen, rejected)
log-probabilities in them as `ref_logps`, on the last pipeline stage where the loss needs them.
Without LoRA the reference is a second copy of the model (no gradients, no optimizer state) loaded
from --megatron-load-dir (also when a run resumes: the reference never moves); with LoRA it is the
trained model with its adapters off, as PEFT's reference is: no copy.

--reference-logprobs precompute: before training, one forward-only pass of the starting model
over the train split (and the val batches evaluations use); the log-probabilities are kept by pair
key and written to SAVE_DIR/reference_logps.json (a resumed run reads them back). One model in
memory. Pair keys are the shards' sample keys: a blend of datasets whose keys collide needs live.
"""

from __future__ import annotations

import contextlib
import json
from functools import partial
from pathlib import Path

import torch

from megatron_ext.config.run_plan import RunPlan
from megatron_ext.errors import UserError
from megatron_ext.fsutil import atomic_write_text
from megatron_ext.lora.checkpoint import load_snapshot_weights
from megatron_ext.lora.layers import adapters_off, has_lora
from megatron_ext.model.forward_step import make_forward_step, run_schedule
from megatron_ext.model.inputs import ModelInputs
from megatron_ext.objectives.dpo.sequences import PairPositions


def _frozen_copy(plan: RunPlan):
    from megatron.core.transformer.module import Float16Module

    from megatron_ext.families import build_model
    from megatron_ext.model.provider import ModelOptions

    # The trained model's options, without its random initialisation.
    model = build_model(plan.arch, ModelOptions.for_run(plan, init_weights=False))
    load_snapshot_weights(model, plan.start)
    model.requires_grad_(False)
    # The loss functions' outputs are sums with their counts, as for the trained model.
    model.config.calculate_per_token_loss = True
    return Float16Module(model.config, model) if plan.dtype == "bfloat16" else model


def _logps_only(inputs: ModelInputs, batch: dict, kwargs: dict, loss_mask: torch.Tensor):
    pairs = PairPositions.of(batch)

    def loss(output: torch.Tensor):
        logps = pairs.logps(output, loss_mask, kwargs["input_ids"], inputs)
        count = torch.full((), pairs.count, dtype=torch.int, device=output.device)
        return output.new_zeros(()), count, {"logps": logps}

    return loss


def pair_keys(batch: dict) -> list[str]:
    """The keys of a micro batch's pairs in pair order (a packed row's key joins its pairs')."""
    return [key for row in batch["keys"] for key in row.split(",")]


class Reference:
    """Computes reference log-probabilities with `model` (the trained model's adapters off under LoRA)."""

    def __init__(self, model, plan: RunPlan, trained, inputs: ModelInputs):
        self.model = model
        self.trained = trained
        self.lora = has_lora(trained.model)
        self.forward_step = make_forward_step(inputs, loss_of=partial(_logps_only, inputs))
        self.seq_length, self.micro_batch_size = plan.seq_length, plan.config.micro_batch_size

    @classmethod
    def live(cls, plan: RunPlan, trained, inputs: ModelInputs) -> "Reference":
        return cls(trained.ddp if has_lora(trained.model) else _frozen_copy(plan), plan, trained, inputs)

    def attach(self, micro_batches: list[dict]) -> None:
        with adapters_off(self.trained.model) if self.lora else contextlib.nullcontext(), torch.no_grad():
            outputs = run_schedule(self.model, self.forward_step, micro_batches, self.seq_length, self.micro_batch_size,
                                   forward_only=True)
        # Only the last pipeline stage has outputs (one per micro batch); it alone computes the loss.
        for batch, output in zip(micro_batches, outputs):
            batch["ref_logps"] = output["logps"]


class PrecomputedReference:
    FILE = "reference_logps.json"

    def __init__(self, plan: RunPlan, trained, inputs: ModelInputs):
        # Before the first update the trained model is the starting checkpoint: it is the reference.
        self.reference = Reference(trained.ddp, plan, trained, inputs)
        self.device = inputs.device
        self.logps: dict[str, list[float]] = {}
        self.file = Path(plan.config.save_dir) / self.FILE if plan.config.save else None

    def precompute(self, groups) -> None:
        """Reference log-probabilities of every pair of `groups` (lists of micro batches), by the model as
        it is now; every rank then holds all of them (they may meet any pair), and the run's save
        directory keeps them."""
        for micro_batches in groups:
            self.reference.attach(micro_batches)
            for batch in micro_batches:
                if "ref_logps" in batch:
                    self.logps.update(zip(pair_keys(batch), batch["ref_logps"].tolist()))
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, self.logps)
        for logps in ranks:
            self.logps.update(logps)
        if self.file is not None and torch.distributed.get_rank() == 0:
            atomic_write_text(self.file, json.dumps(self.logps))

    def load(self) -> None:
        if self.file is None or not self.file.is_file():
            raise UserError(f"--reference-logprobs precompute: no {self.FILE} in --save-dir (the run began with "
                            "--reference-logprobs live?); resume with the setting it began with")
        self.logps = json.loads(self.file.read_text())

    def attach(self, micro_batches: list[dict]) -> None:
        for batch in micro_batches:
            keys = pair_keys(batch)
            missing = [key for key in keys if key not in self.logps]
            if missing:
                raise UserError(f"no precomputed reference log-probabilities for pairs {missing[:3]}: the data changed "
                                "since they were computed; start a new --save-dir or use --reference-logprobs live")
            batch["ref_logps"] = torch.tensor([self.logps[key] for key in keys], dtype=torch.float32).to(self.device)
