"""Helpers for trainer tests: the command line of a small run, running it, reading its metrics."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.support.helpers import REPO_ROOT, run_ranks


def _small_run(checkpoint: Path, data: Path, save_dir: Path, **options) -> dict:
    return {"megatron_load_dir": checkpoint, "data_path": data, "save": True, "save_dir": save_dir,
            "micro_batch_size": 2, "global_batch_size": 4, "seq_length": 128, "num_workers": 0,
            "train_iters": 3, "stage": 2, "lr": 1e-3, **options}


def _flags(values: dict, flag_of) -> list[str]:
    args = []
    for name, value in values.items():
        if value is True:
            args.append(flag_of(name))
        elif value is not None and value is not False:
            args += [flag_of(name), str(value)]
    return args


def trainer_args(checkpoint: Path, data: Path, save_dir: Path, **options) -> list[str]:
    """Command-line options of a small, fast run; `options` override them (True = flag)."""
    return _flags(_small_run(checkpoint, data, save_dir, **options), lambda name: "--" + name.replace("_", "-"))


def launcher_args(gpus: int, checkpoint: Path, data: Path, save_dir: Path, **options) -> list[str]:
    """scripts/train/run.py's arguments for the same run on `gpus` processes: its own flags before
    `--`, the trainer's other options after it."""
    from megatron_ext.launch.flags import TRAINER_FLAGS

    values = _small_run(checkpoint, data, save_dir, **options)
    own = {name: value for name, value in values.items() if name in TRAINER_FLAGS}
    rest = {name: value for name, value in values.items() if name not in TRAINER_FLAGS}
    return ["-g", str(gpus), *_flags(own, lambda name: TRAINER_FLAGS[name].name), "--",
            *_flags(rest, lambda name: "--" + name.replace("_", "-"))]


def run_py(checkpoint: Path, data: Path, save: Path, iters: int, gpus: int = 2) -> list[str]:
    """The command of a small run of `gpus` processes through the launcher, scripts/train/run.py."""
    return [sys.executable, str(REPO_ROOT / "scripts/train/run.py"), "-g", str(gpus), "--megatron-load-dir", str(checkpoint),
            "--data-path", str(data), "--save", "--save-dir", str(save), "--save-interval", "2", "--micro-batch-size",
            "2", "--global-batch-size", "4", "--num-workers", "0", "--stage", "2",
            "--", "--train-iters", str(iters), "--seq-length", "128", "--lr", "1e-3"]


def train(nproc: int, *args, timeout: float = 240, check: bool = True, env: dict | None = None,
          python: str | Path = sys.executable):
    return run_ranks(nproc, "scripts/train/pretrain_llava.py", *args, timeout=timeout, check=check, env=env,
                     python=python)


def metrics(save_dir: Path, split: str = "train") -> dict[int, dict]:
    """The last record of every iteration in SAVE_DIR/metrics.jsonl (a resumed run appends)."""
    records = {}
    for line in (Path(save_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["split"] == split:
            records[record["iteration"]] = record
    return records


def assert_held_state_is_planned(save_dir: Path, plan=None) -> None:
    """What the trainer recorded each rank to hold (metrics.jsonl's "state" record) is the memory
    plan's (docs/gpu.md), exactly: parameters and gradient buffers on every rank; of the optimizer
    state, the largest data-parallel share (with --dist-optim the shares differ where bucket padding
    falls) and, all shares together, every trained element's state once. `plan`: the run's; by
    default rebuilt from its last checkpoint, as a user's `plan` command would."""
    records = list(metrics(save_dir, "state").values())  # one per start: a resumed run records again
    assert records
    for record in records:
        _check_held_state(record, save_dir, plan)


def _check_held_state(record: dict, save_dir: Path, plan) -> None:
    from megatron_ext.checkpoint import layout
    from megatron_ext.config.options import TrainConfig
    from megatron_ext.config.run_plan import make_plan
    from megatron_ext.memory.plan import memory_plan
    from megatron_ext.memory.state_bytes import MASTER_BYTES, MOMENT_BYTES, moments

    rows = [dict(zip(record["columns"], row)) for row in record["ranks"]]
    if plan is None:
        config = TrainConfig(**layout.latest_complete_snapshot(Path(save_dir)).trainer_options)
        plan = make_plan(config, len(rows), on_gpu=False, te=False)
    assert len(rows) == plan.world_size
    planned = {(kind.stage, tp): kind.state for kind in memory_plan(plan, 80 * 2**30).ranks for tp in kind.tp_ranks}
    per_element = (moments(plan.config.optimizer, plan.config.sgd_momentum) * MOMENT_BYTES
                   + (MASTER_BYTES if plan.dtype != "float32" else 0))
    for (stage, tp), state in planned.items():
        mine = [r for r in rows if (r["pp_rank"], r["tp_rank"]) == (stage, tp)]
        assert {(r["param_bytes"], r["grad_bytes"]) for r in mine} == {(state.param_bytes, state.grad_bytes)}, (stage, tp)
        shares = [r["optimizer_bytes"] for r in mine]
        assert max(shares) == state.optimizer_bytes, (stage, tp, shares)
        whole = state.trained * per_element
        assert sum(shares) == (whole if plan.config.dist_optim else whole * len(mine)), (stage, tp, shares)


def plant_in_parity_ranks(monkeypatch, double: Path) -> None:
    """The defect `double`'s sitecustomize plants, in the parity check's ranks (`verify.parity.run_ours`).
    They then run under torchrun, as on GPUs: a fresh interpreter imports sitecustomize; a forked
    rank (the check's CPU path) would not."""
    from megatron_ext.verify import parity

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(double), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setattr(parity, "_forked_ranks", parity._torchrun_ranks)
