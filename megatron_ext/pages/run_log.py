"""A training run read back from its save directory: the records of metrics.jsonl with resumed
segments joined, the checkpoints it saved, and its resolved configuration.

A run killed after its last checkpoint logged iterations that its resumed segment trains again;
the resumed segment's records replace those (every record from the iteration it resumed at on).
Readable while the run is going: metrics.jsonl grows a line at a time (a line being written is
left out) and only complete snapshots are listed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from megatron_ext.checkpoint import layout
from megatron_ext.errors import UserError
from megatron_ext.train.metrics_log import METRICS_FILE


@dataclass(frozen=True)
class SavedCheckpoint:
    iteration: int
    path: Path
    saved_at: datetime


@dataclass(frozen=True)
class RunLog:
    save_dir: Path
    train: list[dict]  # one record per logged iteration, ascending
    val: list[dict]
    segments: int  # 1 + the times the run resumed
    checkpoints: list[SavedCheckpoint]
    config: dict  # the newest checkpoint's RunPlan.summary(); {} before the first save

    @property
    def train_iters(self) -> int | None:
        return self.config.get("train_iters")


def _records(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):  # the last line may be one the trainer is writing
                raise UserError(f"{path}: line {number} is not JSON; is this a metrics.jsonl of ours?") from None
    return records


def join_segments(records: list[dict]) -> tuple[dict[str, list[dict]], int]:
    """Records by split, each split's iterations ascending; and the number of segments (a train
    record at or before the last one logged starts a new one)."""
    splits: dict[str, list[dict]] = {}
    segments = 1 if records else 0
    for record in records:
        kept = splits.setdefault(record.get("split", "train"), [])
        iteration = record["iteration"]
        if kept and iteration <= kept[-1]["iteration"]:
            segments += record.get("split", "train") == "train"
            kept[:] = [r for r in kept if r["iteration"] < iteration]
        kept.append(record)
    return splits, segments


def read_run(save_dir: str | Path) -> RunLog:
    save_dir = Path(save_dir)
    metrics = save_dir / METRICS_FILE
    if not metrics.is_file():
        raise UserError(f"{save_dir} has no {METRICS_FILE}: give the --save-dir of a training run (it is "
                        "written from the first logged iteration on)")
    splits, segments = join_segments(_records(metrics))
    checkpoints = []
    for iteration in layout.list_snapshots(save_dir):
        path = save_dir / layout.snapshot_name(iteration)
        saved_at = datetime.fromtimestamp((path / layout.METADATA_FILE).stat().st_mtime, timezone.utc)
        checkpoints.append(SavedCheckpoint(iteration, path, saved_at))
    newest = layout.latest_complete_snapshot(save_dir)
    config = newest.run_config if newest else {}
    return RunLog(save_dir, splits.get("train", []), splits.get("val", []), segments, checkpoints, config)
