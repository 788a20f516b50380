"""Trainer snapshots: save under a temporary name, publish by rename, resume exactly.

A snapshot (see megatron_ext/checkpoint/layout.py) holds the model through megatron-core
dist_checkpointing (`{"model": ..., "optimizer": ...}`, torch_dist, reshardable across TP/PP) and
`train_state/`: `common.pt` (iteration, LR schedule, counters), `data_dpNNNNN.pt` (the data
loader position of each data-parallel rank) and `rng_rankNNNNN.pt` (every generator of each rank).
The data position, iteration, schedule and RNG are always saved; optimizer state with --save-optim.
"""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from megatron_ext.checkpoint import layout
from megatron_ext.checkpoint.model_io import save_model_weights
from megatron_ext.config.run_plan import RunPlan
from megatron_ext.errors import UserError
from megatron_ext.lora.checkpoint import base_record, load_snapshot_weights, trainable_names
from megatron_ext.lora.layers import has_lora
from megatron_ext.train.model_setup import TrainingModel

log = logging.getLogger(__name__)

# Reshardable across TP/PP/DP sizes (the other formats tie optimizer state to the DP layout).
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
COMMON_FILE = "common.pt"


def _ranks():
    from megatron.core import parallel_state as ps

    return {
        "rank": torch.distributed.get_rank(),
        "world": torch.distributed.get_world_size(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
    }


def rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _optimizer_state(trained: TrainingModel, is_loading: bool) -> dict:
    model_sd = trained.model.sharded_state_dict()
    return {"optimizer": trained.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                              metadata=OPTIMIZER_METADATA)}


def prepare_save_dir(plan: RunPlan) -> None:
    """Rank 0: create --save-dir with the tokenizer and HF-only tensors of the starting checkpoint,
    and remove temporary snapshots a crashed save left behind."""
    root = Path(plan.config.save_dir)
    if torch.distributed.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-iter_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tokenizer = root / layout.TOKENIZER_DIR
        if not tokenizer.exists():
            shutil.copytree(plan.tokenizer_dir, tokenizer)
        source = plan.start or plan.resume
        if source is not None and source.hf_extra_file.is_file() and not (root / layout.HF_EXTRA_FILE).exists():
            shutil.copy2(source.hf_extra_file, root / layout.HF_EXTRA_FILE)
    torch.distributed.barrier()


def save_snapshot(plan: RunPlan, trained: TrainingModel, iteration: int, common: dict, train_data) -> Path:
    """Write snapshot `iteration` to --save-dir; it becomes visible only once complete."""
    cfg = plan.config
    root = Path(cfg.save_dir)
    name = layout.snapshot_name(iteration)
    tmp = root / f".tmp-{name}"
    r = _ranks()
    state_dir = tmp / layout.TRAIN_STATE_DIR
    if r["rank"] == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch.distributed.barrier()

    lora = has_lora(trained.model)
    # A LoRA run saves what it trains; the base stays in the checkpoint it started from.
    trained_names = trainable_names(trained.model) if lora else None
    save_model_weights(trained.model, tmp, extra=_optimizer_state(trained, is_loading=False) if cfg.save_optim else None,
                       select=trained_names.__contains__ if lora else None)
    if r["rank"] == 0:
        state_dir.mkdir()
    torch.distributed.barrier()
    torch.save(rng_state(), state_dir / f"rng_rank{r['rank']:05d}.pt")
    if r["tp"] == 0 and r["pp"] == 0:
        train_data.save(state_dir / f"data_dp{r['dp']:05d}.pt")
    torch.distributed.barrier()

    if r["rank"] == 0:
        torch.save({**common, "iteration": iteration, "scheduler": trained.scheduler.state_dict(), "world_size": r["world"],
                    "data_parallel_size": r["dp_size"]}, state_dir / COMMON_FILE)
        layout.write_metadata(tmp, kind="trained", iteration=iteration, hf_config=plan.hf_config, tp=cfg.tp,
                              pp=cfg.pp, dtype=plan.dtype, has_optimizer=cfg.save_optim, run_config=plan.summary(),
                              lora_base=base_record(plan.resume or plan.start) if lora else None)
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        layout.mark_latest(root, iteration)
        _prune(root, cfg.keep_last)
        log.info("saved checkpoint %s", final)
    torch.distributed.barrier()
    return root / name


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for iteration in layout.list_snapshots(root)[:-keep_last]:
        shutil.rmtree(root / layout.snapshot_name(iteration), ignore_errors=True)


def load_weights(trained: TrainingModel, snapshot: layout.Snapshot, with_optimizer: bool) -> None:
    """Load model weights (any saved TP/PP) and, if asked, the optimizer state the snapshot holds."""
    from megatron.core import dist_checkpointing

    try:
        load_snapshot_weights(trained.model, snapshot)
        if with_optimizer:
            loaded = dist_checkpointing.load(_optimizer_state(trained, is_loading=True), str(snapshot.path))
            with torch.no_grad():
                trained.optimizer.load_state_dict(loaded["optimizer"])
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"cannot load {snapshot.path}: {str(exc).splitlines()[0]}") from exc
    if not with_optimizer:
        # The optimizer's fp32 main copies were taken at construction: refresh them.
        trained.optimizer.reload_model_params()


def _rank0_warning(message: str, *args) -> None:
    """One line for the run, not one per rank."""
    if torch.distributed.get_rank() == 0:
        log.warning(message, *args)


def load_resume_state(plan: RunPlan, trained: TrainingModel, train_data) -> dict:
    """Restore a run from its latest snapshot: weights, optimizer state (when saved, unless
    --no-load-optim), schedule, RNG and the data loader position (when the data-parallel layout is
    unchanged). Returns the common state."""
    snapshot = plan.resume
    saved_optimizer = bool(snapshot.meta.get("has_optimizer"))
    if plan.config.load_optim is False:
        _rank0_warning("--no-load-optim: resuming %s with Adam's moments started afresh", snapshot.path)
    elif not saved_optimizer:
        _rank0_warning("%s holds no optimizer state (saved without --save-optim): Adam's moments start afresh",
                       snapshot.path)
    load_weights(trained, snapshot, with_optimizer=saved_optimizer and plan.config.load_optim is not False)
    state_dir = snapshot.train_state_dir
    common = torch.load(state_dir / COMMON_FILE, weights_only=False)
    trained.scheduler.load_state_dict(common["scheduler"])
    r = _ranks()
    same_layout = common["world_size"] == r["world"] and snapshot.tp == plan.config.tp and snapshot.pp == plan.config.pp
    if same_layout:
        set_rng_state(torch.load(state_dir / f"rng_rank{r['rank']:05d}.pt", weights_only=False))
    else:
        log.warning("resuming %s with another layout: RNG streams restart", snapshot.path)
    data_file = state_dir / f"data_dp{r['dp']:05d}.pt"
    if common["data_parallel_size"] == r["dp_size"] and data_file.is_file():
        train_data.restore(data_file)
    else:
        log.warning("data-parallel size changed (%d -> %d): the data stream restarts", common["data_parallel_size"], r["dp_size"])
    log.info("resumed from %s (iteration %d)", snapshot.path, common["iteration"])
    return common
