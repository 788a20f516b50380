"""The training loop: plan -> model -> data -> iterations -> checkpoints.

Each iteration takes `num_microbatches` micro batches from this rank's data loader, runs
megatron-core's forward/backward schedule and the optimizer step, then logs, evaluates and saves
as configured. Faults: a non-finite loss skips the update (N in a row stop the run); a stopping
signal (SIGTERM, SIGINT, SIGUSR1: megatron_ext/stop_signals.py) on any rank stops every rank at the
next iteration boundary, with a checkpoint saved, and the run exits 0.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import astuple, fields
from pathlib import Path

import torch

from megatron_ext import lifetime, stop_signals
from megatron_ext.config.options import TrainConfig
from megatron_ext.config.run_plan import RunPlan, make_plan
from megatron_ext.distributed import device
from megatron_ext.errors import UserError, report
from megatron_ext.eval.evaluation import AnswerEvaluation
from megatron_ext.fsutil import write_jsonl
from megatron_ext.model.compiled_layers import compile_failed, compile_failure
from megatron_ext.model.inputs import ModelInputs
from megatron_ext.model.mrope_inputs import inputs_for
from megatron_ext.model.packed_sequences import sample_lengths
from megatron_ext.objectives import for_run
from megatron_ext.train import checkpointing
from megatron_ext.train.batches import samples_digest
from megatron_ext.train.flops import TowerWork, iteration_flops, tower_work
from megatron_ext.train.metrics_log import MetricsLogger
from megatron_ext.train.model_setup import TrainingModel, build_training_model
from megatron_ext.train.run_lock import RunLock
from megatron_ext.train.step import StepResult, train_step

log = logging.getLogger(__name__)

# metrics.jsonl's "state" record: one row per rank.
STATE_COLUMNS = ["pp_rank", "tp_rank", "dp_rank", "param_bytes", "grad_bytes", "optimizer_bytes"]

# --eval-generate-samples: SAVE_DIR/predictions/iter_N.jsonl holds the answers of evaluation N.
PREDICTIONS_DIR = "predictions"


class TrainingStopped(Exception):
    """The run cannot continue (e.g. repeated non-finite losses); the message says what to do."""


def _memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


class _DataUsedUp(Exception):
    """A run measured in samples read its last pass to the end on some rank before they were all trained
    (samples skipped as too long are not trained; data-parallel ranks' packs differ)."""


def _on_every_rank(holds: bool) -> bool:
    """Whether `holds` is true on every rank (collective)."""
    value = torch.tensor([float(holds)], device=device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return bool(value.item())


TOWER_STATS = tuple(f"tower_{field.name}" for field in fields(TowerWork))
BATCH_STATS = ("samples", "positions", "squared_lengths", "model_positions", "images", "truncated", "skipped",
               "logit_positions", *TOWER_STATS)


def batch_stats(micro_batches: list[dict], inputs: ModelInputs, arch) -> torch.Tensor:
    """`BATCH_STATS` of these micro batches of a model of `arch` (bench/gpu_bench.py counts with it
    too). positions: language-model positions holding samples (image embeddings included);
    model_positions: all the positions the model computes, padding included; squared_lengths: the sum
    of each sample's squared length (its attention work); logit_positions: where the output layer
    computes logits (the loss positions with --logits-where-loss, else the sample positions); tower_*:
    a native-resolution tower's `TowerWork`."""
    total = torch.zeros(len(BATCH_STATS), dtype=torch.float64)
    for b in micro_batches:
        lengths = sample_lengths(b["input_ids"], b["segment_ids"], inputs.image_token_index, inputs.img_seq_len).double()
        logits = inputs.layout(b).loss_positions.numel() if inputs.logits_where_loss else lengths.sum()
        total += torch.tensor([b["num_samples"], lengths.sum(), (lengths**2).sum(),
                               b["input_ids"].shape[0] * inputs.combined_length(b["input_ids"]), inputs.media_count(b),
                               b["num_truncated"], b["num_skipped"], logits, *astuple(tower_work(arch, b))],
                              dtype=torch.float64)
    return total


class Trainer:
    def __init__(self, plan: RunPlan):
        from megatron.core import parallel_state

        from megatron_ext.train.batches import TrainData, ValData

        self.plan = plan
        self.cfg = plan.config
        self.trained: TrainingModel = build_training_model(plan)
        self.train_data = TrainData(plan)
        self.val_data = ValData(plan) if self.cfg.eval_interval else None
        self.answer_eval = AnswerEvaluation(plan) if self.cfg.eval_generate_samples else None
        self.benchmark_eval = None
        if self.cfg.eval_benchmarks:
            from megatron_ext.eval.benchmark import BenchmarkEvaluation  # lmms-eval: imported only when asked

            self.benchmark_eval = BenchmarkEvaluation(plan)
        self.iteration = 0
        self.counters = {"skipped_iterations": 0, "nonfinite_iterations": 0, "samples": 0, "skipped_samples": 0,
                         "truncated_samples": 0}
        if plan.resume is not None:
            common = checkpointing.load_resume_state(plan, self.trained, self.train_data)
            self.iteration = common["iteration"]
            self.counters.update(common.get("counters", {}))
            self.train_data.passes = self.counters.get("data_passes", 0)
        elif plan.start is not None:
            checkpointing.load_weights(self.trained, plan.start, with_optimizer=False)
            log.info("starting from %s", plan.start.path)
        if self.cfg.save:
            checkpointing.prepare_save_dir(plan)
        self.metrics = MetricsLogger(self.cfg.save_dir if self.cfg.save else None, plan.summary(),
                                     wandb=self.cfg.wandb, project=self.cfg.wandb_project, name=self.cfg.name,
                                     resumed_at=self.iteration if plan.resume is not None else None)
        self.inputs = inputs_for(plan.arch, self.trained.model, device())
        self.objective = for_run(plan, self.trained, self.inputs)
        self.objective.start(self._one_pass)
        self.stop = stop_signals.stop_request()
        self.dp_group = parallel_state.get_data_parallel_group()
        # The rank of its data-parallel replica that adds the batch statistics to the step's all-reduce.
        self.counts_batch = (parallel_state.get_tensor_model_parallel_rank() == 0
                             and parallel_state.get_pipeline_model_parallel_rank() == 0
                             and parallel_state.get_context_parallel_rank() == 0)
        self.last_saved = plan.resume.path if plan.resume else None
        self.held_state_recorded = False
        self.compile_problems_said = False

    def _one_pass(self):
        """Global batches of one pass over the train split, then the val batches evaluations use (an
        objective that looks at the data before training asks: DPO's precomputed reference)."""
        from itertools import chain, islice

        from megatron_ext.train.batches import split_pass

        val = [group for group in self.val_data.global_batches() if group] if self.val_data is not None else []
        train = split_pass(self.plan, "train")
        groups = iter(lambda: list(islice(train, self.plan.num_microbatches)), [])
        return chain(groups, val)

    # --- one iteration ------------------------------------------------------------------------
    def _lr(self) -> float:
        groups = self.trained.optimizer.param_groups
        return groups[0]["lr"] if groups else 0.0

    def _iteration(self) -> tuple[StepResult | None, list[dict], dict, bool]:
        """One step: (its result, None when skipped; its micro batches; the global batch's
        statistics; whether any rank received a stop signal). Raises `_DataUsedUp` instead when a
        run measured in samples has no batch left on some rank."""
        micro_batches = self.train_data.next_micro_batches(self.plan.num_microbatches)
        by_samples = self.plan.epoch_samples is not None
        if by_samples and not _on_every_rank(bool(micro_batches)):
            raise _DataUsedUp
        stats = batch_stats(micro_batches, self.inputs, self.plan.arch)
        # The LR schedule advances with the iteration, or by the global batch's samples once they are known.
        increment = 0 if by_samples else 1
        if self.plan.skipped(self.iteration):
            # The data is consumed, no update is made; the schedule still advances.
            self.trained.scheduler.step(increment=increment)
            self.counters["skipped_iterations"] += 1
            result = None
        else:
            self.objective.prepare(micro_batches)
            result = train_step(self.trained, self.objective.forward_step, micro_batches, self.plan.seq_length,
                                self.cfg.micro_batch_size, reduce=self.objective.reduce,
                                before_update=self.before_optimizer_step, schedule_increment=increment)
        batch, stop = self._shared(stats)
        if by_samples and (result is None or result.updated):
            self.trained.scheduler.step(increment=int(batch["samples"]))
        return result, micro_batches, batch, stop

    def _finished(self) -> bool:
        """The last iteration is done, or in a run measured in samples, its samples are trained."""
        samples = self.plan.epoch_samples
        return self.iteration >= self.plan.train_iters or (samples is not None and self.counters["samples"] >= samples)

    def _shared(self, stats: torch.Tensor) -> tuple[dict, bool]:
        """The global batch's statistics and whether any rank was signalled to stop, in one all-reduce
        over every rank and one read back, after the step's work is queued. One rank per data-parallel
        replica contributes statistics (its model-parallel peers hold the same batch); every rank its
        stop flag. NCCL on a GPU: the vector goes to the device first."""
        values = torch.cat([stats if self.counts_batch else torch.zeros_like(stats),
                            torch.tensor([float(self.stop.received)], dtype=stats.dtype)]).to(device())
        torch.distributed.all_reduce(values)
        *totals, stops = values.tolist()
        return dict(zip(BATCH_STATS, totals)), stops > 0

    def _samples_digest(self, micro_batches: list[dict]) -> str:
        """Which samples the global batch held, in data-parallel rank order: equal fingerprints mean two
        runs (or a run and its resumption) saw the same data. A collective of Python objects: only
        for the iterations that are logged."""
        keys = [None] * torch.distributed.get_world_size(self.dp_group)
        torch.distributed.all_gather_object(keys, [k for b in micro_batches for k in b["keys"]], group=self.dp_group)
        return samples_digest([k for rank_keys in keys for k in rank_keys])

    def _record_held_state(self) -> None:
        """Once per process, after its first update (Adam's moments exist from then): the bytes each
        rank holds for parameters, gradient buffers and optimizer state, which the memory plan
        (docs/gpu.md) predicts exactly. One object all-gather, before the steps that follow."""
        from megatron.core import parallel_state as ps

        from megatron_ext.train.held_state import held_state_bytes

        mine = [ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
                ps.get_data_parallel_rank(), *held_state_bytes(self.trained)]
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
        self.metrics.note({"iteration": self.iteration, "columns": STATE_COLUMNS, "ranks": ranks}, prefix="state")
        if torch.distributed.get_rank() == 0:
            largest = max(ranks, key=lambda r: sum(r[3:]))
            log.info("held by the largest rank (pp %d, tp %d, dp %d): parameters %.3f GiB, gradients %.3f GiB, "
                     "optimizer %.3f GiB", *largest[:3], *(b / 2**30 for b in largest[3:]))
        self.held_state_recorded = True

    def _say_compile_problems(self) -> None:
        """Once, after the first step of --compile-layers: where torch.compile could not trace a layer whole
        (those parts run uncompiled), so that a compiled run slower than expected says why."""
        from megatron_ext.model.compiled_layers import compile_problems

        if problems := compile_problems():
            log.warning("--compile-layers: torch.compile left parts of the layers uncompiled: %s", "; ".join(problems))
        self.compile_problems_said = True

    def _check_finite(self, result: StepResult | None) -> None:
        if result is None or result.finite:
            self.counters["consecutive_nonfinite"] = 0
            return
        self.counters["nonfinite_iterations"] += 1
        self.counters["consecutive_nonfinite"] = self.counters.get("consecutive_nonfinite", 0) + 1
        log.warning("iteration %d: loss is not finite; update skipped", self.iteration)
        if self.counters["consecutive_nonfinite"] >= self.cfg.max_nonfinite_steps:
            raise TrainingStopped(
                f"loss was not finite for {self.cfg.max_nonfinite_steps} iterations in a row (last: iteration "
                f"{self.iteration}); last good checkpoint: {self.last_saved or 'none'}. Lower --lr or check the data."
            )

    def _record(self, result: StepResult | None, batch: dict, seconds: float, lr: float) -> dict:
        samples = batch["samples"]
        self.counters["samples"] += int(samples)
        self.counters["truncated_samples"] += int(batch["truncated"])
        self.counters["skipped_samples"] += int(batch["skipped"])
        flops = iteration_flops(self.plan.arch, positions=batch["positions"], squared_lengths=batch["squared_lengths"],
                                images=batch["images"], lm_trained=not self.cfg.freeze_lm,
                                vit_trained=self.cfg.unfreeze_vit, logit_positions=batch["logit_positions"],
                                tower=TowerWork(*(batch[name] for name in TOWER_STATS)))
        record = {
            "iteration": self.iteration,
            "loss": result.loss if result else float("nan"),
            "lr": lr,
            "grad_norm": float(result.grad_norm) if result and result.grad_norm is not None else None,
            "loss_tokens": result.loss_tokens if result else 0,
            "samples": int(samples),
            "skipped_samples": self.counters["skipped_samples"],
            "truncated_samples": self.counters["truncated_samples"],
            "update": bool(result and result.updated),
            "skipped": result is None,
            "iteration_time_s": seconds,
            "samples_per_s": samples / seconds,
            "tokens_per_s": batch["positions"] / seconds,
            "padding_share": 1.0 - batch["positions"] / batch["model_positions"],
            "tflops_per_gpu": flops / seconds / self.plan.world_size / 1e12,
            "memory_gb": _memory_gb(),
            **(result.metrics if result else {}),
        }
        return record

    # --- evaluation and saving ----------------------------------------------------------------
    def evaluate(self) -> dict:
        with self.trained.parameters_gathered():
            return self._evaluate()

    def _evaluate(self) -> dict:
        result = {"iteration": self.iteration, **self.objective.evaluate(self.val_data.global_batches())}
        if self.answer_eval is not None:
            scores, records = self.answer_eval.run(self.trained.model)
            result.update(scores)
            if self.cfg.save and torch.distributed.get_rank() == 0:
                write_jsonl(Path(self.cfg.save_dir) / PREDICTIONS_DIR / f"iter_{self.iteration:07d}.jsonl", records)
        if self.benchmark_eval is not None:
            result.update(self.benchmark_eval.run(self.trained.model))
        return result

    def save(self) -> None:
        self.counters["data_passes"] = self.train_data.passes
        with self.trained.parameters_gathered():
            self.last_saved = checkpointing.save_snapshot(self.plan, self.trained, self.iteration,
                                                          {"counters": self.counters}, self.train_data)

    def _due(self, interval: int | None) -> bool:
        return bool(interval) and self.iteration % interval == 0

    # --- hooks for subclasses (the parity check's recording trainer, verify/parity_run.py) --------
    def before_optimizer_step(self) -> None:
        """Called in each updating iteration when its gradients are final (reduced, scaled), before the
        optimizer clips and applies them."""

    def after_iteration(self, micro_batches: list[dict]) -> None:
        """Called after each iteration, skipped ones included, with the micro batches it drew."""

    # --- the loop -----------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        log.info("training iterations %d..%d, global batch %d = %d micro batches x %d x DP %d",
                 self.iteration + 1, self.plan.train_iters, cfg.global_batch_size, self.plan.num_microbatches,
                 cfg.micro_batch_size, self.plan.execution.data_parallel_size)
        if cfg.eval_on_start and self.iteration == 0:
            self.metrics.log(self.evaluate(), prefix="val")
        while not self._finished():
            self.iteration += 1
            start, lr = time.perf_counter(), self._lr()
            try:
                result, micro_batches, batch, stop = self._iteration()
            except _DataUsedUp:
                self.iteration -= 1
                log.info("the %g epoch(s) of training samples are used up at iteration %d", self.cfg.epochs,
                         self.iteration)
                if cfg.save and not self._due(cfg.save_interval):  # else the last iteration saved already
                    self.save()
                return
            self.after_iteration(micro_batches)
            record = self._record(result, batch, time.perf_counter() - start, lr)
            if result is not None and result.updated and not self.held_state_recorded:
                self._record_held_state()
            if self.plan.execution.model.compile_layers and not self.compile_problems_said:
                self._say_compile_problems()
            last = self._finished()
            if self._due(cfg.log_interval) or last or not (result is None or result.finite):
                self.metrics.log({**record, "samples_digest": self._samples_digest(micro_batches)})
            self._check_finite(result)
            if self.val_data is not None and self._due(cfg.eval_interval):
                self.metrics.log(self.evaluate(), prefix="val")
            exiting = stop or (cfg.exit_interval and self.iteration >= cfg.exit_interval)
            if cfg.save and (self._due(cfg.save_interval) or exiting or last):
                self.save()
            if exiting:
                self._say_why_exiting(stop)
                return

    def _say_why_exiting(self, stop: bool) -> None:
        """One line, from rank 0: why the run ends before its last iteration, and what it kept."""
        if torch.distributed.get_rank() != 0:
            return
        why = "--exit-interval"
        if stop:  # rank 0 may not be the rank that was signalled (another node's)
            why = f"stopped by {self.stop.name}" if self.stop.received else "stopped by a signal to another rank"
        kept = f"saved {self.last_saved}; the same command resumes from it" if self.cfg.save else "nothing saved (no --save)"
        log.info("%s at iteration %d: %s", why, self.iteration, kept)

    def close(self) -> None:
        self.metrics.close()
        self.train_data.close()


def _lock_save_dir(plan: RunPlan) -> RunLock | None:
    """Rank 0 takes --save-dir's run lock; every rank learns whether it got it (collective)."""
    if not plan.config.save:
        return None
    lock, error = None, [None]
    if torch.distributed.get_rank() == 0:
        try:
            lock = RunLock(plan.config.save_dir).acquire()
        except UserError as exc:
            error = [str(exc)]
    torch.distributed.broadcast_object_list(error, src=0)
    if error[0]:
        raise UserError(error[0])
    return lock


def run(config: TrainConfig, trainer_class: type[Trainer] = Trainer) -> int:
    """Entry point under torchrun. Returns the process exit status. `trainer_class`: a Trainer whose
    hooks also record what it trains on (the parity check's `verify.parity_run`)."""
    from megatron_ext.distributed import init_parallel, shutdown

    lifetime.watch_launcher()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        plan = make_plan(config, world, torch.cuda.is_available())
    except UserError as exc:
        report(str(exc))
        return 2
    if plan.config.deterministic:
        torch.use_deterministic_algorithms(True)
    init_parallel(plan.config.tp, plan.config.pp, seed=plan.config.seed, backend=plan.config.distributed_backend,
                  cp=plan.config.cp)
    if rank == 0:
        print("resolved configuration:\n" + json.dumps(plan.summary(), indent=2, default=str), flush=True)
    trainer = lock = None
    try:
        lock = _lock_save_dir(plan)
        trainer = trainer_class(plan)
        trainer.train()
        return 0
    except (UserError, TrainingStopped) as exc:
        report(str(exc))
        return 2 if isinstance(exc, UserError) else 1
    except Exception as exc:
        if plan.config.debug or not compile_failed(exc):
            raise
        report(compile_failure(exc, plan.execution.model.compile_layers))
        return 2
    finally:
        if trainer is not None:
            trainer.close()
        if lock is not None:
            lock.release()
        shutdown()
