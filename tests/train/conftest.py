"""Fixtures for trainer tests: a converted tiny checkpoint and a synthetic prepared dataset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun


@pytest.fixture(scope="session")
def megatron_clip(tmp_path_factory, llava_clip) -> Path:
    """The llava_clip fixture converted to a Megatron checkpoint (TP1 x PP1)."""
    from megatron_ext.convert.to_megatron import convert

    return convert(llava_clip, tmp_path_factory.mktemp("megatron_clip") / "ckpt", tp=1, pp=1)


@pytest.fixture(scope="session")
def train_data(tmp_path_factory) -> Path:
    """96 synthetic samples (30% multi-turn) as prepared shards of 8: train 80, val 16."""
    from megatron_ext.data.build import build_energon_dataset
    from megatron_ext.data.synthetic import SyntheticSpec, make_synthetic_dataset

    source = make_synthetic_dataset(tmp_path_factory.mktemp("train_src"), SyntheticSpec(num_samples=96, seed=3))
    out = tmp_path_factory.mktemp("train_data") / "energon"
    build_energon_dataset(source, out, split_ratio="10,2,0", samples_per_shard=8, num_workers=0)
    return out


def trainer_args(checkpoint: Path, data: Path, save_dir: Path, **options) -> list[str]:
    """Command-line options of a small, fast run; `options` override them (True = flag)."""
    values = {"megatron_load_dir": checkpoint, "data_path": data, "save": True, "save_dir": save_dir,
              "micro_batch_size": 2, "global_batch_size": 4, "seq_length": 128, "num_workers": 0,
              "train_iters": 3, "stage": 2, "lr": 1e-3, **options}
    args = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not None and value is not False:
            args += [flag, str(value)]
    return args


def train(nproc: int, *args, timeout: float = 240, check: bool = True):
    return run_torchrun(nproc, "scripts/train/pretrain_llava.py", *args, timeout=timeout, check=check)


def metrics(save_dir: Path, split: str = "train") -> dict[int, dict]:
    """The last record of every iteration in SAVE_DIR/metrics.jsonl (a resumed run appends)."""
    records = {}
    for line in (Path(save_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == split:
            records[record["iteration"]] = record
    return records
