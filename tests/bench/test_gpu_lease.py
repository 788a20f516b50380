"""bench/gpu_lease.sh: every benchmark it runs on a lent GPU takes the flags it is given (parsed here,
not run), so a lease is not spent on a typo."""

from __future__ import annotations

import importlib
import shlex

import click
import pytest

from tests.support.helpers import REPO_ROOT

LEASE = REPO_ROOT / "bench" / "gpu_lease.sh"


def _benchmark_steps() -> list[tuple[str, list[str]]]:
    """(script, its arguments) of each `step` line that runs a bench/ script."""
    steps = []
    for line in LEASE.read_text().splitlines():
        words = shlex.split(line) if line.startswith("step ") else []
        if words[4:] and words[4].startswith("bench/"):
            steps.append((words[4], words[5:]))
    return steps


def _command(script: str) -> click.Command:
    return importlib.import_module(script.removesuffix(".py").replace("/", ".")).main


def test_the_lease_runs_the_profile_the_llava_and_qwen_vl_benchmarks_and_the_tower_attention():
    assert {script for script, _ in _benchmark_steps()} == {
        "bench/gpu_profile.py", "bench/gpu_bench.py", "bench/qwen_vl_bench.py", "bench/tower_attention_bench.py"}


@pytest.mark.parametrize("script,args", _benchmark_steps(), ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_each_benchmark_takes_the_flags_the_lease_gives_it(script, args):
    _command(script).make_context(script, list(args))
