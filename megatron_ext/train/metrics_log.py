"""Training records: one line to the console, JSON lines to metrics.jsonl, TensorBoard, W&B.

Only global rank 0 writes. A resumed run continues the same records: metrics.jsonl (under
--save-dir) is appended to, each record carrying its `iteration`; TensorBoard drops the events
after the iteration resumed from (a run killed after its last checkpoint logged some); W&B
continues the run whose id --save-dir keeps in WANDB_ID_FILE.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
from pathlib import Path

from megatron_ext.fsutil import atomic_write_text

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
WANDB_ID_FILE = "wandb_run_id"


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.3e}"
        return f"{key} {value:.4f}" if abs(value) < 1e4 else f"{key} {value:.3e}"
    return f"{key} {value}"


def _wandb_run_id(out_dir: str) -> str:
    """The W&B run id of this save directory: kept in WANDB_ID_FILE, made on the first run."""
    path = Path(out_dir) / WANDB_ID_FILE
    if path.is_file():
        return path.read_text().strip()
    run_id = secrets.token_hex(4)
    atomic_write_text(path, run_id)
    return run_id


class MetricsLogger:
    def __init__(self, out_dir: str | None, run_config: dict, *, wandb: bool, project: str, name: str | None,
                 resumed_at: int | None = None):
        import torch.distributed as dist

        self.enabled = dist.get_rank() == 0
        self.path = Path(out_dir) / METRICS_FILE if out_dir else None
        self.tensorboard = None
        self.wandb = None
        if not self.enabled:
            return
        if out_dir:
            from torch.utils.tensorboard import SummaryWriter

            Path(out_dir).mkdir(parents=True, exist_ok=True)
            self.tensorboard = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"),
                                             purge_step=None if resumed_at is None else resumed_at + 1)
        if wandb:
            import wandb as wandb_lib

            self.wandb = wandb_lib.init(project=project, name=name, config=run_config, dir=out_dir or os.getcwd(),
                                        id=_wandb_run_id(out_dir) if out_dir else None, resume="allow")

    def log(self, record: dict, prefix: str = "train") -> None:
        if not self.enabled:
            return
        print(f"[{prefix}] " + " | ".join(_fmt(k, v) for k, v in record.items()), flush=True)
        self.note(record, prefix)
        step = record["iteration"]
        numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "iteration"
                   and math.isfinite(v)}
        if self.tensorboard is not None:
            for key, value in numbers.items():
                self.tensorboard.add_scalar(f"{prefix}/{key}", value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in numbers.items()}, step=step)

    def note(self, record: dict, prefix: str) -> None:
        """The record's line in metrics.jsonl; alone, for records that are not numbers to plot (what
        each rank holds)."""
        if self.enabled and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"split": prefix, **record}) + "\n")

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
