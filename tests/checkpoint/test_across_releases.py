"""A training checkpoint written with one supported megatron-core release resumes with the other: the
venv this test runs in and the other venv CI builds (scripts/setup_env.sh: `.venv`, Python 3.11 and
megatron-core 0.16; `.venv312`, Python 3.12 and 0.19), each driven by its own interpreter. 0.19 keeps
the common state inside the .distcp files and 0.16 reads only common.pt (compat/releases.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.checkpoint import layout
from tests.support.helpers import REPO_ROOT
from tests.support.training import metrics, train, trainer_args

VENVS = (".venv", ".venv312")  # scripts/setup_env.sh's, without and with --python 3.12
RUN = dict(tp=2, train_iters=4, save_interval=2, keep_last=0, save_optim=True, lr_warmup_fraction=0.5, min_lr=1e-4)


def _other_python() -> Path | None:
    """The interpreter of the setup_env.sh venv this test does not run in, where it is built."""
    here = Path(sys.prefix).resolve()
    for name in VENVS:
        python = REPO_ROOT / name / "bin" / "python"
        if python.exists() and (REPO_ROOT / name).resolve() != here:
            return python
    return None


def _megatron_core(python: str | Path) -> str:
    probe = "from importlib.metadata import version; print(version('megatron-core'))"
    return subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def _resumed_on(python, save: Path, into: Path, megatron_clip, train_data) -> dict[int, dict]:
    """The run in `save` continued from its iteration-2 checkpoint by `python`'s venv, in `into`."""
    shutil.copytree(save, into, ignore=shutil.ignore_patterns("iter_0000004", "metrics.jsonl", "wandb",
                                                              "tensorboard"))
    layout.mark_latest(into, 2)
    train(2, *trainer_args(megatron_clip, train_data, into, **RUN), timeout=300, python=python)
    return metrics(into)


@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_a_checkpoint_saved_with_either_megatron_core_release_resumes_with_the_other_exactly(
        tmp_path, megatron_clip, train_data):
    other = _other_python()
    if other is None:
        pytest.skip(f"no other venv beside {sys.prefix} ({' or '.join(VENVS)} in the checkout): "
                    "CI's second leg builds .venv312 (bash scripts/setup_env.sh --dev --python 3.12)")
    releases = {sys.executable: _megatron_core(sys.executable), other: _megatron_core(other)}
    if len(set(releases.values())) == 1:
        pytest.skip(f"both venvs have megatron-core {releases[other]}: nothing to cross")
    for first, second in ((sys.executable, other), (other, sys.executable)):
        name = f"{releases[first]}_to_{releases[second]}"
        save = tmp_path / name / "run"
        train(2, *trainer_args(megatron_clip, train_data, save, **RUN), timeout=300, python=first)
        assert (save / layout.snapshot_name(2) / "common.pt").is_file(), name  # what 0.16 reads
        expected = metrics(save)
        got = _resumed_on(second, save, tmp_path / name / "resumed", megatron_clip, train_data)
        assert sorted(got) == [3, 4], name
        for iteration in (3, 4):
            for key in ("samples_digest", "loss", "grad_norm", "lr"):
                assert got[iteration][key] == expected[iteration][key], (name, iteration, key)
